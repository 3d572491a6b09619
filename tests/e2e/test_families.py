"""A checkpoint of each Llama-family model (tests/models.py, FAMILIES) served through the
three services with the CPU's default numerics for it (`--quantize auto`: q8_m blocks,
the layers in one kernel call), the verifier at more threads than this machine's cores:
greedy speculation and the target alone token-identical to the quantized target's own
`generate`. And a GGUF file of K-quant blocks (Q4_K_M's mix) on its own blocks, the same way."""

import pytest

import cluster
from cluster import Cluster, cases, drafter, drafter_pb2, generate, orchestrator, pb, verifier, verifier_pb2
from models import FAMILIES, bpe_tokenizer, build_family, noisy_copy, write_gguf
from specdec.runtime import ggml, modeling, quantize

AUTO = ["--quantize", "auto"]
PROMPTS = cluster.PROMPTS[:4]
MAX_NEW = 32
# Beside the checkpoints (on q8_m blocks): a Qwen2 GGUF file of llama.cpp's Q4_K_M mix, on
# the file's own Q4_K and Q6_K blocks, drafted by a checkpoint near it.
Q4_K_M = "qwen2 Q4_K_M"
CASES = (*FAMILIES, Q4_K_M)


def q4_k_m(name: str) -> int:
    return ggml.Q6_K if name.endswith(("attn_v.weight", "ffn_down.weight")) or name == "output.weight" else ggml.Q4_K


@pytest.fixture(scope="module")
def families(tmp_path_factory, smol_tokenizer):
    """{case: (orchestrator, (verifier, drafter, root, {prompt: (ids, the target's greedy output)}))}"""
    built, services = {}, Cluster()
    # The file's vocabulary small: llama.cpp's GGUF vocabulary is rebuilt at each conversion.
    small = bpe_tokenizer(PROMPTS * 4, vocab_size=400)
    try:
        for case in CASES:
            root = tmp_path_factory.mktemp(case.replace(" ", "-"))
            family, tokenizer = ("qwen2", small) if case == Q4_K_M else (case, smol_tokenizer)
            # A K type's blocks hold 256 columns: the file's model is as wide.
            target = build_family(family, tokenizer, root / "target", seed=5,
                                  **(dict(hidden=256, init_range=0.05) if case == Q4_K_M else {}))
            noisy_copy(target, tokenizer, root / "draft", noise=0.05, seed=6)
            served = write_gguf(target, tokenizer, root / "target.gguf", q4_k_m) if case == Q4_K_M \
                else root / "target"
            model, _ = modeling.load_model(str(served))
            want = cases(quantize.quantize(model, "auto"), tokenizer, PROMPTS, MAX_NEW)
            v = verifier(served, f"verifier-{family}", extra=[*AUTO, "--threads", "3"])
            d = drafter(root / "draft", f"drafter-{family}", extra=AUTO)
            built[case] = (v, d, root, want)
        services.start(*[s for v, d, _, _ in built.values() for s in (v, d)])
        orchestrators = {c: orchestrator(v, [d], root / "target", f"orchestrator-{c.replace(' ', '-')}")
                         for c, (v, d, root, _) in built.items()}
        services.start(*orchestrators.values())
        yield services, {c: (orchestrators[c], built[c]) for c in CASES}
    finally:
        services.close()


@pytest.mark.parametrize("family", CASES)
def test_each_family_served_on_its_blocks_is_the_target_alone(families, family):
    services, by_family = families
    service, (v, d, _, expected) = by_family[family]
    numerics = {"verifier": "q8_m/float32/cpu/layer-kernel", "drafter": "q8_m/float32/cpu/layer-kernel"}
    if family == Q4_K_M:  # its own blocks (q, k and v of two types: three parts of the layer kernel's product)
        numerics["verifier"] = "gguf/float32/cpu/layer-kernel"
    for role, info in (("verifier", services.verifier_stub(v).GetModelInfo(verifier_pb2.GetModelInfoRequest(),
                                                                          timeout=10)),
                       ("drafter", services.drafter_stub(d).GetModelInfo(drafter_pb2.GetModelInfoRequest(),
                                                                        timeout=10))):
        assert info.info.numerics == numerics[role], role
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
