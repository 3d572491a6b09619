"""Verifier replicas. A session's KV cache lives on one replica, so each request is
paired with one for its life (explicit channels, as for drafters), chosen by its
prompt's prefix and by load:

- prefix: the replica that last took a request sharing the longest run of whole
  PREFIX_CHUNK-token pieces with this prompt holds those keys and values (the engine's
  prefix cache), so the request goes there, unless that replica carries more than
  `slack` sessions above the least-loaded one (SGLang's cache-aware router does the
  same: cache affinity until the load is out of balance);
- load: otherwise the replica with the fewest sessions, counting this orchestrator's
  sessions on it plus those its last pass left waiting for KV memory; then the one
  with the shorter recent pass.

`routing="round-robin"` takes the replicas in turn instead (the baseline the prefix
rule is measured against: `specdec bench prefix`, deploy/bench/prefix.py).

A replica that fails or leaves the set costs its requests one resync on another
replica at their next call: the orchestrator holds every request's history. Each
replica's model is checked at connect, whenever its connection comes back and every
refresh interval: one that serves a model with another vocabulary, or another model
than the rest of the pool, takes no requests."""

import asyncio
import collections
import hashlib
import logging
import time
from dataclasses import dataclass, field

import grpc

from specdec.api.common.v1 import common_pb2
from specdec.api.verifier.v1 import verifier_pb2, verifier_pb2_grpc
from orchestrator.pool import IncompatiblePair, Replica, Replicas, wait_for_info
from orchestrator.tasks import cancelling, spawn

log = logging.getLogger("orchestrator.verifiers")

PREFIX_CHUNK = 32  # tokens per hashed piece of a prompt (two of the engine's KV blocks)
MAX_PREFIXES = 1 << 16  # pieces remembered, least recently used out first
ROUTINGS = ("prefix", "round-robin")


def prefix_hashes(tokens: list[int]) -> list[bytes]:
    """One hash per whole PREFIX_CHUNK-token piece, each over every token up to its end."""
    hashes, h = [], hashlib.blake2b(digest_size=16)
    for end in range(PREFIX_CHUNK, len(tokens) + 1, PREFIX_CHUNK):
        h.update(b"".join(t.to_bytes(4, "little") for t in tokens[end - PREFIX_CHUNK:end]))
        hashes.append(h.copy().digest())
    return hashes


def _served(info: common_pb2.ModelInfo) -> tuple:
    """What replicas must share for a session to move between them with the same output."""
    return info.model_name, info.max_positions, info.numerics


class PrefixOwners:
    """Which replica last took each prompt prefix (bounded, least recently used out)."""

    def __init__(self, capacity: int = MAX_PREFIXES):
        self.capacity = capacity
        self.owners: collections.OrderedDict[bytes, str] = collections.OrderedDict()

    def owner(self, hashes: list[bytes]) -> tuple[str | None, int]:
        """(the address that holds the longest of these prefixes, its pieces)"""
        for n in range(len(hashes), 0, -1):
            address = self.owners.get(hashes[n - 1])
            if address is not None:
                return address, n
        return None, 0

    def record(self, hashes: list[bytes], address: str) -> None:
        for h in hashes:
            self.owners[h] = address
            self.owners.move_to_end(h)
        while len(self.owners) > self.capacity:
            self.owners.popitem(last=False)

    def forget(self, address: str) -> None:
        for h in [h for h, a in self.owners.items() if a == address]:
            del self.owners[h]


@dataclass(eq=False)
class VerifierReplica(Replica):
    info: common_pb2.ModelInfo | None = None
    problem: str | None = None  # why it takes no requests (the model it serves)
    free_blocks: int = -1  # after its last pass (-1: none seen)
    waiting: int = 0
    pass_s: float = 0.0
    routed: dict = field(default_factory=lambda: {"prefix": 0, "load": 0})
    moved_away: int = 0
    watcher: asyncio.Task | None = None

    def usable(self, now: float) -> bool:
        return self.info is not None and self.problem is None and self.down_until <= now and not self.removed

    def load(self) -> int:
        return self.sessions + self.waiting


