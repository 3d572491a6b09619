"""The speculative round, and each request's sessions on the drafter and the verifier.

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
from opentelemetry import context as otel_context, trace

from specdec.common.v1 import common_pb2
from specdec.drafter.v1 import drafter_pb2
from specdec import features, grammar, sampling, tracing
from specdec.errors import InvalidArgument, needs_resync
from specdec.lookup import LookupIndex, OutputMemory
from specdec.verifier.v1 import verifier_pb2
from orchestrator.kpolicy import AdaptiveK, FixedK
from orchestrator.pool import DrafterPool, FeatureRule, Replica
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
class Stats:
    rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    resyncs: int = 0
    drafter_failovers: int = 0
    verifier_moves: int = 0  # moves to another verifier replica (each a resync too)
    accepted_per_position: list[int] = field(default_factory=list)
    lookaheads: int = 0  # rounds drafted ahead, while the previous round was verified
    lookahead_hits: int = 0  # of those, rounds whose guess held and whose drafts were used
    draft_s: float = 0.0  # time the rounds waited on the drafter
    verify_s: float = 0.0  # and on the verifier
    pass_rows: int = 0  # rows of the verifier passes that ran the rounds, summed
    rounds_by_k: dict[int, int] = field(default_factory=dict)  # rounds per number of drafts
    drafter_resyncs: int = 0  # of resyncs, those of the drafter session
    lookup_rounds: int = 0  # rounds the drafter drafted by prompt lookup
    lookup_accepted: int = 0  # their accepted drafts
    memory_rounds: int = 0  # of lookup rounds, those drafted from earlier requests' outputs
    memory_accepted: int = 0  # and their accepted drafts
    runs_cut: int = 0  # runs of the target alone stopped early for a lookup round
    probes_beside_runs: int = 0  # drafts checked against a run's tokens, not verified in a round
    lookups_checked: int = 0  # tokens of runs checked against the lookup's next token
    feature_bytes: int = 0  # the target's features the verifier sent (a feature drafter's)
    feature_bytes_sent: int = 0  # and those sent on to drafters (a resync sends a window again)
    # Called after each round with (K asked, drafts verified, accepted, drafter call seconds
    # or None, verifier call seconds): the deployment's metrics.
    on_round: Callable[[int, int, int, float | None, float], None] | None = None

    def observe_pass(self, batch_pass: verifier_pb2.BatchPass | None) -> None:
        if batch_pass is not None:
            self.pass_rows += batch_pass.rows

    def record(self, drafted: int, accepted: int) -> None:
        self.rounds += 1
        self.rounds_by_k[drafted] = self.rounds_by_k.get(drafted, 0) + 1
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        if len(self.accepted_per_position) < drafted:
            self.accepted_per_position.extend([0] * (drafted - len(self.accepted_per_position)))
        for i in range(accepted):
            self.accepted_per_position[i] += 1


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
        # With top_logprobs (None: none asked): the target's log-probabilities of each
        # committed token, by position, as the calls bring them.
        self.top_logprobs = top_logprobs
        self.logprobs: dict[int, common_pb2.TokenLogprobs] = {}
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
                self.stats.verifier_moves += 1
                if self.synced > 0:
                    self.stats.resyncs += 1
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
                     qs: list[common_pb2.SparseDistribution]) -> tuple[int, int, verifier_pb2.BatchPass]:
        """(accepted, the verifier's token, the batched pass that ran the round)"""
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
            for i, logprobs in enumerate(response.logprobs):
                self.logprobs[len(history) + i] = logprobs
            return response.num_accepted, response.next_token, response.batch_pass

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
            self.stats.feature_bytes += len(response.features.data)

    async def decode(self, history: list[int], max_tokens: int, stop: set[int], draft_forced: bool = False,
                     draft_lookup: verifier_pb2.LookupRule | None = None
                     ) -> AsyncIterator[tuple[int, verifier_pb2.BatchPass, tuple[int, int] | None]]:
        """The target alone after `history`: up to max_tokens tokens, each as soon as the
        verifier picks it, ending after a stop token (`draft_forced`, `draft_lookup`: the
        drafts the verifier makes within the run; see DecodeRequest), with, on the own token
        of a pass that checked lookup drafts, (those drafts, those kept). A call that fails
        part-way goes on from the tokens it gave."""
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
                call = stub.Decode(request, timeout=self.deadline.timeout(self.timeout_s),
                                   metadata=self.metadata + tracing.headers())
                async for message in call:
                    got.append(message.token_id)
                    # The drafts the verifier made within the run (draft_forced, draft_lookup).
                    self.stats.draft_tokens += message.drafted + message.drafts_rejected
                    self.stats.accepted_tokens += message.drafted
                    lookup = (kept + message.drafts_rejected, kept) if message.lookup_drafts else None
                    kept = kept + 1 if message.drafted else 0
                    if message.HasField("logprobs"):
                        self.logprobs[len(history) + len(got) - 1] = message.logprobs
                    self.synced = len(history) + len(got)  # it holds each token it picked
                    self._answered(message.batch_pass)
                    self._features(message)
                    yield message.token_id, message.batch_pass, lookup
            except grpc.aio.AioRpcError as err:
                kept = 0
                await retry.after(err)
                continue
            finally:
                if call is not None:
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


# Verifier errors that say the session's replica is gone for it: unreachable, or stopping
# (a verifier that began its drain on SIGTERM answered a call that reached it then with
# CANCELLED, 6 ms in; the orchestrator's own cancellations never arrive as an error).
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
            link.stats.resyncs += 1
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
                 memory: Callable[[tuple[int, int]], OutputMemory | None] | None = None):
        self.pool, self.session_id, self.params, self.stats = pool, session_id, params, stats
        self.memory = memory  # earlier requests' outputs under a lookup rule, for longer matches than its own
        self.metadata = metadata
        self.timeout_s, self.deadline = timeout_s, deadline
        self.replica: Replica | None = None
        self.synced = 0
        self.refused = False  # a replica refused this request: it goes on without drafts
        self.lookup: LookupIndex | None = None  # the drafters' lookup rule over this request's history
        self.features: FeatureFeed | None = None  # for a feature drafter (set with the verifier's)
        self.features_held = 0  # the replica holds the features of positions before this one

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
        """(shortest, longest match) of the drafters' lookup, where this request drafts by it."""
        return None if self.refused else self.pool.lookup_rule

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
            try:
                return await self._propose(history, k, len(history) if committed is None else committed)
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
                self.stats.drafter_failovers += 1
        return [], []

    def _features_for(self, committed: int) -> common_pb2.Features | None:
        """The features the replica lacks, up to the position before the last committed one."""
        if self.features is None:
            return None
        window = self.features.window
        if self.synced == 0:
            self.features_held = 0  # a new session there: the window again
        return window.since(max(self.features_held, window.start, committed - 1 - window.size), committed - 1)

    async def _propose(self, history: list[int], k: int, committed: int):
        while True:
            features = self._features_for(committed)
            request = drafter_pb2.ProposeRequest(
                session_id=self.session_id, start=self.synced, new_tokens=history[self.synced:],
                num_draft_tokens=k, sampling=self.params, model_drafts=True, features=features)
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
                    self.stats.resyncs += 1
                    self.stats.drafter_resyncs += 1
                    continue
                raise
            self.synced = committed
            if features is not None:
                self.features_held = features.start + features.rows
                self.stats.feature_bytes_sent += len(features.data)
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


