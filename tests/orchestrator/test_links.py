"""How a request's links to the services read their errors: which ones resync, which
ones mark a drafter replica down for everyone, which ones stay this request's own; and
the client's deadline bounding every call downstream. The services are fake stubs."""

import asyncio
from types import SimpleNamespace

import grpc
import pytest

from orchestrator.pool import DrafterPool
from orchestrator.links import Deadline, DrafterLink, VerifierLink
from orchestrator.stats import Stats
from specdec.api.common.v1 import common_pb2
from specdec.api.drafter.v1 import drafter_pb2
from specdec.errors import RESYNC_DETAIL
from specdec.api.verifier.v1 import verifier_pb2

PARAMS = common_pb2.SamplingParams(top_p=1.0)


def error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class FakeVerifier:
    """Answers each Verify with the next scripted outcome: an error to raise, or a response."""

    def __init__(self, *outcomes):
        self.outcomes, self.requests, self.timeouts = list(outcomes), [], []

    async def Verify(self, request, timeout=None, metadata=None):
        self.requests.append(request)
        self.timeouts.append(timeout)
        outcome = self.outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return verifier_pb2.VerifyResponse(num_accepted=0, next_token=outcome)


class OnePool:
    """A verifier pool of one replica: the link under test sees every error of it."""

    def __init__(self, stub):
        self.replica = SimpleNamespace(stub=stub, removed=False, address="v")

    def acquire(self, prompt):
        return self.replica

    def release(self, replica):
        pass

    def observe(self, replica, batch_pass):
        pass

    def mark_down(self, replica, err):
        pass

    def others(self, replica):
        return False


def verify(stub, history, synced, deadline=Deadline(None)):
    stats = Stats()
    link = VerifierLink(OnePool(stub), "s", history, PARAMS, stats, timeout_s=60, deadline=deadline)
    link.synced = synced

    async def go():
        return await link.verify(history, [], [])

    return asyncio.run(go()), stats


@pytest.mark.parametrize("code,details", [
    (grpc.StatusCode.FAILED_PRECONDITION, f"unknown session; {RESYNC_DETAIL}"),
    (grpc.StatusCode.INTERNAL, f"RuntimeError: out of memory; the session was dropped, {RESYNC_DETAIL}"),
])
def test_the_verifier_losing_the_session_costs_a_resync(code, details):
    stub = FakeVerifier(error(code, details), 7)
    verdict, stats = verify(stub, [1, 2, 3, 4], synced=3)
    assert verdict.next_token == 7 and stats.resyncs == 1
    assert [(r.start, list(r.new_tokens)) for r in stub.requests] == [(3, [4]), (0, [1, 2, 3, 4])]


def test_a_precondition_of_another_kind_is_not_a_resync():
    stub = FakeVerifier(error(grpc.StatusCode.FAILED_PRECONDITION, "the model is being replaced"), 7)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        verify(stub, [1, 2, 3, 4], synced=3)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and len(stub.requests) == 1


def test_a_failure_that_repeats_after_the_resync_fails_the_request():
    stub = FakeVerifier(*[error(grpc.StatusCode.INTERNAL, f"a bug; {RESYNC_DETAIL}")] * 3)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        verify(stub, [1, 2, 3, 4], synced=3)
    assert err.value.code() == grpc.StatusCode.INTERNAL and len(stub.requests) == 2


def test_the_client_deadline_bounds_each_call():
    stub = FakeVerifier(7)
    verify(stub, [1, 2], synced=0, deadline=Deadline(0.2))
    assert 0 < stub.timeouts[0] <= 0.2
    stub = FakeVerifier(7)
    verify(stub, [1, 2], synced=0)
    assert stub.timeouts[0] == 60


class FakeDrafter:
    def __init__(self, failure: grpc.aio.AioRpcError | None):
        self.failure, self.calls = failure, 0

    def Propose(self, request, timeout=None, metadata=None):
        self.calls += 1
        failure = self.failure

        async def stream():
            if failure is not None:
                raise failure
            yield drafter_pb2.ProposeResponse(token_ids=range(request.num_draft_tokens))

        return stream()


