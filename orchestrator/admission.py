"""Which requests run now, and which wait their turn.

At most `running` requests generate at once (each holds KV memory on the verifier and a
drafter session); a burst above that waits in a first-come, first-served queue, as
vLLM's and TGI's front ends make it wait, bounded by the client's own deadline (a call
whose deadline passes, or that the client cancels, leaves the queue). Only beyond
`queued` waiting requests is a request refused (RESOURCE_EXHAUSTED): the bound keeps
what a waiting call holds (its stream, its parsed prompt) and the last one's wait (about
queued / running request lifetimes) finite, and tells a load balancer to go elsewhere."""

import asyncio
from collections import deque

from specdec.errors import Overloaded


class Admission:
    def __init__(self, running: int, queued: int):
        if running < 1 or queued < 0:
            raise ValueError("running must be >= 1 and queued >= 0")
        self.running, self.queued = running, queued
        self.active = 0
        self.waiting: deque[asyncio.Future] = deque()

    async def enter(self) -> None:
        """Returns once the request may run (it must `leave` after); raises Overloaded when
        the queue is full."""
        if self.active < self.running and not self.waiting:
            self.active += 1
            return
        if len(self.waiting) >= self.queued:
            raise Overloaded(f"{self.active} requests running and {len(self.waiting)} waiting, the limits are "
                             f"{self.running} and {self.queued}")
        turn = asyncio.get_running_loop().create_future()
        self.waiting.append(turn)
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self.leave()  # its turn came as it was cancelled: pass it on
            else:
                self.waiting.remove(turn)
            raise

    def leave(self) -> None:
        """A running request ended: the slot goes to the first waiting one."""
        while self.waiting:
            turn = self.waiting.popleft()
            if not turn.done():
                turn.set_result(None)  # the slot passes on; `active` stays
                return
        self.active -= 1