async def _cancel(task: asyncio.Future) -> None:
    """Cancels a drafter call made beside the round and waits until it has ended."""
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, grpc.aio.AioRpcError):
        pass


class _Lookahead:
    """The next round's drafts, drafted while this round is verified. They assume the
    verifier accepts all of this round's drafts and that its own token is the one the
    drafter guesses: the first token the drafter proposes after the drafts. They are
    used only if both hold, so they never change the output, only when drafting happens."""

    def __init__(self, drafter: DrafterLink, history: list[int], drafts: list[int], k: int):
        self.drafts_sent = len(drafts)
        self.task = asyncio.ensure_future(drafter.propose(history + drafts, k + 1, committed=len(history)))

    async def take(self, accepted: int, next_token: int):
        """The drafts for the next round if the guess held, else None."""
        if accepted < self.drafts_sent:
            await self.cancel()
            return None
        try:
            drafts, qs = await self.task
        except grpc.aio.AioRpcError:
            return None  # the next round drafts again, on another replica if need be
        if not drafts or drafts[0] != next_token:
            return None
        return drafts[1:], qs[1:]

    async def cancel(self) -> None:
        await _cancel(self.task)


class _BesideRun:
    """A probe that needs no round: k model drafts asked for as a run of the target alone
    starts, checked against the run's tokens once it ends. In a greedy request
    those are the target's choices, and a round accepts a draft iff it is the target's
    choice: the run tells how many of the drafts a round would have accepted."""

    def __init__(self, drafter: DrafterLink, history: list[int], k: int):
        self.start = len(history)
        self.done_at: float | None = None  # when the drafter answered
        self.task = asyncio.ensure_future(self._propose(drafter, list(history), k))

    async def _propose(self, drafter: DrafterLink, history: list[int], k: int) -> tuple[list[int], float]:
        started = time.perf_counter()
        drafts, _ = await drafter.propose(history, k)
        self.done_at = time.perf_counter()
        return drafts, self.done_at - started

    def answered(self, by: float) -> bool:
        """Whether the drafter had answered by time `by` (perf_counter)."""
        return self.done_at is not None and self.done_at <= by

    async def settle(self, history: list[int], policy: FixedK | AdaptiveK, stats: Stats) -> None:
        """After the run: the policy learns what the drafts would have got, if the drafter
        answered before the run ended (a slower one is cancelled: nothing learned) and the
        run decided them (it saw a draft miss, or went past them all)."""
        if not self.task.done():
            await _cancel(self.task)
            return
        try:
            drafts, took = self.task.result()
        except grpc.aio.AioRpcError:
            return  # the next round drafts again, on another replica if need be
        run = history[self.start:]
        accepted = 0
        while accepted < min(len(drafts), len(run)) and drafts[accepted] == run[accepted]:
            accepted += 1
        if drafts and (accepted == len(drafts) or accepted < len(run)):
            policy.observe_beside(len(drafts), accepted, took)
            stats.probes_beside_runs += 1


