"""A checkpoint of each Llama-family model (tests/models.py, FAMILIES) served through the
three services with the CPU's default numerics for it (`--quantize auto`: q8_m blocks,
the layers in one kernel call), the verifier at more threads than this machine's cores:
greedy speculation and the target alone token-identical to the quantized target's own
`generate`."""

import pytest

import cluster
from cluster import Cluster, cases, drafter, drafter_pb2, generate, orchestrator, pb, verifier, verifier_pb2
from models import FAMILIES, build_family, noisy_copy
from specdec.runtime import modeling, quantize

AUTO = ["--quantize", "auto"]
PROMPTS = cluster.PROMPTS[:4]
MAX_NEW = 32


@pytest.fixture(scope="module")
def families(tmp_path_factory, smol_tokenizer):
    """{family: (orchestrator, {prompt: (ids, the target's greedy output)})}"""
    built, services = {}, Cluster()
    try:
        for family in FAMILIES:
            root = tmp_path_factory.mktemp(family)
            target = build_family(family, smol_tokenizer, root / "target", seed=5)
            noisy_copy(target, smol_tokenizer, root / "draft", noise=0.05, seed=6)
            model, _ = modeling.load_model(str(root / "target"))
            want = cases(quantize.quantize(model, "auto"), smol_tokenizer, PROMPTS, MAX_NEW)
            v = verifier(root / "target", f"verifier-{family}", extra=[*AUTO, "--threads", "3"])
            d = drafter(root / "draft", f"drafter-{family}", extra=AUTO)
            built[family] = (v, d, root, want)
        services.start(*[s for v, d, _, _ in built.values() for s in (v, d)])
        orchestrators = {f: orchestrator(v, [d], root / "target", f"orchestrator-{f}")
                         for f, (v, d, root, _) in built.items()}
        services.start(*orchestrators.values())
        yield services, {f: (orchestrators[f], built[f]) for f in FAMILIES}
    finally:
        services.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_served_on_its_blocks_is_the_target_alone(families, family):
    services, by_family = families
    service, (v, d, _, expected) = by_family[family]
    for info in (services.verifier_stub(v).GetModelInfo(verifier_pb2.GetModelInfoRequest(), timeout=10),
                 services.drafter_stub(d).GetModelInfo(drafter_pb2.GetModelInfoRequest(), timeout=10)):
        assert info.info.numerics == "q8_m/float32/cpu/layer-kernel"
    stub = services.orchestrator_stub(service)
    drafted = accepted = 0
    for prompt, (ids, want) in expected.items():
        for k in (4, 0):
            _, result = generate(stub, token_ids=pb.TokenIds(ids=ids), max_new_tokens=MAX_NEW,
                                 num_speculative_tokens=k)
            assert list(result.token_ids) == want, (family, prompt, k)
            drafted += result.stats.draft_tokens
            accepted += result.stats.accepted_tokens
    assert 0 < accepted < drafted, (accepted, drafted)  # both the accept and the correction paths ran
