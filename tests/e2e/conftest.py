import pytest

from cluster import Cluster, drafter, orchestrator, verifier
from deploy.launch import free_port


@pytest.fixture(scope="package")
def tiny_cluster(tiny_pair):
    """The tiny pair as real processes: one verifier, a model drafter, a prompt-lookup
    drafter and a hybrid one, an orchestrator for each drafter, and one that overlaps
    drafting with verification on the model drafter."""
    target_dir, draft_dir, _ = tiny_pair
    cluster = Cluster()
    v = verifier(target_dir, extra=["--metrics-port", str(metrics := free_port())])
    v.metrics_port = metrics
    model_drafter = drafter(draft_dir, "model-drafter", extra=["--metrics-port", str(metrics := free_port())])
    model_drafter.metrics_port = metrics
    ngram_drafter = drafter(None, "ngram-drafter")
    hybrid_drafter = drafter(draft_dir, "hybrid-drafter", proposer="hybrid")
    cluster.start(v, model_drafter, ngram_drafter, hybrid_drafter)
    with_model = orchestrator(v, [model_drafter], target_dir, "orchestrator-model")
    with_ngram = orchestrator(v, [ngram_drafter], target_dir, "orchestrator-ngram")
    with_hybrid = orchestrator(v, [hybrid_drafter], target_dir, "orchestrator-hybrid")
    overlapping = orchestrator(v, [model_drafter], target_dir, "orchestrator-overlap", extra=["--overlap"])
    cluster.start(with_model, with_ngram, with_hybrid, overlapping)
    cluster.roles = {"verifier": v, "model-drafter": model_drafter, "ngram-drafter": ngram_drafter,
                     "hybrid-drafter": hybrid_drafter, "model": with_model, "ngram": with_ngram,
                     "hybrid": with_hybrid, "overlap": overlapping}
    yield cluster
    cluster.close()

