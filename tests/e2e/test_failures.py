"""Lost sessions, lost drafters and a lost verifier: the output stays the target's, and
sessions are released on both services after finish, cancel, deadline and error."""

import time

import grpc
import pytest

from cluster import Stream, drafter, eventually, generate, orchestrator, pb, reference, verifier

PROMPT = "In the beginning the universe was created. This has made a lot of people very angry"
LONG = 600


@pytest.fixture(scope="module")
def long_case(tiny_pair, smol_tokenizer):
    ids = smol_tokenizer(PROMPT)["input_ids"]
    want = reference(tiny_pair[2], ids, LONG)
    assert len(want) == LONG  # no early EOS: the request runs long enough to be interrupted
    return ids, want


def released(cluster, session_id: str, *services, blocks_before: dict | None = None, wait_s: float = 15) -> bool:
    """None of the services holds the session any more, and with `blocks_before` (KV blocks
    used per service before the request), their pools hold no more blocks than then.
    Polled until `wait_s`: the orchestrator releases sessions right after the call ends,
    not before it answers."""
    deadline = time.monotonic() + wait_s
    while True:
        held = any(session_id in cluster.sessions(service) for service in services)
        leaked = blocks_before is not None and any(cluster.kv_blocks_used(service) > blocks_before[service.name]
                                                   for service in services)
        if not held and not leaked:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def blocks_used(cluster, *services) -> dict:
    return {service.name: cluster.kv_blocks_used(service) for service in services}


def start(cluster, orchestrator, label: str, **fields) -> tuple[Stream, str]:
    """A stream whose first chunk has come, and the session id minted for it, which both
    services hold (K is fixed, so the drafter holds it from the first round)."""
    stream = Stream(cluster.orchestrator_stub(orchestrator), request_id=label, num_speculative_tokens=4, **fields)
    session = cluster.session_of(orchestrator, label)
    roles = cluster.roles
    assert session != label and session in cluster.sessions(roles["verifier"])
    assert session in cluster.sessions(roles["model-drafter"])
    return stream, session


@pytest.mark.parametrize("role", ["model", "overlap"])
def test_lost_sessions_resync_and_output_is_unchanged(tiny_cluster, long_case, role):
    ids, want = long_case
    roles = tiny_cluster.roles
    stream, session = start(tiny_cluster, roles[role], f"lost-{role}", token_ids=pb.TokenIds(ids=ids),
                            max_new_tokens=LONG)
    # Both services forget the session mid-request (as after a restart).
    assert tiny_cluster.close_session(roles["model-drafter"], session)
    assert tiny_cluster.close_session(roles["verifier"], session)
    result = stream.finish()
    assert list(result.token_ids) == want
    assert result.stats.resyncs == 2


def test_sessions_released_after_finish(tiny_cluster, long_case):
    roles = tiny_cluster.roles
    stream, session = start(tiny_cluster, roles["model"], "fin-1", token_ids=pb.TokenIds(ids=long_case[0]),
                            max_new_tokens=40)
    assert stream.finish().request_id == "fin-1"
    assert released(tiny_cluster, session, roles["model-drafter"], roles["verifier"])


def test_sessions_released_after_complete(tiny_cluster, long_case):
    roles = tiny_cluster.roles
    stub = tiny_cluster.orchestrator_stub(roles["model"])
    call = stub.Complete.future(pb.GenerateRequest(request_id="unary-1", token_ids=pb.TokenIds(ids=long_case[0]),
                                                   max_new_tokens=200, num_speculative_tokens=4), timeout=60)
    deadline = time.monotonic() + 30
    while True:
        try:
            session = tiny_cluster.session_of(roles["model"], "unary-1")
            break
        except ValueError:  # not started yet
            assert time.monotonic() < deadline and not call.done()
            time.sleep(0.01)
    assert list(call.result().token_ids) == long_case[1][:200]
    assert released(tiny_cluster, session, roles["model-drafter"], roles["verifier"])


@pytest.mark.parametrize("role", ["model", "overlap"])
def test_sessions_released_after_client_cancel(tiny_cluster, long_case, role):
    roles = tiny_cluster.roles
    before = blocks_used(tiny_cluster, roles["model-drafter"], roles["verifier"])
    stream, session = start(tiny_cluster, roles[role], f"cancel-{role}", token_ids=pb.TokenIds(ids=long_case[0]),
                            max_new_tokens=LONG)
    during = blocks_used(tiny_cluster, roles["model-drafter"], roles["verifier"])
    assert all(during[name] > before[name] for name in before)  # the metric sees the request's blocks
    stream.call.cancel()
    # Its KV blocks went back too, on both services (checked in their metrics).
    assert released(tiny_cluster, session, roles["model-drafter"], roles["verifier"], blocks_before=before)
    # The label can be used again.
    generate(tiny_cluster.orchestrator_stub(roles[role]), request_id=f"cancel-{role}", text="Hello", max_new_tokens=4)


