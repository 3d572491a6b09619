"""No state is shared between requests, whatever their labels: the orchestrator mints
each request's session ids, so two requests with one request_id (on two orchestrator
replicas, or on one) both get the target's own output."""

import threading

import pytest

from cluster import generate, pb, reference

PROMPTS = ["The history of the printing press", "Rivers of the world", "A recipe for bread", "The rules of chess"]


@pytest.fixture(scope="module")
def cases(tiny_pair, smol_tokenizer):
    out = []
    for prompt in PROMPTS:
        ids = smol_tokenizer(prompt)["input_ids"]
        out.append((ids, reference(tiny_pair[2], ids, 80)))
    return out


def run_together(calls) -> list:
    """Runs the calls at once; -> their results in order."""
    results = [None] * len(calls)
    barrier = threading.Barrier(len(calls))

    def run(i):
        barrier.wait()
        results[i] = calls[i]()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


@pytest.mark.parametrize("where", ["two orchestrators", "one orchestrator"])
def test_requests_sharing_a_request_id_share_nothing(shared_cluster, cases, where):
    """Before session ids were minted, the first case wrote one verifier session from
    two requests and gave wrong tokens; the second refused the later request."""
    roles = shared_cluster.roles
    orchestrators = [roles["a"], roles["b"]] if where == "two orchestrators" else [roles["a"], roles["a"]]
    calls = []
    for ids, want in cases:
        for o in orchestrators:
            stub = shared_cluster.orchestrator_stub(o)
            calls.append(lambda stub=stub, ids=ids: generate(stub, request_id="same-id", token_ids=pb.TokenIds(ids=ids),
                                                             max_new_tokens=80, num_speculative_tokens=3)[1])
    results = run_together(calls)
    wants = [want for _, want in cases for _ in orchestrators]
    for result, want in zip(results, wants):
        assert list(result.token_ids) == want
        assert result.request_id == "same-id"
    assert sum(r.stats.accepted_tokens for r in results) > 0


def test_a_request_id_is_never_a_session_id(shared_cluster, cases):
    """Whatever the client calls its request, the sessions on the services carry ids the
    orchestrator made, one per request."""
    roles = shared_cluster.roles
    ids, _ = cases[0]
    stubs = [shared_cluster.orchestrator_stub(roles[name]) for name in ("a", "b")]
    seen = set()
    for stub, label in zip(stubs, ["x", "x"]):
        call = stub.Generate(pb.GenerateRequest(request_id=label, token_ids=pb.TokenIds(ids=ids),
                                                max_new_tokens=400, num_speculative_tokens=3), timeout=60)
        next(iter(call))
        held = shared_cluster.sessions(roles["verifier"])
        assert "x" not in held and held - seen
        seen |= held
        call.cancel()
    assert len(seen) >= 2