async def _plain_run(policy: FixedK | AdaptiveK, budget: int, eos: set[int], history: list[int],
                     verifier: VerifierLink, stats: Stats, trace_context, beside: "_BesideRun | None" = None,
                     draft_forced: bool = False, draft_lookup: verifier_pb2.LookupRule | None = None
                     ) -> AsyncIterator[int]:
    """Up to `policy.run_length(budget)` tokens of the target alone, each yielded as it
    comes (the caller appends it to `history`); each counts as a round without drafts.
    `beside`: a probe of the drafter beside this run (what it costs the run's steps is
    measured, where it answers before the run ends). `draft_forced`, `draft_lookup`: the
    verifier drafts a constraint's forced tokens, and lookup matches, itself."""
    span = tracing.tracer.start_span("decode", context=trace_context)
    steps = verifier.decode(list(history), policy.run_length(budget), eos, draft_forced, draft_lookup)
    started = last = first = time.perf_counter()
    tokens, passes = 0, []
    try:
        while True:
            # The span is current only while this coroutine waits for a token (never across a yield).
            attached = otel_context.attach(trace.set_span_in_context(span, trace_context))
            try:
                token, batch_pass, lookup = await anext(steps)
            except StopAsyncIteration:
                break
            finally:
                otel_context.detach(attached)
            now = time.perf_counter()
            if lookup is not None:  # a pass's lookup drafts: what they got, at no drafter's cost
                policy.observe_beside(lookup[0], lookup[1], None, lookup=True)
            tokens += 1
            if tokens == 1:
                first = now  # the steps after it are the run's own (the first also opens the call)
            passes.append(batch_pass)
            stats.observe_pass(batch_pass)
            stats.verify_s += now - last
            stats.record(0, 0)
            if stats.on_round is not None:
                stats.on_round(0, 0, 0, None, now - last)
            last = now
            yield token
    finally:
        await steps.aclose()
        span.set_attribute("tokens", tokens)
        span.end()
        if tokens:
            policy.observe_run(tokens, last - started, passes, steps_s=last - first, probed=beside is not None,
                               answered=beside is not None and beside.answered(last))


