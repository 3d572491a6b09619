"""The speculative round (Leviathan et al. 2023, as the orchestrator runs it): the drafter
proposes K drafts, the target verifies them in one pass and keeps the longest prefix it
agrees with plus one token of its own (the correction, or the bonus when all pass), the
history commits them, and the policy adapts K. K = 0 is a run of the target alone.

`speculate` alone owns the committed history; the links (orchestrator.links) send each
service what it lacks of it."""

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

import grpc
from opentelemetry import context as otel_context, trace

from specdec import grammar, sampling_params, tracing
from specdec.api.common.v1 import common_pb2
from specdec.errors import InvalidArgument
from specdec.api.verifier.v1 import verifier_pb2
from orchestrator.kpolicy import AdaptiveK, FixedK
from orchestrator.links import DrafterLink, Step, Verdict, VerifierLink
from orchestrator.stats import Stats

log = logging.getLogger("orchestrator")

Drafts = tuple[list[int], list[common_pb2.SparseDistribution]]  # draft tokens, and their q (empty: one-hot)


@dataclass
class Commit:
    """Tokens committed together (a round's, or one of a run's), with the target's
    log-probabilities of each where they were asked for."""
    tokens: list[int]
    logprobs: list[common_pb2.TokenLogprobs] = field(default_factory=list)

    def until_stop(self, stop: set[int]) -> "Commit":
        tokens = sampling_params.until_stop(self.tokens, stop)
        return Commit(tokens, self.logprobs[:len(tokens)])


@dataclass
class _Request:
    """What every round of one request works with."""
    policy: FixedK | AdaptiveK
    drafter: DrafterLink
    verifier: VerifierLink
    stats: Stats
    guide: grammar.Guide | None
    trace_context: object
    overlap: bool  # the drafters have cores of their own: draft beside the verifier's passes


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
) -> AsyncIterator[Commit]:
    """Yields the tokens committed by each round until max_new_tokens, an EOS token, or,
    under a constraint (`guide`), where the grammar allows no token.
    With `overlap`, the drafter drafts the next round while the verifier checks this one,
    and offers its drafts to greedy runs of the target alone where the policy prices them
    to pay.

    Each round: the policy picks K (knowing whether the history holds a lookup match);
    K = 0 is a run of the target alone; otherwise propose K drafts, verify them in one
    target pass, and commit the accepted prefix and the verifier's own token. Both
    services learn the committed tokens at their next call (a lost session: a resync)."""
    policy = FixedK(k) if isinstance(k, int) else k
    r = _Request(policy, drafter, verifier, stats, guide, trace_context, overlap)
    history = list(prompt)
    produced = 0
    ahead: Drafts | None = None  # drafted for the next round, during the last one
    while produced < max_new_tokens:
        if guide is not None:
            _follow(guide, history)
            if guide.dead:
                return
        by_lookup = _free_drafts(drafter, guide, history, policy.lookup_k_max, policy.forced_in_rounds)
        # A round commits at most K + 1 tokens: never draft past the budget. Where the
        # drafter's model can no longer draft for this request, only lookup rounds remain.
        k_round = min(policy.choose(len(by_lookup)), max_new_tokens - produced - 1)
        if not drafter.drafts_by_model and not (policy.by_lookup and by_lookup):
            k_round = 0
        if k_round <= 0:
            ahead = None
            async with contextlib.aclosing(_target_alone(r, history, by_lookup, max_new_tokens - produced,
                                                         eos)) as run:
                async for step in run:
                    history.append(step.token)
                    produced += 1
                    yield Commit([step.token], [] if step.logprobs is None else [step.logprobs])
                    if step.token in eos:
                        return
            continue
        look_ahead = overlap and produced + k_round + 2 < max_new_tokens
        commit, ahead = await _round(r, history, by_lookup, k_round, ahead, look_ahead)
        commit = commit.until_stop(eos)
        history.extend(commit.tokens)
        produced += len(commit.tokens)
        yield commit
        if commit.tokens[-1] in eos:
            return


