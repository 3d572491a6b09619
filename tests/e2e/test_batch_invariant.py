"""Greedy speculation in bfloat16 gives the target alone's tokens when the verifier runs
batch-invariant passes (`--batch-invariant 8`): a verify pass of K + 1 tokens, a prompt's
chunks and a batch of sessions give each row the bits a one-token step gives it. Three
real processes (the tiny pair), the verifier in bfloat16 at 8 threads (more than this
machine's cores); the reference is the same deployment at K = 0, one request at a time:
the target alone with the same numerics. With `--batch-invariant 0` this deployment's
speculative outputs differed from it (run once, 2026-11-27), and
tests/specdec/test_static_passes.py shows the usual passes' rows differ in their bits."""

from concurrent.futures import ThreadPoolExecutor

import pytest

import cluster
from cluster import DEVICE, Cluster, drafter, generate, orchestrator, pb, verifier

PROMPTS = cluster.PROMPTS[:4]  # prose, code, a list that repeats, a story
MAX_NEW = 40


@pytest.fixture(scope="module")
def invariant(tiny_pair, smol_tokenizer):
    target_dir, draft_dir, _ = tiny_pair
    cluster = Cluster()
    graphs = ["--cuda-graphs", "on"] if DEVICE.startswith("cuda") else []  # tests/gpu: replayed from graphs
    v = verifier(target_dir, "verifier-bf16", extra=["--dtype", "bfloat16", "--batch-invariant", "8", *graphs,
                                                     "--threads", "8", "--max-batch-tokens", "24"])
    d = drafter(draft_dir, "drafter-bf16")
    cluster.start(v, d)
    o = orchestrator(v, [d], target_dir, "orchestrator-bf16")
    cluster.start(o)
    ids = [smol_tokenizer(p)["input_ids"] for p in PROMPTS]
    yield cluster.orchestrator_stub(o), ids
    cluster.close()


def run(stub, ids, k):
    _, result = generate(stub, token_ids=pb.TokenIds(ids=ids), max_new_tokens=MAX_NEW, num_speculative_tokens=k)
    return result


def test_greedy_speculation_in_bfloat16_is_the_target_alones(invariant):
    stub, prompts = invariant
    alone = [list(run(stub, ids, 0).token_ids) for ids in prompts]
    for out in alone:
        assert len(set(out)) > MAX_NEW // 4, out  # a degenerate target proves nothing
    drafted = accepted = 0
    for k in (1, 4):
        for ids, want in zip(prompts, alone):
            result = run(stub, ids, k)
            assert list(result.token_ids) == want
            drafted += result.stats.draft_tokens
            accepted += result.stats.accepted_tokens
    assert 0 < accepted < drafted  # drafts were kept and rejected: caches rewritten after rejections
    # Four requests at once: their rounds share passes, and a round's rows split between them.
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda ids: list(run(stub, ids, 4).token_ids), prompts))
    assert together == alone