async def speculate(
    prompt: list[int],
    max_new_tokens: int,
    k: int | FixedK | AdaptiveK,
    eos: set[int],
    drafter: DrafterLink,
    verifier: VerifierLink,
    stats: Stats,
    overlap: bool = False,
    trace_context=None,
    guide: grammar.Guide | None = None,
) -> AsyncIterator[list[int]]:
    """Yields the tokens committed by each round until max_new_tokens, an EOS token, or,
    under a constraint (`guide`), where the grammar allows no token.
    With `overlap`, the drafter drafts the next round while the verifier checks this one.

    Each round: the policy picks K (knowing whether the history holds a lookup match);
    K = 0 is a run of the target alone; otherwise propose K drafts, verify them in one
    target pass, and commit the accepted prefix and the verifier's own token. Both
    services learn the committed tokens at their next call (a lost session: a resync)."""
    policy = FixedK(k) if isinstance(k, int) else k
    history = list(prompt)
    produced = 0
    ahead: tuple[list[int], list[common_pb2.SparseDistribution]] | None = None  # drafted for the next round
    while produced < max_new_tokens:
        if guide is not None:
            _follow(guide, history)
            if guide.dead:
                return
        by_lookup = _free_drafts(drafter, guide, history, policy.lookup_k_max, policy.forced_in_rounds)
        # A round commits at most K + 1 tokens: never draft past the budget.
        k_round = min(policy.choose(len(by_lookup)), max_new_tokens - produced - 1)
        if k_round <= 0:
            ahead = None
            async with contextlib.aclosing(_target_alone(policy, drafter, verifier, history, by_lookup,
                                                         max_new_tokens - produced, eos, stats,
                                                         trace_context, guide)) as run:
                async for token in run:
                    produced += 1
                    yield [token]
                    if token in eos:
                        return
            continue
        new, ahead = await _round(policy, drafter, verifier, history, by_lookup, k_round, ahead,
                                  overlap and produced + k_round + 2 < max_new_tokens, stats, trace_context, guide)
        new = sampling.until_stop(new, eos)
        history.extend(new)
        produced += len(new)
        yield new
        if new[-1] in eos:
            return


def _free_drafts(drafter: DrafterLink, guide: grammar.Guide | None, history: list[int], k_max: int,
                 forced: bool = True) -> list[int]:
    """Drafts that need no drafter call: the lookup match; under a constraint, the tokens
    its grammar forces next where `forced` (else none: the verifier drafts those within
    its runs, and a lookup match there mostly repeats them, so its checks would price
    lookup rounds by tokens the runs get anyway; measured on 2 cores, whole structured
    requests 0.5-0.6x K = 0 where such rounds ran), or the lookup match cut after its
    first token the constraint forbids. A round verifies them: the output stays the
    target's."""
    if guide is None:
        return drafter.lookup_drafts(history, k_max)
    if not forced or k_max == 0:
        return []
    _follow(guide, history)
    return guide.forced()[:k_max] or _allowed(guide, drafter.lookup_drafts(history, k_max))


def _follow(guide: grammar.Guide, history: list[int]) -> None:
    if guide.sync(history):
        return
    if guide.matcher.is_error():  # a step over the grammar's bounds (a schema of many optional keys)
        raise InvalidArgument("constraint", f"the grammar failed after {guide.end - guide.start} output tokens: "
                                            f"{guide.error.splitlines()[0]}")
    # Every committed token was the verifier's pick under the same grammar.
    raise RuntimeError(f"the committed output left its constraint at position {guide.end}")


def _allowed(guide: grammar.Guide | None, drafts: list[int]) -> list[int]:
    """The drafts up to the first one the constraint forbids, that one included: the
    verifier rejects it, and the drafts after it could never be accepted."""
    return drafts if guide is None else drafts[:guide.allowed(drafts) + 1]


