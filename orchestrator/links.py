"""A request's sessions on the drafter and the verifier: the calls, their retries,
resyncs and moves between replicas.

The orchestrator owns the committed token history. Every call tells a service where
its new tokens start (what the orchestrator knows it holds) and sends the rest; a
service that lost the session answers FAILED_PRECONDITION and gets the whole history
again (a resync: one prefill, never a wrong token)."""

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator, Callable

import grpc

from specdec import features, tracing
from specdec.api.common.v1 import common_pb2
from specdec.api.drafter.v1 import drafter_pb2
from specdec.errors import needs_resync
from specdec.lookup import LookupIndex, OutputMemory
from specdec.api.verifier.v1 import verifier_pb2
from orchestrator.bridge import Aligned
from orchestrator.pool import DrafterPool, DrafterReplica, FeatureRule, Replica
from orchestrator.stats import Stats
from orchestrator.tasks import spawn

if TYPE_CHECKING:
    from orchestrator.verifiers import VerifierPool, VerifierReplica

log = logging.getLogger("orchestrator")

# Drafter errors that say the replica is in trouble (the pool retries it later), as
# opposed to errors about this request alone. CANCELLED: the replica is stopping (below).
REPLICA_DOWN = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNKNOWN,
                grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INTERNAL, grpc.StatusCode.CANCELLED)


class Deadline:
    """What is left of the client's deadline: no call downstream waits longer (the
    service's own limit still caps each call)."""

    def __init__(self, seconds: float | None):
        self.at = None if seconds is None else time.monotonic() + seconds

    def timeout(self, limit_s: float) -> float:
        if self.at is None:
            return limit_s
        return max(0.001, min(limit_s, self.at - time.monotonic()))

    def passed(self) -> bool:
        return self.at is not None and time.monotonic() >= self.at


@dataclass
class Verdict:
    """The verifier's answer to a round's drafts."""
    accepted: int  # the length of the drafts' prefix the target accepted
    next_token: int  # and its own token after them: the correction, or the bonus where all passed
    batch_pass: verifier_pb2.BatchPass | None  # the batched pass that ran the round
    logprobs: list[common_pb2.TokenLogprobs] = field(default_factory=list)  # of each, where asked


@dataclass
class Step:
    """A token of a run of the target alone, as the verifier picked it."""
    token: int
    batch_pass: verifier_pb2.BatchPass | None
    logprobs: common_pb2.TokenLogprobs | None = None  # where asked
    # On the own token of a pass that checked lookup drafts: (those drafts, those kept).
    lookup: tuple[int, int] | None = None
    # On the own token of a pass that checked offered drafts: (those drafts, those kept).
    offered: tuple[int, int] | None = None


class FeatureFeed:
    """A request's path for the target's features, for a feature drafter: the verifier
    sends those of each committed position once (from the first one the window lacks),
    the window keeps the last `rule.window`, and the drafter gets each once (a drafter
    that lost the session: the window again)."""

    def __init__(self, rule: FeatureRule):
        self.layers = list(rule.layers)
        self.window = features.Window(rule.window)

    def request(self, committed: int) -> verifier_pb2.FeatureRequest:
        first = min(max(self.window.end, committed - self.window.size), committed - 1)
        return verifier_pb2.FeatureRequest(layers=self.layers, first_position=max(0, first))


