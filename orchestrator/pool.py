"""Replica pools: one explicit channel per replica address, so that a session's calls
all reach the process holding its cache (gRPC's per-call load balancing would scatter
them). `Replicas` follows the set (static or discovered), counts sessions and marks
replicas down; the drafters' pool (here) pairs each request with the least-loaded
healthy drafter, the verifiers' (orchestrator.verifiers) routes by prefix and load."""

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc

from specdec import model_files
from specdec.api.drafter.v1 import drafter_pb2, drafter_pb2_grpc
from orchestrator.bridge import Bridge
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
    """A replica whose model cannot serve beside the target's (and why)."""


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
    stub: object
    sessions: int = 0
    down_until: float = 0.0
    removed: bool = False  # gone from the replica set: its sessions move at their next call

    def healthy(self, now: float) -> bool:
        return self.down_until <= now


class Replicas:
    """The current replica set of one service, from a static list or from discovery
    (`update`). A subclass says what a replica is (`what`, `new_replica`) and what joins
    and leaves with one (`joined`, `left`)."""
    what = "replica"

    def __init__(self, addresses: list[str], credentials: grpc.ChannelCredentials | None, options, retry_s: float):
        self.credentials, self.options, self.retry_s = credentials, [*CHANNEL_OPTIONS, *options], retry_s
        self.replicas: dict[str, Replica] = {}
        self.update(addresses)

    def new_replica(self, address: str, channel: grpc.aio.Channel) -> Replica:
        raise NotImplementedError

    def joined(self, replica: Replica) -> None:
        """A replica entered the set."""

    def left(self, replica: Replica) -> None:
        """A replica left the set."""

    def update(self, addresses: list[str]) -> None:
        """Follows a new replica set. A removed replica takes no new sessions; its
        sessions move to another replica (a resync) at their next call."""
        for address in addresses:
            if address not in self.replicas:
                replica = self.new_replica(address, aio_channel(address, self.credentials, self.options))
                self.replicas[address] = replica
                self.joined(replica)
                log.info("%s %s added (%d replicas)", self.what, address, len(self.replicas))
        for address in set(self.replicas) - set(addresses):
            replica = self.replicas.pop(address)
            replica.removed = True
            self.left(replica)
            log.info("%s %s removed (%d replicas); moving its %d sessions", self.what, address, len(self.replicas),
                     replica.sessions)
            if replica.sessions == 0:
                spawn(replica.channel.close())

    def release(self, replica: Replica) -> None:
        """A session on the replica ended."""
        replica.sessions -= 1
        if replica.removed and replica.sessions == 0:
            spawn(replica.channel.close())

    def mark_down(self, replica: Replica, err: grpc.aio.AioRpcError) -> None:
        """A call to the replica failed: no new sessions on it for `retry_s` (one that is
        down for good, or until its check brings it back, stays so)."""
        if replica.down_until == float("inf"):
            return
        if replica.down_until <= time.monotonic():
            log.warning("%s %s failed (%s: %s); no new sessions on it for %.1f s", self.what, replica.address,
                        err.code().name, err.details(), self.retry_s)
        replica.down_until = time.monotonic() + self.retry_s

    async def close(self) -> None:
        for replica in self.replicas.values():
            await replica.channel.close()


@dataclass(eq=False)
class DrafterReplica(Replica):
    checked: bool = False
    max_positions: int = 1 << 30  # its model's (ModelInfo): a session there holds no more tokens
    bridge: Bridge | None = None  # a draft of another vocabulary: how its drafts carry over (orchestrator.bridge)


class DrafterPool(Replicas):
    what = "drafter"

    def __init__(self, addresses: list[str], target_fingerprint: str, target_name: str, retry_s: float = 2.0,
                 credentials: grpc.ChannelCredentials | None = None, options=(), target_layers: int = 0,
                 target_hidden: int = 0, tokenizer=None, draft_tokenizer: str = ""):
        self.target_fingerprint, self.target_name = target_fingerprint, target_name
        # For drafts of another vocabulary: the target's tokenizer, and where the drafters'
        # is (default: their model's name); the bridges built, by the drafters' vocabulary.
        self.tokenizer, self.draft_tokenizer = tokenizer, draft_tokenizer
        self.bridges: dict[str, Bridge] = {}
        self.target_layers, self.target_hidden = target_layers, target_hidden
        # The drafters' prompt-lookup rule (min, max match), as the last replica checked
        # says (a deployment's replicas run one configuration); None: they never look up.
        self.lookup_rule: tuple[int, int] | None = None
        # Likewise, what they draft from besides tokens: None, or the target's features.
        self.feature_rule: FeatureRule | None = None
        super().__init__(addresses, credentials, options, retry_s)

    def new_replica(self, address: str, channel: grpc.aio.Channel) -> DrafterReplica:
        return DrafterReplica(address, channel, drafter_pb2_grpc.DrafterServiceStub(channel))

    async def check(self, replica: DrafterReplica, wait_s: float = 0.0) -> None:
        """Checks the replica's vocabulary against the target's (IncompatiblePair)."""
        info = await wait_for_info(replica.stub, drafter_pb2.GetModelInfoRequest(), wait_s)
        if info.vocab_fingerprint and info.vocab_fingerprint != self.target_fingerprint:
            replica.bridge = await self.bridge(replica.address, info)
        check_features(replica.address, info, self.target_layers, self.target_hidden, self.target_name)
        replica.checked = True
        replica.max_positions = info.max_positions or replica.max_positions
        self.lookup_rule = (info.lookup_min_match, info.lookup_max_match) if info.lookup_max_match > 0 else None
        self.feature_rule = FeatureRule(tuple(info.feature_layers), info.feature_window) \
            if info.feature_layers else None

    async def bridge(self, address: str, info) -> Bridge:
        """How drafts of a drafter with another vocabulary carry over to the target's; a
        drafter whose drafts cannot keep the output exact is refused (IncompatiblePair)."""
        if info.vocab_fingerprint in self.bridges:
            return self.bridges[info.vocab_fingerprint]
        differs = f"drafter {address} serves {info.model_name!r}, whose vocabulary differs from the target " \
                  f"{self.target_name!r}"
        if info.feature_layers:
            raise IncompatiblePair(f"{differs}: a head that drafts from the target's features must share its "
                                   f"vocabulary")
        if self.tokenizer is None:
            raise IncompatiblePair(f"{differs}: a draft model must share the target's tokenizer")
        spec = self.draft_tokenizer or info.model_name
        try:
            draft = await asyncio.to_thread(model_files.load_tokenizer, spec)
        except Exception as err:
            raise IncompatiblePair(f"{differs}, and its tokenizer does not load here ({spec!r}: {err}); name it "
                                   f"with --draft-tokenizer") from err
        if model_files.vocab_fingerprint(draft) != info.vocab_fingerprint:
            raise IncompatiblePair(f"{differs}, and the tokenizer {spec!r} is not its own (another vocabulary); "
                                   f"name the drafter's with --draft-tokenizer")
        bridge = self.bridges[info.vocab_fingerprint] = await asyncio.to_thread(Bridge, self.tokenizer, draft)
        log.info("%s: its drafts carry over to the target's tokens (%d of its %d tokens are the target's too)",
                 differs, len(bridge.shared), len(draft))
        return bridge

    async def acquire(self) -> DrafterReplica | None:
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
