"""Many requests at once through the real processes, batched: every output stays the
target's own greedy output while sessions of different lengths join and leave
mid-batch, with cancels and resyncs among them, and the verifier really ran them in
shared passes."""

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from cluster import PROMPTS, Stream, eventually, generate, pb, reference

MAX_NEW = 40
LONG = 300


@pytest.fixture(scope="module")
def cases(tiny_pair, smol_tokenizer):
    out = []
    for prompt in PROMPTS:
        ids = smol_tokenizer(prompt)["input_ids"]
        out.append((ids, reference(tiny_pair[2], ids, MAX_NEW)))
    return out


@pytest.mark.parametrize("concurrency", [2, 16])
def test_concurrent_streams_match_target(tiny_cluster, cases, concurrency):
    """Prompts of different lengths, different K (fixed, 0, chosen per round), model,
    prompt-lookup and overlapping drafters, requests of different lengths started at
    staggered times: they join and leave the verifier's batch mid-way."""
    roles = ["model", "ngram", "overlap"]
    ks = [None, 0, 1, 4]
    lengths = [MAX_NEW, 12, 25]
    jobs = [(i, roles[i % 3], ks[i % 4], lengths[i % 3]) for i in range(max(concurrency, 12))]
    stubs = {role: tiny_cluster.orchestrator_stub(tiny_cluster.roles[role]) for role in roles}

    def one(job):
        i, role, k, max_new = job
        time.sleep(0.02 * (i % 5))
        ids, want = cases[i % len(cases)]
        fields = {} if k is None else {"num_speculative_tokens": k}
        _, result = generate(stubs[role], token_ids=pb.TokenIds(ids=ids), max_new_tokens=max_new, **fields)
        return list(result.token_ids), want[:max_new], result.stats

    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, jobs))
    for (got, want, _), job in zip(results, jobs):
        assert got == want, job
    if concurrency >= 8:  # the verifier ran rounds of several sessions in one pass
        assert max(stats.mean_batch_rows for _, _, stats in results) > 1.2
    assert all(stats.mean_batch_rows >= 1 for _, _, stats in results)


def test_cancels_and_resyncs_inside_a_batch(tiny_cluster, tiny_pair, smol_tokenizer):
    """Eight long streams share the verifier's passes; three are cancelled by their
    clients and two lose their sessions on both services mid-way. The others finish with
    the target's tokens, the lost ones resync, and the cancelled ones are released."""
    roles = tiny_cluster.roles
    stub = tiny_cluster.orchestrator_stub(roles["model"])
    ids = smol_tokenizer(PROMPTS[5])["input_ids"]
    want = reference(tiny_pair[2], ids, LONG)
    streams = {}

    def start(i):
        streams[i] = Stream(stub, request_id=f"batch-{i}", token_ids=pb.TokenIds(ids=ids[:len(ids) - i % 3]),
                            max_new_tokens=LONG, num_speculative_tokens=1 + i % 3)

    threads = [threading.Thread(target=start, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sessions = {i: tiny_cluster.session_of(roles["model"], f"batch-{i}") for i in range(8)}
    for i in (1, 4, 6):
        streams[i].call.cancel()
    for i in (2, 5):
        assert tiny_cluster.close_session(roles["verifier"], sessions[i])
        tiny_cluster.close_session(roles["model-drafter"], sessions[i])
    finishing = [i for i in range(8) if i not in (1, 4, 6)]
    with ThreadPoolExecutor(len(finishing)) as pool:
        results = dict(zip(finishing, pool.map(lambda i: streams[i].finish(), finishing)))
    for i, result in results.items():
        expected = want if i % 3 == 0 else reference(tiny_pair[2], ids[:len(ids) - i % 3], LONG)
        assert list(result.token_ids) == expected, i
    assert results[2].stats.resyncs >= 1 and results[5].stats.resyncs >= 1
    assert max(r.stats.mean_batch_rows for r in results.values()) > 1.2
    for service in (roles["verifier"], roles["model-drafter"]):  # released right after each call ends
        eventually(lambda: not set(sessions.values()) & tiny_cluster.sessions(service))


def test_sampled_outputs_do_not_depend_on_the_batch(tiny_cluster, tiny_pair, smol_tokenizer):
    """A seeded sampled request gives the same tokens alone and among 7 others."""
    stub = tiny_cluster.orchestrator_stub(tiny_cluster.roles["model"])
    ids = smol_tokenizer(PROMPTS[3])["input_ids"]

    def run(seed):
        return list(generate(stub, token_ids=pb.TokenIds(ids=ids), max_new_tokens=30, temperature=1.0, top_k=50,
                             seed=seed, num_speculative_tokens=3)[1].token_ids)

    alone = {seed: run(seed) for seed in range(8)}
    seeds = random.Random(0).sample(range(8), 8)
    with ThreadPoolExecutor(8) as pool:
        together = dict(zip(seeds, pool.map(run, seeds)))
    assert together == alone
    assert len({tuple(t) for t in alone.values()}) > 1


def test_a_burst_above_the_running_limit_waits_its_turn(tiny_cluster, tiny_pair, cases):
    """10 requests at once against an orchestrator that runs 2 at a time: the others wait
    (first come, first served) and every one is served exact (before, 8 were answered
    RESOURCE_EXHAUSTED at once)."""
    from cluster import orchestrator

    roles = tiny_cluster.roles
    limited = orchestrator(roles["verifier"], [roles["ngram-drafter"]], tiny_pair[0], "orchestrator-limited",
                           extra=["--max-concurrent-requests", "2", "--max-queued-requests", "8"])
    tiny_cluster.start(limited)
    stub = tiny_cluster.orchestrator_stub(limited)
    burst = threading.Barrier(10)

    def one(i):
        ids, want = cases[i % len(cases)]
        burst.wait()
        _, result = generate(stub, token_ids=pb.TokenIds(ids=ids), max_new_tokens=MAX_NEW, timeout=120)
        return list(result.token_ids) == want

    with ThreadPoolExecutor(10) as pool:
        assert all(pool.map(one, range(10)))