class VerifierLink:
    """A request's session on one verifier replica, which the pool picks by the request's
    prompt and load at its first call. The replica losing the session costs a resync; a
    replica that fails or leaves the set, a resync on another. With no replica to take it,
    the request waits for one for `retry_s` (a restart takes a few seconds), within the
    client's deadline; then it fails UNAVAILABLE."""

    def __init__(self, pool: "VerifierPool", session_id: str, prompt: list[int],
                 params: common_pb2.SamplingParams, stats: Stats, timeout_s: float, retry_s: float = 15.0,
                 deadline: Deadline = Deadline(None), metadata=(), features: "FeatureFeed | None" = None,
                 constraint: common_pb2.Constraint | None = None, top_logprobs: int | None = None):
        self.pool, self.session_id, self.prompt = pool, session_id, prompt
        self.top_logprobs = top_logprobs  # None: no log-probabilities asked for
        self.constraint = constraint  # the output's, sent with each call that (re)creates the session
        self.features = features  # the target's features a feature drafter reads, kept as they come
        self.params, self.stats = params, stats
        self.metadata = metadata  # the request's label, for the service's logs
        self.timeout_s, self.retry_s, self.deadline = timeout_s, retry_s, deadline
        self.replica: "VerifierReplica | None" = None
        self.left: "VerifierReplica | None" = None  # the replica it last failed on (it may come back)
        self.synced = 0  # committed tokens the replica is known to hold

    async def _stub(self):
        """The session's replica's stub; a new replica (a resync) when its own left the set."""
        if self.replica is not None and self.replica.removed:
            log.info("[%s] verifier %s left the replica set; moving on", self.session_id, self.replica.address)
            self.drop()  # closed there once the session has moved
        if self.replica is None:
            self.replica = self.pool.acquire(self.prompt)
            if self.replica is None:
                raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                           "no verifier replica can take a session now")
            if self.left is not None and self.replica is not self.left:
                log.info("[%s] verifier %s -> %s: a resync", self.session_id, self.left.address,
                         self.replica.address)
                spawn(self._close_on(self.left))  # alive (draining, or back), it frees the session's blocks now
                self.left.moved_away += 1
                self.pool.moved()
                self.stats.moved(resync=self.synced > 0)
                self.synced = 0
            self.left = None
        return self.replica.stub

    async def _close_on(self, replica: "VerifierReplica") -> None:
        with contextlib.suppress(grpc.aio.AioRpcError):  # gone: its sessions went with it
            await replica.stub.CloseSession(verifier_pb2.CloseSessionRequest(session_id=self.session_id),
                                            timeout=5, metadata=self.metadata)

    def drop(self) -> None:
        """Leaves the replica (it failed or left the set); the next call takes one again."""
        if self.replica is not None:
            self.left, self.replica = self.replica, None
            self.pool.release(self.left)

    def _session_fields(self) -> dict:
        """The request fields of the session's constraint (at start = 0 only) and of the
        log-probabilities asked for."""
        fields = {} if self.top_logprobs is None else {"logprobs": True, "top_logprobs": self.top_logprobs}
        if self.constraint is None or self.synced > 0:
            return fields
        return {"constraint": self.constraint, "constraint_start": len(self.prompt), **fields}

    def _answered(self, batch_pass: verifier_pb2.BatchPass) -> None:
        self.pool.observe(self.replica, batch_pass)

    async def verify(self, history: list[int], drafts: list[int],
                     qs: list[common_pb2.SparseDistribution]) -> Verdict:
        retry = _Retry(self)
        while True:
            try:
                stub = await self._stub()
                request = verifier_pb2.VerifyRequest(
                    session_id=self.session_id, start=self.synced, new_tokens=history[self.synced:],
                    draft_tokens=drafts, draft_probs=qs, sampling=self.params,
                    features=self.features and self.features.request(len(history)), **self._session_fields())
                response = await stub.Verify(request, timeout=self.deadline.timeout(self.timeout_s),
                                             metadata=self.metadata + tracing.headers())
            except grpc.aio.AioRpcError as err:
                await retry.after(err)
                continue
            self.synced = len(history)
            self._answered(response.batch_pass)
            self._features(response)
            return Verdict(response.num_accepted, response.next_token, response.batch_pass, list(response.logprobs))

    async def score(self, top_logprobs: int) -> list[common_pb2.TokenLogprobs]:
        """The target's log-probabilities of the prompt's tokens after the first (one
        prefill on the session, which the next call resets: it starts at 0)."""
        retry = _Retry(self)
        while True:
            try:
                stub = await self._stub()
                response = await stub.Score(
                    verifier_pb2.ScoreRequest(session_id=self.session_id, token_ids=self.prompt,
                                              top_logprobs=top_logprobs),
                    timeout=self.deadline.timeout(self.timeout_s), metadata=self.metadata + tracing.headers())
            except grpc.aio.AioRpcError as err:
                await retry.after(err)
                continue
            self.synced = 0  # what it holds now is not what a round's call assumes: the next one starts at 0
            self._answered(response.batch_pass)
            return list(response.logprobs)

    def _features(self, response) -> None:
        if self.features is not None and response.HasField("features"):
            self.features.window.add(response.features)
            self.stats.features_received(len(response.features.data))

    async def decode(self, history: list[int], max_tokens: int, stop: set[int], draft_forced: bool = False,
                     draft_lookup: verifier_pb2.LookupRule | None = None,
                     offers: "asyncio.Queue[verifier_pb2.DraftOffer | None] | None" = None
                     ) -> AsyncIterator[Step]:
        """The target alone after `history`: up to max_tokens tokens, each as soon as the
        verifier picks it, ending after a stop token (`draft_forced`, `draft_lookup`: the
        drafts the verifier makes within the run; see DecodeRequest). `offers`: drafts the
        caller offers the run as it goes, sent as they come (None: no more). A call that
        fails part-way goes on from the tokens it gave."""
        retry, got, kept = _Retry(self), [], 0
        while len(got) < max_tokens and not (got and got[-1] in stop):
            call = None
            try:
                stub = await self._stub()
                sent = history + got
                request = verifier_pb2.DecodeRequest(
                    session_id=self.session_id, start=self.synced, new_tokens=sent[self.synced:],
                    sampling=self.params, max_tokens=max_tokens - len(got), stop_token_ids=sorted(stop),
                    features=self.features and self.features.request(len(sent)), draft_forced=draft_forced,
                    draft_lookup=draft_lookup, **self._session_fields())
                ended = asyncio.Event()
                call = stub.Decode(_sent(request, offers, ended), timeout=self.deadline.timeout(self.timeout_s),
                                   metadata=self.metadata + tracing.headers())
                async for message in call:
                    got.append(message.token_id)
                    # The drafts the verifier made within the run (draft_forced, draft_lookup, offers).
                    self.stats.drafted(message.drafted + message.drafts_rejected, message.drafted)
                    checked = (kept + message.drafts_rejected, kept)
                    lookup = checked if message.lookup_drafts else None
                    offered = checked if message.offered_drafts else None
                    kept = kept + 1 if message.drafted else 0
                    self.synced = len(history) + len(got)  # it holds each token it picked
                    self._answered(message.batch_pass)
                    self._features(message)
                    yield Step(message.token_id, message.batch_pass,
                               message.logprobs if message.HasField("logprobs") else None, lookup, offered)
            except grpc.aio.AioRpcError as err:
                kept = 0
                await retry.after(err)
                continue
            finally:
                if call is not None:
                    ended.set()  # its request iterator takes no more offers: they are the next call's
                    call.cancel()  # a no-op after the end; if the caller stopped reading, the verifier stops
            return

    async def close(self, history: list[int] = ()) -> None:
        """Ends the session; `history`: the request's tokens, which its replica now holds
        for the requests that share them (prefix routing)."""
        if self.replica is None:
            return
        replica = self.replica
        self.replica = None
        try:
            self.pool.remember(list(history)[:self.synced], replica)
            await replica.stub.CloseSession(verifier_pb2.CloseSessionRequest(session_id=self.session_id),
                                            timeout=5, metadata=self.metadata)
        finally:
            self.pool.release(replica)


