"""Lost sessions, lost drafters and a lost verifier: the output stays the target's, and
sessions are released on both services after finish, cancel, deadline and error."""

import time

import grpc
import pytest

from cluster import Stream, drafter, drafter_pb2, generate, orchestrator, pb, reference, verifier, verifier_pb2

PROMPT = "In the beginning the universe was created. This has made a lot of people very angry"
LONG = 600


@pytest.fixture(scope="module")
def long_case(tiny_pair, smol_tokenizer):
    ids = smol_tokenizer(PROMPT)["input_ids"]
    want = reference(tiny_pair[2], ids, LONG)
    assert len(want) == LONG  # no early EOS: the request runs long enough to be interrupted
    return ids, want


def session_was_released(cluster, service, session_id: str) -> bool:
    """Closing it ourselves finds nothing to close. (Wait first: the orchestrator
    releases sessions right after the call ends, not before it answers.)"""
    time.sleep(0.5)
    request_type = drafter_pb2 if "drafter" in service.name else verifier_pb2
    stub = cluster.drafter_stub(service) if "drafter" in service.name else cluster.verifier_stub(service)
    return not stub.CloseSession(request_type.CloseSessionRequest(session_id=session_id), timeout=5).closed


@pytest.mark.parametrize("role", ["model", "overlap"])
def test_lost_sessions_resync_and_output_is_unchanged(tiny_cluster, long_case, role):
    ids, want = long_case
    roles = tiny_cluster.roles
    stub = tiny_cluster.orchestrator_stub(roles[role])
    session = f"lost-{role}"
    stream = Stream(stub, request_id=session, token_ids=pb.TokenIds(ids=ids),
                    max_new_tokens=LONG, num_speculative_tokens=4)
    # Both services forget the session mid-request (as after a restart).
    assert tiny_cluster.drafter_stub(roles["model-drafter"]).CloseSession(
        drafter_pb2.CloseSessionRequest(session_id=session)).closed
    assert tiny_cluster.verifier_stub(roles["verifier"]).CloseSession(
        verifier_pb2.CloseSessionRequest(session_id=session)).closed
    result = stream.finish()
    assert list(result.token_ids) == want
    assert result.stats.resyncs == 2


def test_sessions_released_after_finish(tiny_cluster):
    roles = tiny_cluster.roles
    generate(tiny_cluster.orchestrator_stub(roles["model"]), request_id="fin-1", text="Hello", max_new_tokens=8)
    assert session_was_released(tiny_cluster, roles["model-drafter"], "fin-1")
    assert session_was_released(tiny_cluster, roles["verifier"], "fin-1")


def test_sessions_released_after_complete(tiny_cluster):
    roles = tiny_cluster.roles
    stub = tiny_cluster.orchestrator_stub(roles["model"])
    stub.Complete(pb.GenerateRequest(request_id="unary-1", text="Hello", max_new_tokens=8), timeout=60)
    assert session_was_released(tiny_cluster, roles["model-drafter"], "unary-1")
    assert session_was_released(tiny_cluster, roles["verifier"], "unary-1")


@pytest.mark.parametrize("role", ["model", "overlap"])
def test_sessions_released_after_client_cancel(tiny_cluster, long_case, role):
    roles = tiny_cluster.roles
    stub = tiny_cluster.orchestrator_stub(roles[role])
    session = f"cancel-{role}"
    stream = Stream(stub, request_id=session, token_ids=pb.TokenIds(ids=long_case[0]), max_new_tokens=LONG)
    stream.call.cancel()
    assert session_was_released(tiny_cluster, roles["model-drafter"], session)
    assert session_was_released(tiny_cluster, roles["verifier"], session)
    # The id is free again.
    generate(stub, request_id=session, text="Hello", max_new_tokens=4)


def test_sessions_released_after_stop_string(tiny_cluster, long_case, smol_tokenizer):
    """A stop string ends the request between rounds, while the next round is being
    drafted ahead: that drafting stops and both sessions are released."""
    ids, want = long_case
    roles = tiny_cluster.roles
    stop = smol_tokenizer.decode(want[20:23])
    _, result = generate(tiny_cluster.orchestrator_stub(roles["overlap"]), request_id="stop-overlap",
                         token_ids=pb.TokenIds(ids=ids), max_new_tokens=LONG, num_speculative_tokens=2, stop=[stop])
    assert result.finish_reason == pb.FINISH_REASON_STOP and result.stop_sequence == stop
    assert len(result.token_ids) < LONG
    assert session_was_released(tiny_cluster, roles["model-drafter"], "stop-overlap")
    assert session_was_released(tiny_cluster, roles["verifier"], "stop-overlap")


