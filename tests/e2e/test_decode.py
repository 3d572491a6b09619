"""The verifier's Decode, on a real verifier process: the target alone as a stream of
tokens, the same tokens that one Verify call per token without drafts gives (greedy
and seeded sampling), stopping at a stop token, and a client that stops reading early
leaves a session the next call picks up from what it read."""

import pytest

from cluster import verifier_pb2
from specdec.api.common.v1 import common_pb2

PROMPT = [1, 17, 230, 42, 9, 311, 5]
PARAMS = [common_pb2.SamplingParams(top_p=1.0),
          common_pb2.SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=11)]


def stepwise(stub, session, prompt, n, params):
    history = list(prompt)
    start = 0
    for _ in range(n):
        response = stub.Verify(verifier_pb2.VerifyRequest(session_id=session, start=start,
                                                          new_tokens=history[start:], sampling=params), timeout=30)
        start = len(history)
        history.append(response.next_token)
    stub.CloseSession(verifier_pb2.CloseSessionRequest(session_id=session), timeout=10)
    return history[len(prompt):]


@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "sampled"])
def test_decode_gives_the_tokens_of_verify_without_drafts(tiny_cluster, params):
    stub = tiny_cluster.verifier_stub(tiny_cluster.roles["verifier"])
    want = stepwise(stub, f"steps-{params.seed}", PROMPT, 24, params)
    got, rows = [], []
    for message in stub.Decode(iter([verifier_pb2.DecodeRequest(
            session_id=f"decode-{params.seed}", start=0, new_tokens=PROMPT, sampling=params, max_tokens=24)]),
            timeout=60):
        got.append(message.token_id)
        rows.append(message.batch_pass.rows)
    assert got == want and len(set(want)) > 3  # not a degenerate repeat
    assert min(rows) >= 1
    # It stops after a stop token, which it sends.
    stop = want[5]
    first = want.index(stop)
    stopped = [m.token_id for m in stub.Decode(iter([verifier_pb2.DecodeRequest(
        session_id=f"decode-{params.seed}", start=len(PROMPT), sampling=params, max_tokens=24,
        stop_token_ids=[stop])]), timeout=60)]
    assert stopped == want[:first + 1]
    stub.CloseSession(verifier_pb2.CloseSessionRequest(session_id=f"decode-{params.seed}"), timeout=10)


def test_a_decode_read_in_part_leaves_a_session_to_go_on_from(tiny_cluster):
    params = PARAMS[0]
    stub = tiny_cluster.verifier_stub(tiny_cluster.roles["verifier"])
    want = stepwise(stub, "steps-part", PROMPT, 20, params)
    call = stub.Decode(iter([verifier_pb2.DecodeRequest(
        session_id="part", start=0, new_tokens=PROMPT, sampling=params,
        max_tokens=20)]), timeout=60)
    read = [next(call).token_id for _ in range(4)]
    call.cancel()
    assert read == want[:4]
    # The caller says what it holds: the prompt and the 4 tokens it read.
    rest = [m.token_id for m in stub.Decode(iter([verifier_pb2.DecodeRequest(
        session_id="part", start=len(PROMPT) + 4, sampling=params, max_tokens=16)]), timeout=60)]
    assert rest == want[4:]
    stub.CloseSession(verifier_pb2.CloseSessionRequest(session_id="part"), timeout=10)
    assert "part" not in tiny_cluster.sessions(tiny_cluster.roles["verifier"])


def test_a_cancelled_decode_is_over_before_the_next_call_on_its_session(tiny_cluster):
    """A caller that cancels a Decode and at once sends the next call on the session (an
    orchestrator cutting a run for a lookup round) finds the session as it left it: the
    stream's decoding ended before the call could hold the session. Repeated, as the
    cancel lands at different points of the stream."""
    params = PARAMS[0]
    stub = tiny_cluster.verifier_stub(tiny_cluster.roles["verifier"])
    want = stepwise(stub, "steps-cut", PROMPT, 12, params)
    for attempt in range(30):
        session = f"cut-{attempt}"
        read = 2 + attempt % 5
        call = stub.Decode(iter([verifier_pb2.DecodeRequest(
            session_id=session, start=0, new_tokens=PROMPT,
            sampling=params, max_tokens=200)]), timeout=60)
        got = [next(call).token_id for _ in range(read)]
        call.cancel()
        start = len(PROMPT) + read
        response = stub.Verify(verifier_pb2.VerifyRequest(session_id=session, start=start,
                                                          draft_tokens=want[read:read + 3], sampling=params),
                               timeout=30)
        assert got == want[:read]
        assert (response.num_accepted, response.next_token) == (3, want[read + 3]), attempt
        stub.CloseSession(verifier_pb2.CloseSessionRequest(session_id=session), timeout=10)