async def _sent(request: verifier_pb2.DecodeRequest, offers: "asyncio.Queue | None", ended: asyncio.Event):
    """A run's messages: its request, then each offer as it comes, until None, or until
    its call `ended` (grpc.aio does not cancel a finished call's request iterator: it would
    take a retried call's offers, and the None that ends its stream)."""
    yield request
    while offers is not None and not ended.is_set():
        taking, ending = asyncio.ensure_future(offers.get()), asyncio.ensure_future(ended.wait())
        await asyncio.wait((taking, ending), return_when=asyncio.FIRST_COMPLETED)
        ending.cancel()
        if not taking.done():
            taking.cancel()
            return
        offer = taking.result()
        if ended.is_set():
            offers.put_nowait(offer)  # taken as the call ended: the next call's
            return
        if offer is None:
            return
        yield verifier_pb2.DecodeRequest(offer=offer)


# Verifier errors that say the session's replica is gone for it: unreachable, or stopping
# (a verifier that began its drain on SIGTERM answered a call that reached it then with
# CANCELLED; the orchestrator's own cancellations never arrive as an error).
REPLICA_GONE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


class _Retry:
    """What one verifier call does after an error: a resync (once the session is known
    lost); on an unreachable or stopping replica (REPLICA_GONE), a move to another one,
    or, with none, a pause while it is unreachable (for up to `retry_s`, within the
    client's deadline); else the error raised."""

    def __init__(self, link: VerifierLink):
        self.link, self.attempt, self.unreachable_since = link, 0, None

    async def after(self, err: grpc.aio.AioRpcError) -> None:
        link = self.link
        if needs_resync(err.code(), err.details()) and link.synced > 0:
            log.info("[%s] verifier resync: %s", link.session_id, err.details())
            link.synced = 0
            link.stats.resynced()
            return
        if err.code() in REPLICA_GONE:
            replica = link.replica
            if replica is not None:
                link.pool.mark_down(replica, err)
                link.drop()
                if link.pool.others(replica):
                    return  # the next call goes to another replica at once
            self.unreachable_since = self.unreachable_since or time.monotonic()
            pause = min(2.0, 0.25 * 2 ** self.attempt)
            if time.monotonic() + pause - self.unreachable_since <= link.retry_s and \
                    link.deadline.timeout(float("inf")) > pause:
                self.attempt += 1
                await asyncio.sleep(pause)
                return
        raise err