def propose_with(failure):
    """Two replicas; the first answers with `failure`. -> (drafts, stats, pool, first replica)"""

    async def go():
        pool = DrafterPool(["127.0.0.1:1", "127.0.0.1:2"], "", "target")
        first, second = pool.replicas.values()
        first.stub, second.stub = FakeDrafter(failure), FakeDrafter(None)
        first.checked = second.checked = True
        stats = Stats()
        link = DrafterLink(pool, "s", PARAMS, stats, timeout_s=10)
        drafts, _ = await link.propose([1, 2, 3], 3)
        again, _ = await link.propose([1, 2, 3, 4], 3)
        await pool.close()
        return drafts + again, stats, first

    return asyncio.run(go())


def test_a_drafter_refusing_one_request_is_not_marked_down():
    drafts, stats, first = propose_with(error(grpc.StatusCode.INVALID_ARGUMENT, "sampling.top_k: too large"))
    assert drafts == [] and stats.drafter_failovers == 0
    assert first.down_until == 0.0 and first.stub.calls == 1  # healthy for the others; not asked again
    assert first.sessions == 0


def test_a_history_past_the_drafters_model_asks_it_nothing_and_keeps_its_lookup_rule():
    async def go():
        pool = DrafterPool(["127.0.0.1:1"], "", "target")
        (replica,) = pool.replicas.values()
        replica.stub, replica.checked, replica.max_positions = FakeDrafter(None), True, 4
        pool.lookup_rule = (1, 3)
        link = DrafterLink(pool, "s", PARAMS, Stats(), timeout_s=10)
        within, _ = await link.propose([1, 2, 3], 1)  # 3 of its 4 positions: one draft fits
        past, _ = await link.propose([1, 2, 3, 4], 1)
        await pool.close()
        return within, past, link, replica

    within, past, link, replica = asyncio.run(go())
    assert within == [0] and past == [] and replica.stub.calls == 1
    assert not link.drafts_by_model and link.lookup_rule == (1, 3)
    assert link.lookup_drafts([7, 8, 9, 7, 8], 2) == [9, 7]


# CANCELLED: a drafter that is stopping cancels a call that reaches it as it drains.
@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                  grpc.StatusCode.CANCELLED])
def test_a_drafter_in_trouble_is_marked_down_and_the_request_moves_on(code):
    drafts, stats, first = propose_with(error(code, "gone"))
    assert drafts == [0, 1, 2] * 2 and stats.drafter_failovers == 1
    assert first.down_until > 0 and first.sessions == 0


class FakeDecode:
    """Each Decode call streams the next scripted tokens, then raises its error if any."""

    def __init__(self, *outcomes):
        self.outcomes, self.requests, self.calls = list(outcomes), [], []

    def Decode(self, requests, timeout=None, metadata=None):
        tokens, err = self.outcomes.pop(0)

        async def stream():
            self.requests.append(await anext(requests))  # the run's; the offers after it are not read
            for token in tokens:  # a token id, or the whole message
                yield token if isinstance(token, verifier_pb2.DecodeResponse) else verifier_pb2.DecodeResponse(
                    token_id=token)
            if err is not None:
                raise err

        call = FakeCall(stream())
        self.calls.append(call)
        return call


class FakeCall:
    """A streaming call: iterated, and cancelled when its reader goes."""

    def __init__(self, stream):
        self.stream, self.cancelled = stream, False

    def __aiter__(self):
        return self.stream

    def cancel(self):
        self.cancelled = True
        return True


def test_a_decode_that_fails_part_way_goes_on_from_the_tokens_it_gave():
    """A run of 6: the verifier gives 2 tokens and goes away, comes back without the
    session (a restart): the run resyncs with those 2 tokens and gets the other 4."""
    stub = FakeDecode(([5, 6], error(grpc.StatusCode.UNAVAILABLE, "gone")),
                      ([], error(grpc.StatusCode.FAILED_PRECONDITION, f"unknown session; {RESYNC_DETAIL}")),
                      ([7, 8, 9, 10], None))
    stats = Stats()
    link = VerifierLink(OnePool(stub), "s", [1, 2, 3, 4], PARAMS, stats, timeout_s=60)
    link.synced = 3

    async def go():
        return [step.token async for step in link.decode([1, 2, 3, 4], 6, {99})]

    assert asyncio.run(go()) == [5, 6, 7, 8, 9, 10]
    assert [(r.start, list(r.new_tokens), r.max_tokens) for r in stub.requests] == [
        (3, [4], 6), (6, [], 4), (0, [1, 2, 3, 4, 5, 6], 4)]
    assert list(stub.requests[0].stop_token_ids) == [99]
    assert stats.resyncs == 1 and link.synced == 10


