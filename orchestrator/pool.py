"""Drafter replicas: one explicit channel per replica address, so that a session's
calls all reach the process holding its cache (gRPC's per-call load balancing would
scatter them). The pool pairs each request with the least-loaded healthy replica."""

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc

from specdec.drafter.v1 import drafter_pb2, drafter_pb2_grpc
from specdec.security import aio_channel
from orchestrator.tasks import spawn
from specdec.wire import SERVICE_MESSAGE_BYTES, message_options

log = logging.getLogger("orchestrator.pool")

# Reconnect quickly to a replica that restarts on the same address.
CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
    *message_options(SERVICE_MESSAGE_BYTES),  # a feature window rides in one message
]


class IncompatiblePair(Exception):
    """A drafter whose vocabulary differs from the target's."""


def check_vocab(address: str, info, target_fingerprint: str, target_name: str) -> None:
    if info.vocab_fingerprint and info.vocab_fingerprint != target_fingerprint:
        raise IncompatiblePair(
            f"drafter {address} serves {info.model_name!r}, whose vocabulary differs from the target "
            f"{target_name!r}: a draft model must share the target's tokenizer")


def check_features(address: str, info, target_layers: int, target_hidden: int, target_name: str) -> None:
    """A feature drafter reads layers the target has, as wide as the target's."""
    if not info.feature_layers or not target_layers:  # target_layers 0: a verifier that does not say
        return
    if max(info.feature_layers) > target_layers or info.hidden_size != target_hidden:
        raise IncompatiblePair(
            f"drafter {address} serves {info.model_name!r}, a head that reads layers {list(info.feature_layers)} "
            f"{info.hidden_size} wide; the target {target_name!r} has {target_layers} layers {target_hidden} wide")


@dataclass(frozen=True)
class FeatureRule:
    """What a deployment's feature drafters read: the target's layers, and how many
    positions back (the features a request keeps for a resync)."""
    layers: tuple[int, ...]
    window: int


async def wait_for_info(stub, request, wait_s: float):
    """The service's ModelInfo once it has loaded its model (UNAVAILABLE until then)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return (await stub.GetModelInfo(request, timeout=max(1.0, min(10.0, wait_s)))).info
        except grpc.aio.AioRpcError as err:
            retryable = err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
            if not retryable or time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)


@dataclass(eq=False)
class Replica:
    address: str
    channel: grpc.aio.Channel
    stub: drafter_pb2_grpc.DrafterServiceStub
    sessions: int = 0
    down_until: float = 0.0
    checked: bool = False
    removed: bool = False  # gone from the replica set: its sessions move at their next round

    def healthy(self, now: float) -> bool:
        return self.down_until <= now


class DrafterPool:
    """The current replica set, from a static list or from discovery (`update`)."""

    def __init__(self, addresses: list[str], target_fingerprint: str, target_name: str, retry_s: float = 2.0,
                 credentials: grpc.ChannelCredentials | None = None, options=(), target_layers: int = 0,
                 target_hidden: int = 0):
        self.target_fingerprint, self.target_name = target_fingerprint, target_name
        self.target_layers, self.target_hidden = target_layers, target_hidden
        self.retry_s = retry_s
        self.credentials, self.options = credentials, [*CHANNEL_OPTIONS, *options]
        self.replicas: dict[str, Replica] = {}
        # The drafters' prompt-lookup rule (min, max match), as the last replica checked
        # says (a deployment's replicas run one configuration); None: they never look up.
        self.lookup_rule: tuple[int, int] | None = None
        # Likewise, what they draft from besides tokens: None, or the target's features.
        self.feature_rule: FeatureRule | None = None
        self.update(addresses)

    def update(self, addresses: list[str]) -> None:
        """Follows a new replica set. A removed replica takes no new sessions; its
        sessions move to another replica (a resync) at their next round."""
        for address in addresses:
            if address not in self.replicas:
                channel = aio_channel(address, self.credentials, self.options)
                self.replicas[address] = Replica(address, channel, drafter_pb2_grpc.DrafterServiceStub(channel))
                log.info("drafter %s added (%d replicas)", address, len(self.replicas))
        for address in set(self.replicas) - set(addresses):
            replica = self.replicas.pop(address)
            replica.removed = True
            log.info("drafter %s removed (%d replicas); draining %d sessions", address, len(self.replicas),
                     replica.sessions)
            if replica.sessions == 0:
                spawn(replica.channel.close())

    async def check(self, replica: Replica, wait_s: float = 0.0) -> None:
        """Checks the replica's vocabulary against the target's (IncompatiblePair)."""
        info = await wait_for_info(replica.stub, drafter_pb2.GetModelInfoRequest(), wait_s)
        check_vocab(replica.address, info, self.target_fingerprint, self.target_name)
        check_features(replica.address, info, self.target_layers, self.target_hidden, self.target_name)
        replica.checked = True
        self.lookup_rule = (info.lookup_min_match, info.lookup_max_match) if info.lookup_max_match > 0 else None
        self.feature_rule = FeatureRule(tuple(info.feature_layers), info.feature_window) \
            if info.feature_layers else None

    async def acquire(self) -> Replica | None:
        """The least-loaded healthy replica, or None: the request goes on without one."""
        now = time.monotonic()
        for replica in sorted(self.replicas.values(), key=lambda r: r.sessions):
            if not replica.healthy(now):
                continue
            if not replica.checked:
                try:
                    await self.check(replica)
                except IncompatiblePair as err:
                    log.error("%s; not using it", err)
                    replica.down_until = float("inf")
                    continue
                except grpc.aio.AioRpcError as err:
                    self.mark_down(replica, err)
                    continue
            replica.sessions += 1
            return replica
        return None

    def release(self, replica: Replica) -> None:
        replica.sessions -= 1
        if replica.removed and replica.sessions == 0:
            spawn(replica.channel.close())

    def mark_down(self, replica: Replica, err: grpc.aio.AioRpcError) -> None:
        log.warning("drafter %s failed (%s: %s); retrying it in %.1f s", replica.address, err.code().name,
                    err.details(), self.retry_s)
        replica.down_until = time.monotonic() + self.retry_s

    async def close(self) -> None:
        for replica in self.replicas.values():
            await replica.channel.close()