class VerifierPool(Replicas):
    what = "verifier"

    def __init__(self, addresses: list[str], fingerprint: str, tokenizer: str,
                 credentials: grpc.ChannelCredentials | None = None, options=(), retry_s: float = 2.0,
                 slack: int = 4, refresh_s: float = 5.0, metrics=None, routing: str = "prefix"):
        if routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}, got {routing!r}")
        self.routing, self.turn = routing, 0
        self.fingerprint, self.tokenizer, self.metrics = fingerprint, tokenizer, metrics
        self.slack, self.refresh_s = slack, refresh_s
        self.prefixes = PrefixOwners()
        self.checked = asyncio.Event()  # some replica's model was checked
        self.first_error: IncompatiblePair | None = None
        self.served: common_pb2.ModelInfo | None = None  # the model a fitting replica served last
        super().__init__(addresses, credentials, options, retry_s)

    # -- the set -----------------------------------------------------------------------

    def new_replica(self, address: str, channel: grpc.aio.Channel) -> VerifierReplica:
        return VerifierReplica(address, channel, verifier_pb2_grpc.VerifierServiceStub(channel))

    def joined(self, replica: VerifierReplica) -> None:
        replica.watcher = spawn(self.watch(replica))
        if self.metrics is not None:
            self.metrics.verifier_sessions.labels(replica.address).set_function(lambda r=replica: r.sessions)
            self.metrics.verifier_free_blocks.labels(replica.address).set_function(lambda r=replica: r.free_blocks)

    def left(self, replica: VerifierReplica) -> None:
        replica.watcher.cancel()
        self.prefixes.forget(replica.address)
        if self.metrics is not None:
            for gauge in (self.metrics.verifier_sessions, self.metrics.verifier_free_blocks):
                gauge.remove(replica.address)
            for rule in replica.routed:
                if replica.routed[rule]:
                    self.metrics.verifier_routed.remove(replica.address, rule)

    @property
    def info(self) -> common_pb2.ModelInfo | None:
        """The model the pool serves: a usable replica's, else any checked one's, else the
        last one a replica fitting the pool served (while every replica restarts, requests
        are taken and wait for one: VerifierLink)."""
        now = time.monotonic()
        checked = [r for r in self.replicas.values() if r.info is not None]
        usable = [r for r in checked if r.usable(now)]
        pick = usable or checked
        return pick[0].info if pick else self.served

    @property
    def problem(self) -> str | None:
        """Why requests are refused now: every checked replica serves a model that does
        not fit (None while one fits, or none was checked yet)."""
        checked = [r for r in self.replicas.values() if r.info is not None]
        if checked and all(r.problem is not None for r in checked):
            return checked[0].problem
        return None

    def check(self, replica: VerifierReplica, info: common_pb2.ModelInfo) -> None:
        if info.vocab_fingerprint != self.fingerprint:
            raise IncompatiblePair(f"the tokenizer {self.tokenizer!r} does not match the verifier's model "
                                   f"{info.model_name!r} (at {replica.address}): the verifier must serve the "
                                   f"target whose tokenizer --tokenizer gives")
        for other in self.replicas.values():
            if other is not replica and other.info is not None and other.problem is None and \
                    _served(other.info) != _served(info):
                raise IncompatiblePair(
                    f"the verifier at {replica.address} serves {info.model_name!r} ({info.max_positions} positions, "
                    f"numerics {info.numerics or '?'}), the one at {other.address} {other.info.model_name!r} "
                    f"({other.info.max_positions}, {other.info.numerics or '?'}): a request moved between them "
                    f"would change its output")

    async def recheck(self, replica: VerifierReplica, wait_s: float = 0.0) -> None:
        """Asks the replica what it serves now: a model that does not fit makes it refuse
        requests; one that does not answer takes no new sessions until it does."""
        try:
            if wait_s:
                info = await wait_for_info(replica.stub, verifier_pb2.GetModelInfoRequest(), wait_s)
            else:
                info = (await replica.stub.GetModelInfo(verifier_pb2.GetModelInfoRequest(), timeout=5)).info
        except grpc.aio.AioRpcError as err:
            if cancelling():  # the call ended by our own cancel (shutdown), not by the replica
                raise asyncio.CancelledError from err
            if replica.info is not None and replica.down_until != float("inf"):
                log.warning("verifier %s does not answer (%s: %s); no new sessions on it until it does",
                            replica.address, err.code().name, err.details())
                replica.down_until = float("inf")
            return
        try:
            self.check(replica, info)
        except IncompatiblePair as err:
            if replica.problem != str(err):
                log.error("verifier %s takes no requests: %s", replica.address, err)
            replica.problem, replica.info = str(err), info
            self.first_error = self.first_error or err
        else:
            if replica.problem is not None:
                log.info("the verifier at %s serves %s again: taking requests", replica.address, info.model_name)
            elif replica.info is not None and _served(replica.info) != _served(info):
                log.info("the verifier at %s now serves %s (%d positions)", replica.address, info.model_name,
                         info.max_positions)
            replica.problem, replica.info, replica.down_until = None, info, 0.0
            self.served = info
        self.checked.set()

    async def watch(self, replica: VerifierReplica) -> None:
        """Checks the replica's model once it answers, again whenever its connection comes
        back, and every refresh interval."""
        await self.recheck(replica, wait_s=float("inf"))
        state = replica.channel.get_state(try_to_connect=True)
        while True:
            try:
                await asyncio.wait_for(replica.channel.wait_for_state_change(state), self.refresh_s)
                changed = True
            except asyncio.TimeoutError:
                changed = False
            now = replica.channel.get_state(try_to_connect=True)
            came_back = changed and now == grpc.ChannelConnectivity.READY and state != grpc.ChannelConnectivity.READY
            if came_back or not changed:
                await self.recheck(replica)
            state = now

    async def start(self, wait_s: float) -> common_pb2.ModelInfo:
        """Waits until a replica's model is checked; -> that model (IncompatiblePair
        when the first replica to answer serves one that does not fit)."""
        await asyncio.wait_for(self.checked.wait(), wait_s)
        if self.info is None or self.problem is not None:
            raise self.first_error
        return self.info

    # -- routing -----------------------------------------------------------------------

    def acquire(self, prompt: list[int]) -> VerifierReplica | None:
        """The replica for a new session (None: no replica can take one now)."""
        now = time.monotonic()
        usable = [r for r in self.replicas.values() if r.usable(now)]
        if not usable:
            return None
        hashes = prefix_hashes(prompt)
        if self.routing == "round-robin":
            self.turn += 1
            return self._take(usable[self.turn % len(usable)], "load", hashes)
        least = min(usable, key=lambda r: (r.load(), r.pass_s))
        owner, _ = self.prefixes.owner(hashes)
        held = self.replicas.get(owner) if owner else None
        if held is not None and held in usable and held.load() <= least.load() + self.slack:
            chosen, rule = held, "prefix"
        else:
            chosen, rule = least, "load"
        return self._take(chosen, rule, hashes)

    def _take(self, chosen: VerifierReplica, rule: str, hashes: list[bytes]) -> VerifierReplica:
        chosen.routed[rule] += 1
        if self.metrics is not None:
            self.metrics.verifier_routed.labels(chosen.address, rule).inc()
        chosen.sessions += 1
        self.prefixes.record(hashes, chosen.address)
        return chosen

    def remember(self, tokens: list[int], replica: VerifierReplica) -> None:
        """The replica holds these tokens' keys and values (a finished request's history)."""
        if not replica.removed:
            self.prefixes.record(prefix_hashes(tokens), replica.address)

    def release(self, replica: VerifierReplica) -> None:
        super().release(replica)
        if replica.sessions == 0:
            replica.waiting = 0  # its last pass's count: with no session there, nothing will update it

    def observe(self, replica: VerifierReplica, batch_pass: verifier_pb2.BatchPass) -> None:
        """The replica's load after the pass that answered a call."""
        if batch_pass.rows:
            replica.free_blocks, replica.waiting = batch_pass.free_kv_blocks, batch_pass.waiting_sessions
            replica.pass_s = batch_pass.seconds if not replica.pass_s else 0.8 * replica.pass_s + 0.2 * batch_pass.seconds

    def moved(self) -> None:
        """A session moved to another replica."""
        if self.metrics is not None:
            self.metrics.verifier_moves.inc()

    def others(self, replica: VerifierReplica) -> bool:
        """Whether another replica could take a session now."""
        now = time.monotonic()
        return any(r is not replica and r.usable(now) for r in self.replicas.values())
