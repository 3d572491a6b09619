"""SIGTERM drains: the requests in flight finish within the configured grace, new ones
are refused at once, and the process exits 0."""

import signal
import time

import grpc
import pytest

from cluster import Stream, generate, orchestrator, pb, reference

LONG = 2000  # tokens: about 10 s on the tiny pair here, longer than the old fixed 5 s grace


def test_sigterm_lets_requests_in_flight_finish(shared_cluster, tiny_pair, smol_tokenizer):
    roles = shared_cluster.roles
    o = orchestrator(roles["verifier"], [roles["model-drafter"]], tiny_pair[0], "orchestrator-drained",
                     extra=["--shutdown-grace", "60"])
    shared_cluster.start(o)
    ids = smol_tokenizer("A long story about the sea")["input_ids"]
    stub = shared_cluster.orchestrator_stub(o)
    stream = Stream(stub, token_ids=pb.TokenIds(ids=ids), max_new_tokens=LONG, num_speculative_tokens=0)
    o.process.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    time.sleep(0.5)
    with pytest.raises(grpc.RpcError) as err:
        generate(shared_cluster.orchestrator_stub(o), text="Am I too late?", max_new_tokens=4, timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    result = stream.finish()
    assert len(result.token_ids) == LONG and result.finish_reason == pb.FINISH_REASON_LENGTH
    assert list(result.token_ids[:100]) == reference(tiny_pair[2], ids, 100)
    assert o.process.wait(timeout=30) == 0
    # It released the request's session before it went (not left to the verifier's idle timeout).
    assert shared_cluster.sessions(roles["verifier"]) == set()
    print(f"drained a {LONG}-token request for {time.monotonic() - signalled:.1f} s after SIGTERM; exit 0")