def test_sessions_released_after_stop_string(tiny_cluster, long_case, smol_tokenizer):
    """A stop string ends the request between rounds, while the next round is being
    drafted ahead: that drafting stops and both sessions are released."""
    ids, want = long_case
    roles = tiny_cluster.roles
    stop = smol_tokenizer.decode(want[300:303])
    stream, session = start(tiny_cluster, roles["overlap"], "stop-overlap", token_ids=pb.TokenIds(ids=ids),
                            max_new_tokens=LONG, stop=[stop])
    result = stream.finish()
    assert result.finish_reason == pb.FINISH_REASON_STOP and result.stop_sequence == stop
    assert len(result.token_ids) < LONG
    assert released(tiny_cluster, session, roles["model-drafter"], roles["verifier"])


def test_sessions_released_after_deadline(tiny_cluster, long_case):
    roles = tiny_cluster.roles
    stream, session = start(tiny_cluster, roles["model"], "late-1", timeout=1.0,
                            token_ids=pb.TokenIds(ids=long_case[0]), max_new_tokens=LONG)
    with pytest.raises(grpc.RpcError) as err:
        stream.finish()
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert released(tiny_cluster, session, roles["model-drafter"], roles["verifier"])


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

    def drafts_again():
        """A request is served with the replica's drafts (the pool retries a failed replica
        after 2 s; its channel reconnects): every request meanwhile is exact too."""
        _, result = generate(stub, token_ids=pb.TokenIds(ids=ids), max_new_tokens=40, num_speculative_tokens=4)
        assert list(result.token_ids) == want[:40]
        return result.stats.accepted_tokens > 0 and result.stats.drafter_failovers == 0

    eventually(drafts_again, timeout_s=30, interval_s=0.5)


def test_failover_to_another_replica(tiny_cluster, tiny_pair, long_case):
    ids, want = long_case
    target_dir, draft_dir, _ = tiny_pair
    first_replica, second_replica = drafter(draft_dir, "replica-a"), drafter(draft_dir, "replica-b")
    tiny_cluster.start(first_replica, second_replica)
    o = orchestrator(tiny_cluster.roles["verifier"], [first_replica, second_replica], target_dir,
                     "orchestrator-two-drafters")
    tiny_cluster.start(o)
    # K fixed: every round drafts (an adaptive K may find the tiny pair's drafts not worth a
    # round and draft only beside runs, which count no accepted tokens).
    stream = Stream(tiny_cluster.orchestrator_stub(o), request_id="failover-1",
                    token_ids=pb.TokenIds(ids=ids), max_new_tokens=LONG, num_speculative_tokens=4)
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
    o = orchestrator(v, [d], target_dir, "orchestrator-lost-verifier", extra=["--verifier-retry-timeout", "2"])
    tiny_cluster.start(o)
    stream = Stream(tiny_cluster.orchestrator_stub(o), request_id="noverifier-1",
                    token_ids=pb.TokenIds(ids=ids), max_new_tokens=LONG, num_speculative_tokens=4)
    session = tiny_cluster.session_of(o, "noverifier-1")
    assert session in tiny_cluster.sessions(d)
    tiny_cluster.kill(v)
    with pytest.raises(grpc.RpcError) as err:
        stream.finish()
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert released(tiny_cluster, session, d)


def test_every_samples_sessions_released_after_client_cancel(tiny_cluster, long_case):
    """A stream of n = 3 samples cancelled at its first chunk: the three requests end and
    their sessions, on both services, are released."""
    roles = tiny_cluster.roles
    before = blocks_used(tiny_cluster, roles["model-drafter"], roles["verifier"])
    stream = Stream(tiny_cluster.orchestrator_stub(roles["model"]), request_id="cancel-samples", n=3,
                    token_ids=pb.TokenIds(ids=long_case[0]), max_new_tokens=LONG, num_speculative_tokens=4,
                    temperature=1.0)
    def all_three_started():
        listing = tiny_cluster.admin_stub(roles["model"]).ListRequests(pb.ListRequestsRequest(), timeout=5)
        sessions = [r.session_id for r in listing.requests if r.request_id == "cancel-samples"]
        return sessions if len(sessions) == 3 else None

    sessions = eventually(all_three_started, timeout_s=30)
    stream.call.cancel()
    assert all(released(tiny_cluster, session, roles["model-drafter"], roles["verifier"], blocks_before=before)
               for session in sessions)