async def _round(policy: FixedK | AdaptiveK, drafter: DrafterLink, verifier: VerifierLink, history: list[int],
                 by_lookup: list[int], k: int, ahead, look_ahead: bool, stats: Stats, trace_context,
                 guide: grammar.Guide | None = None) -> tuple[list[int], tuple | None]:
    """One speculative round of k drafts after `history`: the lookup match's (`by_lookup`)
    where the policy chose a lookup round, else the drafter's model's (or `ahead`,
    drafted during the last round). -> (the accepted drafts and the verifier's own token,
    the next round's drafts if drafted ahead and their guess held). With `look_ahead`,
    the drafter drafts the next round while this one is verified."""
    lookup = policy.by_lookup and bool(by_lookup)
    from_memory = lookup and drafter.lookup_from_memory
    # The round's span is current only while this coroutine runs (never across the
    # caller's yield): its calls, and a look-ahead started in it, are its children.
    span = tracing.tracer.start_span("round", context=trace_context, attributes={"k": k})
    attached = otel_context.attach(trace.set_span_in_context(span, trace_context))
    lookahead: _Lookahead | None = None
    try:
        # 1. Propose: the match's tokens (one-hot q: none sent), or the drafter's.
        started = time.perf_counter()
        if lookup:
            drafts, qs = by_lookup[:k], []
        elif ahead is not None:
            drafts, qs = ahead[0][:k], ahead[1][:k]
            stats.lookahead_hits += 1
        else:
            drafts, qs = await drafter.propose(history, k)
        if guide is not None and not lookup:
            drafts = _allowed(guide, drafts)
            qs = qs[:len(drafts)]
        drafted = time.perf_counter()
        draft_s = drafted - started if drafts else None
        if look_ahead and not lookup:
            lookahead = _Lookahead(drafter, history, drafts, k)
            stats.lookaheads += 1
        # 2. Verify: one target pass keeps the accepted prefix and adds one token of its own.
        accepted, next_token, batch_pass = await verifier.verify(history, drafts, qs)
        verified = time.perf_counter()
        # 3. Adapt: the policy learns what the round's drafts got and what it cost.
        policy.observe(len(drafts), accepted, draft_s, verified - drafted, batch_pass, lookup)
        stats.lookup_rounds += lookup
        stats.lookup_accepted += accepted if lookup else 0
        stats.memory_rounds += from_memory
        stats.memory_accepted += accepted if from_memory else 0
        if by_lookup and not lookup and policy.probes_beside_runs:
            # A greedy round commits the target's choice first: what the match's first
            # token would have got, for free (as a run's tokens check it).
            committed = drafts[0] if accepted else next_token
            policy.observe_beside(1, int(committed == by_lookup[0]), None, lookup=True)
            stats.lookups_checked += 1
        stats.observe_pass(batch_pass)
        stats.draft_s += drafted - started
        stats.verify_s += verified - drafted
        stats.record(len(drafts), accepted)
        if stats.on_round is not None:
            stats.on_round(k, len(drafts), accepted, draft_s, verified - drafted)
        ahead = None
        if lookahead is not None:
            ahead, lookahead = await lookahead.take(accepted, next_token), None
            stats.draft_s += time.perf_counter() - verified
        span.set_attributes({"drafts": len(drafts), "accepted": accepted})
        return drafts[:accepted] + [next_token], ahead
    finally:
        if lookahead is not None:  # the round failed: the next one drafts afresh
            await lookahead.cancel()
        otel_context.detach(attached)
        span.end()


async def _target_alone(policy: FixedK | AdaptiveK, drafter: DrafterLink, verifier: VerifierLink,
                        history: list[int], by_lookup: list[int], budget: int, eos: set[int], stats: Stats,
                        trace_context, guide: grammar.Guide | None = None) -> AsyncIterator[int]:
    """A run of the target alone (one verifier call for its steps): appends each token to
    `history`, then yields it. It stops early where a lookup round would pay. Beside it:
    a probe of the drafter when the policy asks for one (off the steps' path, but a
    drafter on the verifier's cores slows them: the run measures by how much), and in a
    greedy request a check of each token against the lookup's next one (what a lookup
    round's first draft there would have got)."""
    probe_k = policy.beside_run()
    beside = _BesideRun(drafter, history, probe_k) if probe_k else None
    # Within the run, the verifier drafts (no round trip): under a constraint where the
    # policy may draft, the forced tokens; where the drafters draft by lookup and the
    # policy prices it to pay, the history's lookup matches (under a constraint, where it
    # forces nothing; those are not worth a run's cut there: measured, see _free_drafts).
    draft_forced = guide is not None and policy.k_max > 0
    if draft_forced:
        by_lookup = _free_drafts(drafter, guide, history, policy.lookup_k_max, forced=False)
    # A greedy run checks each token against the lookup's next one (under a constraint, none:
    # see _free_drafts), unless its passes check lookup drafts themselves (then those say
    # what a lookup round's would get).
    checks = policy.probes_beside_runs and guide is None
    draft_lookup, rule = None, drafter.lookup_rule
    if rule is not None and verifier.features is None and (lookup_k := policy.run_lookup_drafts(checks)):
        draft_lookup = verifier_pb2.LookupRule(min_match=rule[0], max_match=rule[1], max_drafts=lookup_k)
    check = checks and draft_lookup is None
    expected = by_lookup[:1] if check else []
    try:
        async with contextlib.aclosing(_plain_run(policy, budget, eos, history, verifier, stats,
                                                  trace_context, beside, draft_forced, draft_lookup)) as run:
            async for token in run:
                if expected:
                    policy.observe_beside(1, int(token == expected[0]), None, lookup=True)
                    stats.lookups_checked += 1
                history.append(token)
                yield token
                by_lookup = _free_drafts(drafter, guide, history, policy.lookup_k_max, forced=not draft_forced)
                if policy.lookup_pays(len(by_lookup)):
                    stats.runs_cut += 1
                    return
                expected = by_lookup[:1] if check else []
    finally:
        if beside is not None:
            await beside.settle(history, policy, stats)