async def _round(r: _Request, history: list[int], by_lookup: list[int], k: int, ahead: Drafts | None,
                 look_ahead: bool) -> tuple[Commit, Drafts | None]:
    """One speculative round of k drafts after `history`: the lookup match's (`by_lookup`)
    where the policy chose a lookup round, else the drafter's model's (or `ahead`, drafted
    during the last round). -> (the accepted drafts and the verifier's own token, the next
    round's drafts if drafted ahead and their guess held). With `look_ahead`, the drafter
    drafts the next round while this one is verified."""
    lookup = r.policy.by_lookup and bool(by_lookup)
    from_memory = lookup and r.drafter.lookup_from_memory
    lookahead: _Lookahead | None = None
    with _current_span("round", r.trace_context, k=k) as span:
        try:
            # 1. Propose: the match's tokens (one-hot q: none sent), or the drafter's.
            started = time.perf_counter()
            drafts, qs = (by_lookup[:k], []) if lookup else await _propose(r, history, k, ahead)
            drafted = time.perf_counter()
            if look_ahead and not lookup:
                lookahead = _Lookahead(r.drafter, history, drafts, k, r.stats)
            # 2. Verify: one target pass keeps the accepted prefix and adds one token of its own.
            verdict = await r.verifier.verify(history, drafts, qs)
            verified = time.perf_counter()
            # 3. Adapt: the policy and the statistics learn what the drafts got and cost.
            draft_s, verify_s = drafted - started, verified - drafted
            r.policy.observe(len(drafts), verdict.accepted, draft_s if drafts else None, verify_s,
                             verdict.batch_pass, lookup)
            r.stats.round(k, len(drafts), verdict.accepted, draft_s, verify_s, verdict.batch_pass, lookup,
                          from_memory)
            if by_lookup and not lookup:
                _check_lookup(r, by_lookup[0], drafts, verdict)
            # 4. The next round's drafts, where they were drafted ahead and their guess held.
            if lookahead is not None:
                ahead, lookahead = await lookahead.take(verdict), None
            else:
                ahead = None
        finally:
            if lookahead is not None:  # the round failed: the next one drafts afresh
                await lookahead.cancel()
        span.set_attributes({"drafts": len(drafts), "accepted": verdict.accepted})
    return Commit(drafts[:verdict.accepted] + [verdict.next_token], verdict.logprobs), ahead


async def _propose(r: _Request, history: list[int], k: int, ahead: Drafts | None) -> Drafts:
    """The model's k drafts after `history`: those drafted ahead, or the drafter's; under a
    constraint, cut after the first one it forbids."""
    if ahead is not None:
        drafts, qs = ahead[0][:k], ahead[1][:k]
        r.stats.lookahead_hits += 1
    else:
        drafts, qs = await r.drafter.propose(history, k)
    if r.guide is not None:
        drafts = _allowed(r.guide, drafts)
        qs = qs[:len(drafts)]
    return drafts, qs


def _check_lookup(r: _Request, matched: int, drafts: list[int], verdict: Verdict) -> None:
    """A greedy round commits the target's choice first: what the lookup match's first
    token would have got, for free (as a run's tokens check it)."""
    if r.policy.probes_beside_runs:
        committed = drafts[0] if verdict.accepted else verdict.next_token
        r.policy.observe_beside(1, int(committed == matched), None, lookup=True)
        r.stats.lookups_checked += 1


@contextlib.contextmanager
def _current_span(name: str, trace_context, **attributes):
    """A span that is current only while the coroutine that opens it runs (never across
    its caller's yield): the calls made in it, and tasks started in it, are its children."""
    span = tracing.tracer.start_span(name, context=trace_context, attributes=attributes)
    attached = otel_context.attach(trace.set_span_in_context(span, trace_context))
    try:
        yield span
    finally:
        otel_context.detach(attached)
        span.end()


# -- drafts that need no drafter call ------------------------------------------------------

