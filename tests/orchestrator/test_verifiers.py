"""The verifier pool's routing (prefix affinity within the load slack, else the least
loaded) and a request's link moving off a replica that failed or left the set: one
resync, the whole history sent to the new replica. The replicas' stubs are fakes."""

import asyncio

import grpc
import pytest

from orchestrator.links import VerifierLink
from orchestrator.stats import Stats
from orchestrator.pool import IncompatiblePair
from orchestrator.verifiers import PREFIX_CHUNK, VerifierPool, VerifierReplica, prefix_hashes
from specdec.api.common.v1 import common_pb2
from specdec.api.verifier.v1 import verifier_pb2

PARAMS = common_pb2.SamplingParams(top_p=1.0)
INFO = common_pb2.ModelInfo(model_name="target", vocab_fingerprint="fp", max_positions=2048)


class FakeVerifier:
    """Answers Verify with token 7, or raises its scripted errors first."""

    def __init__(self, *errors):
        self.errors, self.requests, self.closed = list(errors), [], []

    async def Verify(self, request, timeout=None, metadata=None):
        self.requests.append(request)
        if self.errors:
            raise self.errors.pop(0)
        return verifier_pb2.VerifyResponse(num_accepted=0, next_token=7, batch_pass=verifier_pb2.BatchPass(
            rows=1, tokens=1, seconds=0.01, free_kv_blocks=100))

    async def CloseSession(self, request, timeout=None, metadata=None):
        self.closed.append(request.session_id)


class NoChannel:
    async def close(self):
        pass


def pool_of(*stubs, slack=4) -> VerifierPool:
    """A pool of checked replicas v0, v1, ... (no channels: the stubs are fakes)."""
    pool = VerifierPool([], "fp", "tok", slack=slack)
    for i, stub in enumerate(stubs):
        pool.replicas[f"v{i}"] = VerifierReplica(f"v{i}", NoChannel(), stub, info=INFO)
    return pool


def test_prefix_hashes_cover_whole_pieces_and_depend_on_everything_before():
    a = list(range(3 * PREFIX_CHUNK + 5))
    b = a[:PREFIX_CHUNK] + [0] + a[PREFIX_CHUNK + 1:]
    assert len(prefix_hashes(a)) == 3
    assert prefix_hashes(a)[0] == prefix_hashes(b)[0]
    assert all(x != y for x, y in zip(prefix_hashes(a)[1:], prefix_hashes(b)[1:]))


def test_a_shared_prefix_goes_where_it_is_cached_until_that_replica_is_out_of_balance():
    pool = pool_of(FakeVerifier(), FakeVerifier(), slack=2)
    system = list(range(100, 100 + 2 * PREFIX_CHUNK))
    first = pool.acquire(system + [1, 2, 3])
    other = pool.acquire([5] * 10)  # by load: the other replica
    assert other is not first and first.routed == {"prefix": 0, "load": 1}
    # Follow-ups sharing the system prompt stay on the first one while it is within the slack...
    taken = [pool.acquire(system + [i]) for i in range(3)]
    assert taken == [first] * 3 and first.routed["prefix"] == 3
    # ...then go by load: the first carries 4 sessions against the other's 1, more than 1 + 2.
    assert pool.acquire(system + [9]) is other and other.routed["load"] == 2
    # A short prompt (less than a piece) has no prefix to follow: the least loaded.
    for _ in range(3):
        pool.release(first)
    assert pool.acquire([1, 2]) is first  # 1 session against 2


def test_waiting_sessions_the_replica_reports_count_as_load():
    pool = pool_of(FakeVerifier(), FakeVerifier())
    v0, v1 = pool.replicas["v0"], pool.replicas["v1"]
    pool.observe(v0, verifier_pb2.BatchPass(rows=4, tokens=4, seconds=0.02, free_kv_blocks=0, waiting_sessions=3))
    assert [pool.acquire([i]) for i in range(3)] == [v1, v1, v1]
    assert v0.free_blocks == 0 and v0.waiting == 3


def test_a_replica_down_or_serving_another_model_takes_no_sessions():
    pool = pool_of(FakeVerifier(), FakeVerifier())
    v0, v1 = pool.replicas["v0"], pool.replicas["v1"]
    pool.mark_down(v0, grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, None, None, "gone"))
    v1.problem = "another model"
    assert pool.acquire([1]) is None
    assert pool.problem is None  # v0 still serves the target: it is only down for now
    v0.problem = "another model"
    assert pool.problem == "another model"


async def others_done() -> None:
    """Waits for every task but the caller's to end."""
    await asyncio.gather(*(task for task in asyncio.all_tasks() if task is not asyncio.current_task()))


