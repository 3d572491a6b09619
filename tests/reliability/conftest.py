import pytest

from cluster import Cluster, drafter, orchestrator, verifier


@pytest.fixture(scope="package")
def shared_cluster(tiny_pair):
    """One verifier and one drafter, shared by two orchestrators (as two replicas of the
    orchestrator behind one Service would share them)."""
    target_dir, draft_dir, _ = tiny_pair
    cluster = Cluster()
    v, d = verifier(target_dir), drafter(draft_dir, "model-drafter")
    cluster.start(v, d)
    first = orchestrator(v, [d], target_dir, "orchestrator-a")
    second = orchestrator(v, [d], target_dir, "orchestrator-b")
    cluster.start(first, second)
    cluster.roles = {"verifier": v, "model-drafter": d, "a": first, "b": second}
    yield cluster
    cluster.close()