def test_sessions_released_after_deadline(tiny_cluster, long_case):
    roles = tiny_cluster.roles
    stub = tiny_cluster.orchestrator_stub(roles["model"])
    with pytest.raises(grpc.RpcError) as err:
        generate(stub, timeout=0.5, request_id="late-1", token_ids=pb.TokenIds(ids=long_case[0]),
                 max_new_tokens=LONG)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert session_was_released(tiny_cluster, roles["model-drafter"], "late-1")
    assert session_was_released(tiny_cluster, roles["verifier"], "late-1")


def test_killing_the_only_drafter_finishes_on_the_verifier_then_it_comes_back(tiny_cluster, tiny_pair, long_case):
    ids, want = long_case
    target_dir, draft_dir, _ = tiny_pair
    d = drafter(draft_dir, "drafter-to-kill")
    tiny_cluster.start(d)
    o = orchestrator(tiny_cluster.roles["verifier"], [d], target_dir, "orchestrator-one-drafter")
    tiny_cluster.start(o)
    stub = tiny_cluster.orchestrator_stub(o)
    stream = Stream(stub, token_ids=pb.TokenIds(ids=ids), max_new_tokens=LONG,
                                                   num_speculative_tokens=4)
    tiny_cluster.kill(d)
    result = stream.finish()
    assert list(result.token_ids) == want
    assert result.stats.drafter_failovers >= 1
    # A replica restarted on the same address is used again.
    back = drafter(draft_dir, "drafter-restarted", port=d.port)
    tiny_cluster.start(back)
    time.sleep(4)  # the pool retries a failed replica after 2 s; its channel reconnects within 2 s
    _, result = generate(stub, token_ids=pb.TokenIds(ids=ids), max_new_tokens=40, num_speculative_tokens=4)
    assert list(result.token_ids) == want[:40]
    assert result.stats.accepted_tokens > 0 and result.stats.drafter_failovers == 0


def test_failover_to_another_replica(tiny_cluster, tiny_pair, long_case):
    ids, want = long_case
    target_dir, draft_dir, _ = tiny_pair
    first_replica, second_replica = drafter(draft_dir, "replica-a"), drafter(draft_dir, "replica-b")
    tiny_cluster.start(first_replica, second_replica)
    o = orchestrator(tiny_cluster.roles["verifier"], [first_replica, second_replica], target_dir,
                     "orchestrator-two-drafters")
    tiny_cluster.start(o)
    stream = Stream(tiny_cluster.orchestrator_stub(o), request_id="failover-1",
                                                   token_ids=pb.TokenIds(ids=ids), max_new_tokens=LONG)
    # On a tie the pool pairs the request with the first replica listed: kill that one.
    tiny_cluster.kill(first_replica)
    result = stream.finish()
    assert list(result.token_ids) == want
    assert result.stats.drafter_failovers == 1
    # The rest of the request was still drafted, by the other replica.
    assert result.stats.accepted_tokens > 0


def test_verifier_loss_fails_the_request_and_releases_the_drafter_session(tiny_cluster, tiny_pair, long_case):
    ids, _ = long_case
    target_dir, draft_dir, _ = tiny_pair
    v, d = verifier(target_dir, "verifier-to-kill"), drafter(draft_dir, "drafter-of-lost-verifier")
    tiny_cluster.start(v, d)
    o = orchestrator(v, [d], target_dir, "orchestrator-lost-verifier")
    tiny_cluster.start(o)
    stream = Stream(tiny_cluster.orchestrator_stub(o), request_id="noverifier-1",
                                                   token_ids=pb.TokenIds(ids=ids), max_new_tokens=LONG)
    tiny_cluster.kill(v)
    with pytest.raises(grpc.RpcError) as err:
        stream.finish()
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert session_was_released(tiny_cluster, d, "noverifier-1")
