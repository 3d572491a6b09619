"""Soak: 10,000 requests, a fifth of them cancelled at random points, on the tiny pair:
the services' resident memory grows less than 10% after warm-up and no session is left.
Slow (several minutes): `pytest -m slow tests/reliability/test_soak.py -s` prints the figures."""

import os
import random
import time

import pytest

from cluster import Cluster, drafter, orchestrator, reference, verifier
from load import run_clients

PROMPTS = ["Once upon a time", "The weather today", "Numbers and letters", "Why the sky is blue",
           "A short poem about", "How to build a boat", "The capital city of", "An old map shows"]
NEW_TOKENS = 24


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads resident memory from /proc")
def test_10000_requests_with_cancellations(tiny_pair, smol_tokenizer):
    target_dir, draft_dir, model = tiny_pair
    cases = []
    for prompt in PROMPTS:
        ids = smol_tokenizer(prompt)["input_ids"]
        cases.append((ids, reference(model, ids, NEW_TOKENS)))
    v, d = verifier(target_dir, "soak-verifier"), drafter(draft_dir, "soak-drafter")
    o = orchestrator(v, [d], target_dir, "soak-orchestrator")
    cluster = Cluster()
    cluster.start(v, d)
    cluster.start(o)
    rng = random.Random(0)
    counts = {"ok": 0, "cancelled": 0}

    def batch(n: int) -> None:
        picks = [rng.randrange(len(cases)) for _ in range(n)]
        plan = [(cases[i][0], rng.choice([0, 1, 3, 5]), rng.randint(1, 5) if rng.random() < 0.2 else None)
                for i in picks]
        for (ids, k, cancel), outcome, i in zip(plan, run_clients(o.address, plan, 32), picks):
            if cancel is not None:
                assert outcome == ("cancelled",) or (outcome[0] == "ok" and outcome[1] == cases[i][1])
            else:
                assert outcome[0] == "ok" and outcome[1] == cases[i][1] and len(outcome[2]) == 1, outcome[0]
            counts[outcome[0]] += 1

    try:
        started = time.monotonic()
        batch(1000)  # warm-up: pools, caches and allocator arenas reach their working size
        warm = {s.name: rss_bytes(s.process.pid) for s in (v, d, o)}
        for _ in range(9):
            batch(1000)
        elapsed = time.monotonic() - started
        end = {s.name: rss_bytes(s.process.pid) for s in (v, d, o)}
        time.sleep(1.0)
        for service in (v, d):
            assert cluster.sessions(service) == set(), service.name
        growth = {name: (end[name] - warm[name]) / warm[name] for name in warm}
        print(f"soak: 10000 requests in {elapsed:.0f} s ({counts}); resident memory after warm-up -> end: "
              + ", ".join(f"{name} {warm[name] / 2 ** 20:.0f} -> {end[name] / 2 ** 20:.0f} MiB "
                          f"({100 * growth[name]:+.1f}%)" for name in warm) + "; 0 sessions left")
        assert all(g < 0.10 for g in growth.values()), growth
    finally:
        cluster.close()