def _free_drafts(drafter: DrafterLink, guide: grammar.Guide | None, history: list[int], k_max: int,
                 forced: bool = True) -> list[int]:
    """Drafts that need no drafter call: the lookup match; under a constraint, the tokens
    its grammar forces next where `forced` (else none: the verifier drafts those within
    its runs, and a lookup match there mostly repeats them, so its checks would price
    lookup rounds by tokens the runs get anyway; measured: docs/benchmarks.md, structured
    output), or the lookup match cut after its first token the constraint forbids. A
    round verifies them: the output stays the target's."""
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


# -- drafting beside the target's passes ----------------------------------------------------

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

    def __init__(self, drafter: DrafterLink, history: list[int], drafts: list[int], k: int, stats: Stats):
        self.drafts_sent, self.stats = len(drafts), stats
        self.task = asyncio.ensure_future(drafter.propose(history + drafts, k + 1, committed=len(history)))
        stats.lookaheads += 1

    async def take(self, verdict: Verdict) -> Drafts | None:
        """The drafts for the next round if the guess held, else None."""
        waited = time.perf_counter()
        try:
            if verdict.accepted < self.drafts_sent:
                await self.cancel()
                return None
            drafts, qs = await self.task
        except grpc.aio.AioRpcError:
            return None  # the next round drafts again, on another replica if need be
        finally:
            self.stats.waited_ahead(time.perf_counter() - waited)
        if not drafts or drafts[0] != verdict.next_token:
            return None
        return drafts[1:], qs[1:]

    async def cancel(self) -> None:
        await _cancel(self.task)


class _Offering:
    """The drafter's drafts offered to a run of the target alone as it goes (SpecDec's
    draft-while-verifying, PEARL's pre-verify): after each committed token, unless a call
    is still out, the drafter drafts `k` tokens after the history committed so far, and
    the run takes them for a pass where their first ones (a guess while the pass in flight
    decided them) are what it committed. The run never waits for them; a drafter on cores
    of its own costs it only the pass's extra tokens where the guess held. In a greedy
    request each offer's first draft, checked against the token the run committed there,
    is what a round's first draft would have got: the policy's acceptance."""

    def __init__(self, drafter: DrafterLink, history: list[int], k: int, policy: FixedK | AdaptiveK, stats: Stats):
        self.drafter, self.history, self.k, self.policy, self.stats = drafter, history, k, policy, stats
        self.queue: asyncio.Queue = asyncio.Queue()  # to the run: DraftOffer, then None
        self.task: asyncio.Future | None = None
        self.guesses: list[tuple[int, int]] = []  # (position, first draft) of the offers not yet checked

    def committed(self) -> None:
        """The history grew (the live list): check the offers it decided; draft again."""
        while self.guesses and self.guesses[0][0] < len(self.history):
            position, token = self.guesses.pop(0)
            self.policy.observe_beside(1, int(self.history[position] == token), None)
        if self.task is None or self.task.done():
            if self.task is not None:
                self._log_failure()  # the next token asks again
            self.task = asyncio.ensure_future(self._draft())

    async def _draft(self) -> None:
        while True:
            history = list(self.history)
            drafts, qs = await self.drafter.propose(history, self.k)
            if not drafts:
                return
            self.queue.put_nowait(verifier_pb2.DraftOffer(position=len(history), tokens=drafts, probs=qs))
            self.guesses.append((len(history), drafts[0]))
            self.stats.offers += 1
            if len(self.history) == len(history):
                return  # drafted after the latest history: the next token asks again

    async def close(self) -> None:
        if self.task is not None and self.task.done():
            self._log_failure()
        elif self.task is not None:
            await _cancel(self.task)
        self.queue.put_nowait(None)

    def _log_failure(self) -> None:
        """Logs the last call's failure, if it failed (the run went on without its offer)."""
        if not self.task.cancelled() and self.task.exception() is not None:
            log.info("an offer's drafter call failed: %s", self.task.exception())


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


# -- the target alone ---------------------------------------------------------------------