class DrafterLink:
    """A request's session on one drafter replica. A replica that fails is left for
    another (which resyncs); with none left the rounds go on without drafts."""

    def __init__(self, pool: DrafterPool, session_id: str, params: common_pb2.SamplingParams, stats: Stats,
                 timeout_s: float, deadline: Deadline = Deadline(None), metadata=(),
                 memory: Callable[[tuple[int, int]], OutputMemory | None] | None = None,
                 features: FeatureFeed | None = None):
        self.pool, self.session_id, self.params, self.stats = pool, session_id, params, stats
        self.memory = memory  # earlier requests' outputs under a lookup rule, for longer matches than its own
        self.metadata = metadata
        self.timeout_s, self.deadline = timeout_s, deadline
        self.replica: Replica | None = None
        self.synced = 0
        self.refused = False  # a replica refused this request, or it outgrew their model: no model drafts
        self.lookup: LookupIndex | None = None  # the drafters' lookup rule over this request's history
        self.features = features  # a feature drafter's: the verifier's link fills the same feed
        self.features_held = 0  # the replica holds the features of positions before this one
        self.aligned: Aligned | None = None  # on a drafter of another vocabulary: the history in its tokens
        self.sampling = params

    def lookup_drafts(self, history: list[int], k: int) -> list[int]:
        """Drafts by prompt lookup after `history` (up to k), by the rule the drafters
        report (specdec.lookup, on the committed history, which only grows); [] where the
        rule finds no match, or the drafters draft with their model alone. A lookup round
        drafts these itself: it needs no drafter call, only the verifier's pass."""
        rule = self.lookup_rule
        if rule is None:
            return []
        if self.lookup is None or (self.lookup.min_n, self.lookup.max_n) != rule:
            self.lookup = LookupIndex(rule[1], rule[0], self.memory(rule) if self.memory else None)
        self.lookup.update(history)
        return self.lookup.match(k)

    @property
    def lookup_rule(self) -> tuple[int, int] | None:
        """(shortest, longest match) of the drafters' lookup, where this request drafts by it:
        a request the drafters' model cannot draft for still does (no drafter call)."""
        return self.pool.lookup_rule

    @property
    def drafts_by_model(self) -> bool:
        """Whether the drafters' model may still draft for this request."""
        return not self.refused

    @property
    def lookup_from_memory(self) -> bool:
        """Whether the last lookup drafts came from earlier requests' outputs."""
        return self.lookup is not None and self.lookup.from_memory

    async def propose(self, history: list[int], k: int, committed: int | None = None
                      ) -> tuple[list[int], list[common_pb2.SparseDistribution]]:
        """Drafts k tokens after `history`, of which the first `committed` (default: all)
        are committed; the rest are a guess, which the drafter holds only until the next
        call says otherwise."""
        if self.replica is not None and self.replica.removed:
            log.info("[%s] drafter %s left the replica set; moving on", self.session_id, self.replica.address)
            try:
                await self.close()
            except grpc.aio.AioRpcError:
                pass  # it may be gone already; its idle timeout releases the session
        while not self.refused:
            if self.replica is None:
                self.replica = await self.pool.acquire()
                self.synced = 0
                if self.replica is None:
                    return [], []
                self._on_replica(self.replica)
            try:
                if self.aligned is not None:
                    return await self._propose_across(history, k, committed)
                return await self._propose(history, k, len(history) if committed is None else committed,
                                           draw_at=len(history))
            except grpc.aio.AioRpcError as err:
                if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED and self.deadline.passed():
                    raise  # the client's deadline, not the replica's fault
                replica, self.replica = self.replica, None
                self.pool.release(replica)
                if err.code() not in REPLICA_DOWN:
                    # About this request alone (an argument the drafter refuses): the
                    # replica stays in service for the others, this request goes on undrafted.
                    log.error("[%s] drafter %s refused the request: %s %s; going on without drafts",
                              self.session_id, replica.address, err.code().name, err.details())
                    self.refused = True
                    break
                log.warning("[%s] drafter %s failed: %s; moving on", self.session_id, replica.address,
                            err.code().name)
                self.pool.mark_down(replica, err)
                self.stats.failed_over()
        return [], []

    def _on_replica(self, replica: DrafterReplica) -> None:
        """A new replica's session: in its own tokens where its vocabulary is another, the
        logit bias on its tokens of the same text."""
        self.aligned = Aligned(replica.bridge) if replica.bridge is not None else None
        self.sampling = self.params
        if self.aligned is not None and self.params.logit_bias:
            self.sampling = common_pb2.SamplingParams()
            self.sampling.CopyFrom(self.params)
            self.sampling.logit_bias.clear()
            self.sampling.logit_bias.update(replica.bridge.draft_bias(self.params.logit_bias))

    async def _propose_across(self, history: list[int], k: int, committed: int | None):
        """Drafts of a drafter with another vocabulary, carried over to the target's tokens
        (orchestrator.bridge). Drafts after a guess (committed < len(history): drafting
        ahead) are not asked for: the guess's tokens need not be whole words in its text."""
        if committed is not None and committed < len(history):
            return [], []
        drafted = self.aligned.draft_history(history)
        self.synced = min(self.synced, self.aligned.kept(drafted))
        # Its draws keyed by the target's positions: its own history may have grown by no
        # token since the last round (a correction merged with the token before it).
        drafts, qs = await self._propose(drafted, k, len(drafted), draw_at=len(history))
        self.aligned.sent = drafted
        return self.replica.bridge.to_target(history, drafted, drafts, qs, k)

    def _features_for(self, committed: int) -> common_pb2.Features | None:
        """The features the replica lacks, up to the position before the last committed one."""
        if self.features is None:
            return None
        window = self.features.window
        if self.synced == 0:
            self.features_held = 0  # a new session there: the window again
        return window.since(max(self.features_held, window.start, committed - 1 - window.size), committed - 1)

    async def _propose(self, history: list[int], k: int, committed: int, draw_at: int):
        if len(history) >= self.replica.max_positions:
            log.info("[%s] the history (%d tokens) outgrew the drafter's model (%d positions); going on without "
                     "its drafts", self.session_id, len(history), self.replica.max_positions)
            self.refused = True
            return [], []
        while True:
            features = self._features_for(committed)
            request = drafter_pb2.ProposeRequest(
                session_id=self.session_id, start=self.synced, new_tokens=history[self.synced:],
                num_draft_tokens=k, sampling=self.sampling, features=features, draw_position=draw_at)
            drafts, qs = [], []
            try:
                async for run in self.replica.stub.Propose(request, timeout=self.deadline.timeout(self.timeout_s),
                                                           metadata=self.metadata + tracing.headers()):
                    drafts.extend(run.token_ids)
                    qs.extend(run.qs)
            except grpc.aio.AioRpcError as err:
                if needs_resync(err.code(), err.details()) and self.synced > 0:
                    log.info("[%s] drafter resync: %s", self.session_id, err.details())
                    self.synced = 0
                    self.stats.resynced(drafter=True)
                    continue
                raise
            self.synced = committed
            if features is not None:
                self.features_held = features.start + features.rows
                self.stats.features_sent(len(features.data))
            if qs and len(qs) != len(drafts):
                # A draft without its distribution would be verified as one-hot: drop them all.
                log.error("[%s] drafter %s sent %d distributions for %d drafts; ignoring its drafts",
                          self.session_id, self.replica.address, len(qs), len(drafts))
                return [], []
            return drafts, qs

    async def close(self) -> None:
        if self.replica is not None:
            replica, self.replica = self.replica, None
            try:
                await replica.stub.CloseSession(drafter_pb2.CloseSessionRequest(session_id=self.session_id),
                                                timeout=5, metadata=self.metadata)
            finally:
                self.pool.release(replica)