def test_a_decode_says_what_each_pass_s_lookup_drafts_got():
    """A pass that kept 2 lookup drafts and rejected 1, one without drafts, one that kept
    none of its 1, and one whose drafts were the constraint's."""
    Response = verifier_pb2.DecodeResponse
    stub = FakeDecode(([Response(token_id=5, drafted=True), Response(token_id=6, drafted=True),
                        Response(token_id=7, drafts_rejected=1, lookup_drafts=True), Response(token_id=8),
                        Response(token_id=9, drafts_rejected=1, lookup_drafts=True),
                        Response(token_id=10, drafted=True), Response(token_id=11)], None))
    stats = Stats()
    link = VerifierLink(OnePool(stub), "s", [1, 2], PARAMS, stats, timeout_s=60)

    async def go():
        return [(step.token, step.lookup) async for step in link.decode([1, 2], 7, set())]

    assert asyncio.run(go()) == [(5, None), (6, None), (7, (3, 2)), (8, None), (9, (1, 0)), (10, None), (11, None)]
    assert (stats.draft_tokens, stats.accepted_tokens) == (5, 3)


def test_a_decode_the_caller_stops_reading_is_cancelled():
    stub = FakeDecode(([5, 6, 7, 8], None))
    link = VerifierLink(OnePool(stub), "s", [1, 2], PARAMS, Stats(), timeout_s=60)

    async def go():
        steps = link.decode([1, 2], 4, set())
        async for step in steps:
            break
        await steps.aclose()
        return step.token

    assert asyncio.run(go()) == 5
    assert stub.calls[0].cancelled and link.synced == 3


def test_a_retried_run_gets_the_offers_and_the_end_of_its_stream():
    """A run (Decode, a two-way stream) that fails is called again; in grpc.aio, a finished
    call's request iterator is not cancelled with it, so it went on taking the offers meant
    for the new call, and the closing None: the new call's stream was never half-closed and
    the run never ended. A real gRPC server, whose first run fails after one token."""
    from specdec.api.verifier.v1 import verifier_pb2_grpc

    class Runs(verifier_pb2_grpc.VerifierServiceServicer):
        def __init__(self):
            self.calls, self.offers = 0, []

        async def Decode(self, request_iterator, context):
            self.calls += 1
            first = await request_iterator.__anext__()
            yield verifier_pb2.DecodeResponse(token_id=len(first.new_tokens) + first.start)
            if self.calls == 1:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "stopping")
            async for message in request_iterator:  # to its end: the caller's half-close
                self.offers.append(list(message.offer.tokens))
            yield verifier_pb2.DecodeResponse(token_id=99)

    async def go():
        server = grpc.aio.server()
        runs = Runs()
        verifier_pb2_grpc.add_VerifierServiceServicer_to_server(runs, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
            stub = verifier_pb2_grpc.VerifierServiceStub(channel)
            link = VerifierLink(OnePool(stub), "s", [1, 2, 3], PARAMS, Stats(), timeout_s=60)
            offers: asyncio.Queue = asyncio.Queue()
            got = []

            async def read():
                async for step in link.decode([1, 2, 3], 3, stop=set(), offers=offers):
                    got.append(step.token)
                    if len(got) == 2:  # the second call's first token: offer to it, then close its stream
                        offers.put_nowait(verifier_pb2.DraftOffer(position=5, tokens=[7]))
                        offers.put_nowait(None)

            await asyncio.wait_for(read(), timeout=10)
            await channel.close()
            return runs, got
        finally:
            await server.stop(0)

    runs, got = asyncio.run(go())
    assert runs.calls == 2 and got == [3, 4, 99]
    assert runs.offers == [[7]]  # the offer reached the run it was meant for
