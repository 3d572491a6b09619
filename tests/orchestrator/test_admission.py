"""The orchestrator's admission: a burst above the running limit waits its turn, first
come first served; only beyond the queue's bound is a request refused; a waiting call
that goes leaves the queue and a turn handed to a call as it goes is passed on."""

import asyncio

import pytest

from orchestrator.admission import Admission
from specdec.errors import Overloaded


def test_a_burst_waits_in_order_and_only_beyond_the_bound_is_refused():
    async def go():
        gate = Admission(running=2, queued=3)
        order = []

        async def request(i):
            await gate.enter()
            order.append(i)

        await request(0)
        await request(1)
        waiting = [asyncio.ensure_future(request(i)) for i in (2, 3, 4)]
        await asyncio.sleep(0)
        with pytest.raises(Overloaded, match="2 requests running and 3 waiting"):
            await gate.enter()
        assert order == [0, 1]
        for expected in (2, 3, 4):  # each end lets the first waiting one in
            gate.leave()
            await asyncio.sleep(0)
            assert order[-1] == expected
        await asyncio.gather(*waiting)
        for _ in range(2):
            gate.leave()
        assert gate.active == 0 and not gate.waiting

    asyncio.run(go())


def test_a_waiting_call_that_goes_leaves_the_queue():
    async def go():
        gate = Admission(running=1, queued=2)
        await gate.enter()
        first, second = asyncio.ensure_future(gate.enter()), asyncio.ensure_future(gate.enter())
        await asyncio.sleep(0)
        first.cancel()  # its deadline passed, or its client went
        with pytest.raises(asyncio.CancelledError):
            await first
        assert len(gate.waiting) == 1
        gate.leave()
        await second  # the turn went to the one still waiting
        gate.leave()
        assert gate.active == 0

    asyncio.run(go())


def test_a_turn_handed_to_a_call_as_it_is_cancelled_is_passed_on():
    async def go():
        gate = Admission(running=1, queued=2)
        await gate.enter()
        first, second = asyncio.ensure_future(gate.enter()), asyncio.ensure_future(gate.enter())
        await asyncio.sleep(0)
        gate.leave()      # first's turn is set ...
        first.cancel()    # ... and it is cancelled before it runs
        with pytest.raises(asyncio.CancelledError):
            await first
        await second
        assert gate.active == 1 and not gate.waiting

    asyncio.run(go())