def run_request(pool, history: list[int], calls: int = 2, after_first=lambda: None, close: bool = True) -> Stats:
    """A request's link making `calls` Verify calls, each committing token 7, with
    `after_first()` between the first and the second; then closed."""
    stats = Stats()
    link = VerifierLink(pool, "s", history[:3], PARAMS, stats, timeout_s=60)

    async def go():
        for call in range(calls):
            await link.verify(history, [], [])
            history.append(7)
            if call == 0:
                after_first()
        if close:
            await link.close(history)
        await others_done()  # what the link left to run on its own (a close on a replica it left)

    asyncio.run(go())
    return stats


# Unreachable; or stopping: a verifier draining on SIGTERM cancels a call that reaches it then.
@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED])
def test_a_request_on_a_replica_that_becomes_unreachable_moves_once_and_resends_its_history(code):
    dying = FakeVerifier()
    pool = pool_of(dying, FakeVerifier())
    unreachable = grpc.aio.AioRpcError(code, None, None, "connection refused")
    stats = run_request(pool, [1, 2, 3], calls=3, after_first=lambda: dying.errors.append(unreachable), close=False)
    survivor = pool.replicas["v1"].stub
    assert [(r.start, list(r.new_tokens)) for r in dying.requests] == [(0, [1, 2, 3]), (3, [7])]
    assert [(r.start, list(r.new_tokens)) for r in survivor.requests] == [(0, [1, 2, 3, 7]), (4, [7])]
    assert stats.resyncs == 1 and stats.verifier_moves == 1
    assert pool.replicas["v0"].moved_away == 1 and pool.replicas["v0"].sessions == 0
    assert pool.replicas["v1"].sessions == 1


def test_a_replica_that_leaves_the_set_has_its_sessions_moved_at_their_next_call_and_closed_there():
    leaving = FakeVerifier()
    pool = pool_of(leaving, FakeVerifier())

    def leave():  # what update() does to a replica gone from the set
        pool.replicas.pop("v0").removed = True

    stats = run_request(pool, [1, 2, 3], after_first=leave)
    assert leaving.closed == ["s"] and len(leaving.requests) == 1
    survivor = pool.replicas["v1"].stub
    assert [(r.start, list(r.new_tokens)) for r in survivor.requests] == [(0, [1, 2, 3, 7])]
    assert survivor.closed == ["s"] and stats.resyncs == 1 and stats.verifier_moves == 1


def test_a_finished_request_leaves_its_history_as_a_prefix_on_its_replica():
    pool = pool_of(FakeVerifier(), FakeVerifier(), slack=0)
    history = list(range(PREFIX_CHUNK - 3))
    run_request(pool, history, calls=5)  # prompt + 5 tokens: one whole piece
    held = next(r for r in pool.replicas.values() if r.routed["load"])
    other = next(r for r in pool.replicas.values() if r is not held)
    other.sessions = 0
    # A chat's next turn (the first turn's prompt and answer, then more) goes back there.
    assert pool.acquire(history + [1, 2, 3]) is held and held.routed["prefix"] == 1


def test_round_robin_takes_the_replicas_in_turn_whatever_the_prefix():
    pool = pool_of(FakeVerifier(), FakeVerifier(), FakeVerifier())
    pool.routing = "round-robin"
    system = list(range(100, 100 + PREFIX_CHUNK))
    assert [pool.acquire(system + [i]).address for i in range(4)] == ["v1", "v2", "v0", "v1"]


def test_a_request_waits_for_a_replica_while_the_set_is_empty():
    """Every replica restarting (gone from the set until it serves again): the request
    waits for one, within --verifier-retry-timeout, instead of failing."""
    pool = pool_of()
    pool.served = INFO
    link = VerifierLink(pool, "s", [1, 2, 3], PARAMS, Stats(), timeout_s=60, retry_s=5)

    async def go():
        back = VerifierReplica("v0", NoChannel(), FakeVerifier(), info=INFO)
        asyncio.get_running_loop().call_later(0.3, pool.replicas.__setitem__, "v0", back)
        return await link.verify([1, 2, 3], [], [])

    assert pool.info is INFO and asyncio.run(go()).next_token == 7


def test_a_replica_drained_of_sessions_forgets_the_waiting_count_of_its_last_pass():
    """(Before: a replica whose last pass reported 5 waiting sessions kept a load of 5 at
    0 sessions, and never got a session again.)"""
    pool = pool_of(FakeVerifier(), FakeVerifier())
    v0, v1 = pool.replicas["v0"], pool.replicas["v1"]
    assert pool.acquire([1]) is v0
    pool.observe(v0, verifier_pb2.BatchPass(rows=6, tokens=6, seconds=0.02, free_kv_blocks=0, waiting_sessions=5))
    pool.release(v0)
    assert pool.acquire([2]) is v1
    assert pool.acquire([3]) is v0  # 0 sessions against v1's 1


