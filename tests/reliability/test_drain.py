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


def test_sigterm_releases_the_sessions_of_http_requests_it_cuts(shared_cluster, tiny_pair):
    """An HTTP request still generating when the grace ends is cancelled; the sessions it
    held are closed before the process goes. Before, asyncio.run cancelled the handler as
    the loop ended and the close its `finally` started died with the loop: the verifier
    and drafter kept the sessions until their idle timeout."""
    import json
    import socket

    from deploy.launch import free_port

    roles = shared_cluster.roles
    http = free_port()
    o = orchestrator(roles["verifier"], [roles["model-drafter"]], tiny_pair[0], "orchestrator-http-drained",
                     extra=["--shutdown-grace", "1", "--http-port", str(http), "--served-model-name", "target"])
    shared_cluster.start(o)
    body = json.dumps({"model": "target", "prompt": "A long story about the sea", "max_tokens": 4000,
                       "temperature": 0}).encode()
    client = socket.create_connection(("127.0.0.1", http))
    client.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(body)}\r\n\r\n").encode() + body)
    admin = shared_cluster.admin_stub(o)
    deadline = time.monotonic() + 20
    while not admin.ListRequests(pb.ListRequestsRequest(), timeout=5).requests and time.monotonic() < deadline:
        time.sleep(0.05)
    (request,) = admin.ListRequests(pb.ListRequestsRequest(), timeout=5).requests
    assert request.session_id in shared_cluster.sessions(roles["verifier"])
    o.process.send_signal(signal.SIGTERM)
    assert o.process.wait(timeout=30) == 0
    client.close()
    assert request.session_id not in shared_cluster.sessions(roles["verifier"])
    assert request.session_id not in shared_cluster.sessions(roles["model-drafter"])
