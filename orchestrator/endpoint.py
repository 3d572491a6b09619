"""The verifier as the orchestrator reaches it: one channel, the model it serves, and
where it is. The model is checked at start, again whenever the connection comes back
(a restarted verifier may serve another model), and every refresh interval; under Ray
the address is looked up again too (a restarted actor may be on another node)."""

import asyncio
import logging
from typing import Awaitable, Callable

import grpc

from specdec.common.v1 import common_pb2
from specdec.security import aio_channel
from specdec.verifier.v1 import verifier_pb2, verifier_pb2_grpc
from orchestrator.pool import IncompatiblePair, wait_for_info
from orchestrator.tasks import spawn

log = logging.getLogger("orchestrator.verifier")


class VerifierEndpoint:
    def __init__(self, address: str, fingerprint: str, tokenizer: str,
                 credentials: grpc.ChannelCredentials | None = None, options=()):
        self.fingerprint, self.tokenizer = fingerprint, tokenizer
        self.credentials, self.options = credentials, list(options)
        self.info: common_pb2.ModelInfo | None = None
        self.problem: str | None = None  # why requests are refused now (an incompatible model)
        self._connect(address)

    def _connect(self, address: str) -> None:
        self.address = address
        self.channel = aio_channel(address, self.credentials, self.options)
        self.stub = verifier_pb2_grpc.VerifierServiceStub(self.channel)

    def check(self, info: common_pb2.ModelInfo) -> None:
        if info.vocab_fingerprint != self.fingerprint:
            raise IncompatiblePair(f"the tokenizer {self.tokenizer!r} does not match the verifier's model "
                                   f"{info.model_name!r} (at {self.address}): the verifier must serve the target "
                                   f"whose tokenizer --tokenizer gives")

    async def start(self, wait_s: float) -> common_pb2.ModelInfo:
        """Waits for the verifier's model and checks it (IncompatiblePair)."""
        info = await wait_for_info(self.stub, verifier_pb2.GetModelInfoRequest(), wait_s)
        self.check(info)
        self.info = info
        return info

    async def recheck(self) -> None:
        """Asks the verifier what it serves now; refuses requests while it does not fit."""
        try:
            info = (await self.stub.GetModelInfo(verifier_pb2.GetModelInfoRequest(), timeout=5)).info
        except grpc.aio.AioRpcError:
            return  # unreachable or still loading: requests find out (UNAVAILABLE), nothing to check yet
        try:
            self.check(info)
        except IncompatiblePair as err:
            if self.problem != str(err):
                log.error("refusing requests: %s", err)
            self.problem = str(err)
            return
        if self.problem is not None:
            log.info("the verifier at %s serves %s again: taking requests", self.address, info.model_name)
        elif info.model_name != self.info.model_name or info.max_positions != self.info.max_positions:
            log.info("the verifier at %s now serves %s (%d positions)", self.address, info.model_name,
                     info.max_positions)
        self.problem, self.info = None, info

    async def move(self, address: str) -> None:
        """Follows the verifier to a new address; calls in flight on the old one fail over
        to the new one when they retry."""
        log.info("the verifier moved: %s -> %s", self.address, address)
        old = self.channel
        self._connect(address)
        await self.recheck()
        asyncio.get_running_loop().call_later(30.0, lambda: spawn(old.close()))

    async def watch(self, interval_s: float, locate: Callable[[], Awaitable[str]] | None = None) -> None:
        """Re-checks the model when the connection comes back and every interval_s; with
        `locate`, follows the verifier's address."""
        state = self.channel.get_state(try_to_connect=True)
        while True:
            channel = self.channel
            try:
                await asyncio.wait_for(channel.wait_for_state_change(state), interval_s)
                changed = True
            except asyncio.TimeoutError:
                changed = False
            if locate is not None:
                try:
                    address = await asyncio.wait_for(locate(), 10.0)  # an actor restarting answers late
                except Exception as err:  # the lookup failing keeps the address we have
                    log.warning("looking up the verifier failed: %s", err)
                else:
                    if address and address != self.address:
                        await self.move(address)
            now = self.channel.get_state(try_to_connect=True)
            came_back = changed and now == grpc.ChannelConnectivity.READY and state != grpc.ChannelConnectivity.READY
            if came_back or not changed:
                await self.recheck()
            state = now