def test_a_call_failing_does_not_undo_a_replica_being_down_for_good():
    """A replica that did not answer its check is down until a check brings it back; a
    failed call on it must not make that `retry_s`. (Before: mark_down overwrote it, and
    new sessions went to the dead replica every retry_s.)"""
    pool = pool_of(FakeVerifier(), FakeVerifier())
    v0 = pool.replicas["v0"]
    v0.down_until = float("inf")  # what recheck() sets for a replica that does not answer
    pool.mark_down(v0, grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, None, None, "gone"))
    assert v0.down_until == float("inf")


def test_a_session_that_moves_off_a_replica_closes_itself_there():
    """The replica it left may be alive (a call that timed out or was cancelled there):
    its blocks go back now, not at the idle timeout. (Before: never closed there.)"""
    left = FakeVerifier()
    pool = pool_of(left, FakeVerifier())
    draining = grpc.aio.AioRpcError(grpc.StatusCode.CANCELLED, None, None, "stopping")  # alive, draining
    run_request(pool, [1, 2, 3], calls=3, after_first=lambda: left.errors.append(draining), close=False)
    assert left.closed == ["s"]
    assert pool.replicas["v1"].stub.closed == []  # the session lives on there


def test_a_removed_replica_leaves_no_metric_series_behind():
    """(Before: verifier_routed kept a series for every address it ever saw.)"""
    from specdec.metrics import OrchestratorMetrics

    metrics = OrchestratorMetrics()
    pool = VerifierPool([], "fp", "tok", metrics=metrics)

    async def go():
        pool.update(["127.0.0.1:1"])
        pool.replicas["127.0.0.1:1"].info = INFO
        assert pool.acquire([1]) is not None
        pool.update([])

    asyncio.run(go())
    names = {sample.labels.get("address") for family in metrics.verifier_routed.collect() for sample in family.samples}
    assert "127.0.0.1:1" not in names


def test_replicas_with_other_numerics_do_not_take_each_others_sessions():
    """Another --quantize, dtype, device or code path on one replica: the same model, but
    a session moved to it would change its output. (Before: only the model's name and
    positions were compared.)"""
    pool = pool_of(FakeVerifier())
    pool.replicas["v0"].info = common_pb2.ModelInfo(model_name="target", vocab_fingerprint="fp", max_positions=2048,
                                                    numerics="gguf/float32/cpu/layer-kernel")
    other = VerifierReplica("v1", NoChannel(), FakeVerifier())
    pool.replicas["v1"] = other
    with pytest.raises(IncompatiblePair, match="int8/float32/cpu/llama"):
        pool.check(other, common_pb2.ModelInfo(model_name="target", vocab_fingerprint="fp", max_positions=2048,
                                               numerics="int8/float32/cpu/llama"))
    pool.check(other, pool.replicas["v0"].info)  # the same numerics: fine


def test_an_engines_numerics_name_its_quantization_dtype_device_and_path():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from specdec.runtime.engine import Engine

    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2)).eval()
    engine = Engine(model, 1 << 20)
    try:
        assert engine.numerics == "none/float32/cpu/llama"
    finally:
        engine.stop()
    engine = Engine(model, 1 << 20, batch_invariant=8)  # passes of 8 tokens round otherwise
    try:
        assert engine.numerics == "none/float32/cpu/llama+invariant-8"
    finally:
        engine.stop()


def test_a_watcher_cancelled_during_a_check_ends():
    """grpc's asyncio calls answer their task's cancel with a CANCELLED error: a watcher
    cancelled in a check must end, not take it for a replica that does not answer and go
    on. (Before: the watcher went on, logging "does not answer", and kept an orchestrator
    stopped on SIGTERM from exiting.)"""

    class Channel(NoChannel):
        def get_state(self, try_to_connect=False):
            return grpc.ChannelConnectivity.READY

        async def wait_for_state_change(self, state):
            await asyncio.sleep(3600)

    class Stub:
        def __init__(self):
            self.calls = 0

        async def GetModelInfo(self, request, timeout=None):
            self.calls += 1
            if self.calls == 1:
                return verifier_pb2.GetModelInfoResponse(info=INFO)
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:  # as grpc.aio does
                raise grpc.aio.AioRpcError(grpc.StatusCode.CANCELLED, None, None, "Locally cancelled by application!")

    async def go():
        pool = VerifierPool([], "fp", "tok", refresh_s=0.05)
        replica = VerifierReplica("v0", Channel(), Stub())
        pool.replicas["v0"] = replica
        watcher = asyncio.ensure_future(pool.watch(replica))
        async def in_second_check():
            while replica.stub.calls < 2:
                await asyncio.sleep(0.01)

        await asyncio.wait_for(in_second_check(), 5)
        watcher.cancel()
        done, _ = await asyncio.wait({watcher}, timeout=2)
        return bool(done)

    loop = asyncio.new_event_loop()  # not asyncio.run: its shutdown would wait for a watcher that never ends
    try:
        assert loop.run_until_complete(go()), "the watcher went on after its cancel"
    finally:
        loop.close()
