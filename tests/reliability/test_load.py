"""Under load: many concurrent streaming Generate calls, every one ending with exactly
one Result and the target's own tokens; cancellations at random points leave the others
exact and leak no session; a client deadline against a stalled verifier answers at once."""

import os
import random
import signal
import time

import grpc
import pytest

from cluster import eventually, generate, pb, reference
from load import run_clients

PROMPTS = [f"{topic} {detail}" for topic in ("The ocean", "A small town", "Modern computers", "The moon")
           for detail in ("is", "was once", "may become", "and its history")]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def cases(tiny_pair, smol_tokenizer):
    out = []
    for prompt in PROMPTS:
        ids = smol_tokenizer(prompt)["input_ids"]
        out.append((ids, reference(tiny_pair[2], ids, NEW_TOKENS)))
    return out


def test_64_concurrent_streams_1000_requests(shared_cluster, cases):
    roles = shared_cluster.roles
    rng = random.Random(0)
    picks = [rng.randrange(len(cases)) for _ in range(1000)]
    plan = [(cases[i][0], rng.choice([0, 1, 3, 5]), None) for i in picks]
    before = {service.name: shared_cluster.sessions(service) for service in (roles["verifier"], roles["model-drafter"])}
    started = time.monotonic()
    outcomes = run_clients(roles["a"].address, plan, 64)
    elapsed = time.monotonic() - started
    failures = [o[0] for o in outcomes if o[0] != "ok"]
    assert not failures, {code: failures.count(code) for code in set(failures)}
    for (status, tokens, results), i in zip(outcomes, picks):
        assert len(results) == 1 and list(results[0].token_ids) == tokens
        assert tokens == cases[i][1]
    print(f"1000 requests, 64 at a time: 0 failed, all exact, {elapsed:.1f} s "
          f"({1000 * NEW_TOKENS / elapsed:.0f} tokens/s)")
    for service in (roles["verifier"], roles["model-drafter"]):  # none of this test's sessions is left
        eventually(lambda: shared_cluster.sessions(service) <= before[service.name])


def test_cancelling_10_of_100_streams_leaves_the_rest_exact_and_no_session(shared_cluster, cases):
    roles = shared_cluster.roles
    rng = random.Random(1)
    cancelled = set(rng.sample(range(100), 10))
    picks = [rng.randrange(len(cases)) for _ in range(100)]
    plan = [(cases[i][0], 3, rng.randint(1, 4) if n in cancelled else None) for n, i in enumerate(picks)]
    before = {service.name: shared_cluster.sessions(service) for service in (roles["verifier"], roles["model-drafter"])}
    outcomes = run_clients(roles["a"].address, plan, 50)
    for n, (outcome, i) in enumerate(zip(outcomes, picks)):
        if n in cancelled:
            assert outcome == ("cancelled",)
        else:
            assert outcome[0] == "ok" and outcome[1] == cases[i][1] and len(outcome[2]) == 1
    for service in (roles["verifier"], roles["model-drafter"]):  # every session created is released
        eventually(lambda: shared_cluster.sessions(service) <= before[service.name])


def test_a_deadline_against_a_stalled_verifier_answers_in_time(shared_cluster, cases):
    roles = shared_cluster.roles
    stub = shared_cluster.orchestrator_stub(roles["a"])
    ids, want = cases[0]
    generate(stub, token_ids=pb.TokenIds(ids=ids), max_new_tokens=4)  # warm
    verifier = roles["verifier"].process
    os.kill(verifier.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            generate(stub, timeout=0.2, token_ids=pb.TokenIds(ids=ids), max_new_tokens=NEW_TOKENS)
        answered = time.monotonic() - started
    finally:
        os.kill(verifier.pid, signal.SIGCONT)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert answered < 0.3, answered
    _, result = generate(stub, token_ids=pb.TokenIds(ids=ids), max_new_tokens=NEW_TOKENS)
    assert list(result.token_ids) == want
    print(f"a 200 ms deadline against a stalled verifier answered in {answered * 1e3:.0f} ms")