async def _target_alone(r: _Request, history: list[int], by_lookup: list[int], budget: int,
                        eos: set[int]) -> AsyncIterator[Step]:
    """A run of the target alone (one verifier call for its steps), each step yielded as it
    comes; the caller commits it to `history` before the next. It stops early where a
    lookup round would pay. Beside it: a probe of the drafter when the policy asks for one
    (off the steps' path, but a drafter on the verifier's cores slows them: the run
    measures by how much), and in a greedy request a check of each token against the
    lookup's next one (what a lookup round's first draft there would have got)."""
    policy, drafter, guide = r.policy, r.drafter, r.guide
    # The drafter's drafts offered to the run as it goes, where the policy prices them to
    # pay (a feature drafter's needs the target's features of the run: none); else a probe.
    offer_k = policy.run_model_drafts(r.overlap) if drafter.drafts_by_model and r.verifier.features is None else 0
    offering = _Offering(drafter, history, offer_k + 1, policy, r.stats) if offer_k else None
    probe_k = 0 if offering else policy.beside_run()
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
    if rule is not None and r.verifier.features is None and (lookup_k := policy.run_lookup_drafts(checks)):
        draft_lookup = verifier_pb2.LookupRule(min_match=rule[0], max_match=rule[1], max_drafts=lookup_k)
    check = checks and draft_lookup is None
    expected = by_lookup[:1] if check else []
    try:
        if offering is not None:
            offering.committed()  # its first drafts, after the history the run starts from
        async with contextlib.aclosing(_steps(r, budget, eos, history, beside, draft_forced, draft_lookup,
                                              offering)) as run:
            async for step in run:
                if expected:
                    policy.observe_beside(1, int(step.token == expected[0]), None, lookup=True)
                    r.stats.lookups_checked += 1
                yield step
                if offering is not None:
                    offering.committed()
                by_lookup = _free_drafts(drafter, guide, history, policy.lookup_k_max, forced=not draft_forced)
                if policy.lookup_pays(len(by_lookup)):
                    r.stats.runs_cut += 1
                    return
                expected = by_lookup[:1] if check else []
    finally:
        if beside is not None:
            await beside.settle(history, policy, r.stats)
        if offering is not None:
            await offering.close()


async def _steps(r: _Request, budget: int, eos: set[int], history: list[int], beside: _BesideRun | None,
                 draft_forced: bool, draft_lookup: verifier_pb2.LookupRule | None,
                 offering: _Offering | None = None) -> AsyncIterator[Step]:
    """Up to `policy.run_length(budget)` steps of the target alone, each yielded as it
    comes; each counts as a round without drafts. `beside`: a probe of the drafter beside
    this run (what it costs the run's steps is measured, where it answers before the run
    ends). `draft_forced`, `draft_lookup`: the verifier drafts a constraint's forced
    tokens, and lookup matches, itself; `offering`: the drafter's drafts offered to the run."""
    policy = r.policy
    span = tracing.tracer.start_span("decode", context=r.trace_context)
    steps = r.verifier.decode(list(history), policy.run_length(budget), eos, draft_forced, draft_lookup,
                              offering and offering.queue)
    started = last = first = time.perf_counter()
    tokens, passes = 0, []
    try:
        while True:
            # The span is current only while this coroutine waits for a token (never across a yield).
            attached = otel_context.attach(trace.set_span_in_context(span, r.trace_context))
            try:
                step = await anext(steps)
            except StopAsyncIteration:
                break
            finally:
                otel_context.detach(attached)
            now = time.perf_counter()
            if step.lookup is not None:  # a pass's lookup drafts: what they got, at no drafter's cost
                policy.observe_beside(step.lookup[0], step.lookup[1], None, lookup=True)
            if step.offered is not None:
                r.stats.offered_passes += 1
                r.stats.offered_kept += step.offered[1]
            tokens += 1
            if tokens == 1:
                first = now  # the steps after it are the run's own (the first also opens the call)
            passes.append(step.batch_pass)
            r.stats.step(now - last, step.batch_pass)
            last = now
            yield step
    finally:
        await steps.aclose()
        span.set_attribute("tokens", tokens)
        span.end()
        if tokens:
            # A run beside offers prices neither the target alone's steps nor a probe.
            probed = beside is not None or offering is not None
            policy.observe_run(tokens, last - started, passes, steps_s=last - first, probed=probed,
                               answered=beside is not None and beside.answered(last))
