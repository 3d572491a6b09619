"""The orchestrator's gRPC server: validates a request, pairs it with a drafter replica
and the verifier, runs the speculative rounds and streams the committed output."""

import argparse
import asyncio
import contextlib
import logging
import math
import random
import time
import uuid
from dataclasses import dataclass, field

import grpc

from opentelemetry import trace

from specdec import defaults, flags, grammar, logs, model_files, sampling_params, security, server, tracing
from specdec.api.common.v1 import common_pb2
from specdec.errors import InvalidArgument, Precondition, ServiceError, Unavailable, abort
from specdec.lookup import OutputMemory
from specdec.validation import MAX_DRAFT_TOKENS, MAX_TOP_LOGPROBS
from specdec.api.orchestrator.v1 import orchestrator_pb2 as pb, orchestrator_pb2_grpc
from orchestrator import discovery
from orchestrator.admission import Admission
from orchestrator.autoscale import Autoscaler, Policy
from orchestrator import openai_api, warmup
from orchestrator.openai_api import OpenAIFront
from specdec.metrics import OrchestratorMetrics
from orchestrator.pool import DrafterPool, IncompatiblePair
from orchestrator.kpolicy import AdaptiveK, FixedK, RoundCosts
from orchestrator.links import Deadline, DrafterLink, FeatureFeed, VerifierLink
from orchestrator.rounds import speculate
from orchestrator.stats import Stats
from orchestrator.verifiers import ROUTINGS, VerifierPool
from orchestrator.text import TextStream

log = logging.getLogger("orchestrator")

MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256  # characters; the text stream holds back up to this much
PLACEMENT_WAIT_S = 20.0  # how long ScaleDrafters waits to tell placed replicas from pending ones
MAX_REQUEST_ID = 128
SEEDS = 1 << 64  # GenerateRequest.seed is a uint64
CHAT_ROLES = ("system", "user", "assistant", "tool")  # tool: a function's result, as the chat template shows it


@dataclass
class Limits:
    default_max_new_tokens: int
    max_new_tokens: int
    default_k: int
    max_k: int
    adaptive_max_k: int
    max_concurrent_requests: int
    drafter_timeout_s: float
    verifier_timeout_s: float
    overlap: bool = False
    verifier_retry_s: float = 15.0
    max_queued_requests: int = 256
    lookup_memory_tokens: int = 1 << 16


@dataclass
class Request:
    """A validated GenerateRequest."""
    label: str  # the client's request_id (or one made for it): logs and the Result only
    prompt: list[int]
    max_new_tokens: int
    k: int | None  # None: chosen per round
    params: common_pb2.SamplingParams
    stop: list[str]
    constraint: common_pb2.Constraint | None = None
    guide: grammar.Guide | None = None  # the output's place in its constraint (set by `generate`)
    top_logprobs: int | None = None  # None: no log-probabilities asked for
    prompt_top_logprobs: int | None = None  # None: none of the prompt's asked for


@dataclass
class Flight:
    """A request in flight: its links, its text so far, its statistics (ListRequests shows them)."""
    req: Request
    session_id: str
    drafter: DrafterLink
    verifier: VerifierLink
    text: TextStream
    stats: Stats
    span: trace.Span
    started: float = field(default_factory=time.monotonic)

    @property
    def label(self) -> str:
        return self.req.label


class SampleFailed(Exception):
    """A sample's abort, carried to the call's own task, which aborts the call once."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code, self.details = code, details


class _SampleContext:
    """The call's context as one of its samples sees it: the same deadline and metadata,
    but an abort that ends only the sample. Samples that fail together each aborting the
    call itself raced: the second abort raised at once, ended the call's handler, and the
    cancel that followed cut the first one's status on its way (the client waited for its
    deadline)."""

    def __init__(self, context):
        self._context = context

    def __getattr__(self, name):
        return getattr(self._context, name)

    async def abort(self, code, details=""):
        raise SampleFailed(code, details)


class OrchestratorServicer(orchestrator_pb2_grpc.OrchestratorServiceServicer):
    def __init__(self, limits: Limits, metrics: OrchestratorMetrics | None = None):
        self.limits = limits
        self.metrics = metrics or OrchestratorMetrics()
        self.costs = RoundCosts()  # what rounds cost here, learnt from every request
        self.tokenizer = None
        self.in_flight: dict[str, Flight] = {}  # by session id
        self.admission = Admission(limits.max_concurrent_requests, limits.max_queued_requests)
        self.closing: set[asyncio.Task] = set()
        self.memory: OutputMemory | None = None  # earlier outputs, for every request's lookup drafts
        self.vocab: grammar.Vocabulary | grammar.NoVocabulary | None = None  # the target's tokens for constraints

    def output_memory(self, rule: tuple[int, int] | None) -> OutputMemory | None:
        """The shared memory of outputs under a lookup rule (min, max match), the drafters'
        (None: no rule, or --lookup-memory-tokens 0); a new rule starts an empty one."""
        if rule is None or self.limits.lookup_memory_tokens <= 0:
            return None
        if self.memory is None or (self.memory.min_n, self.memory.max_n) != rule:
            self.memory = OutputMemory(self.limits.lookup_memory_tokens, rule[1], rule[0])
        return self.memory

    def ready(self, tokenizer, verifiers: VerifierPool, pool: DrafterPool) -> None:
        self.tokenizer, self.verifiers, self.pool = tokenizer, verifiers, pool
        self.vocab = grammar.vocabulary(tokenizer, self.info.vocab_size, list(self.info.eos_token_ids))

    @property
    def info(self) -> common_pb2.ModelInfo:
        return self.verifiers.info

    # -- input -------------------------------------------------------------------------

    def parse(self, r: pb.GenerateRequest) -> Request:
        limits = self.limits
        if len(r.request_id) > MAX_REQUEST_ID:
            raise InvalidArgument("request_id", f"longer than {MAX_REQUEST_ID} characters")
        prompt = self.prompt_ids(r)
        max_new = r.max_new_tokens if r.HasField("max_new_tokens") else limits.default_max_new_tokens
        if not (1 if not r.prompt_logprobs else 0) <= max_new <= limits.max_new_tokens:
            raise InvalidArgument("max_new_tokens", f"must be in [1, {limits.max_new_tokens}] (0 with prompt_logprobs), "
                                                    f"got {max_new}")
        if len(prompt) + max_new > self.info.max_positions:
            raise InvalidArgument("max_new_tokens", f"the prompt ({len(prompt)} tokens) plus {max_new} new tokens "
                                                    f"exceeds the model's {self.info.max_positions} positions")
        temperature = r.temperature if r.HasField("temperature") else 0.0
        sampling_params.check_temperature("temperature", temperature)
        top_p = r.top_p if r.HasField("top_p") else 1.0
        if math.isnan(top_p) or not 0.0 < top_p <= 1.0:
            raise InvalidArgument("top_p", f"must be in (0, 1], got {top_p}")
        if r.top_k < 0:
            raise InvalidArgument("top_k", f"must be >= 0, got {r.top_k}")
        k = r.num_speculative_tokens if r.HasField("num_speculative_tokens") else None  # None: adaptive
        if k is not None and not 0 <= k <= limits.max_k:
            raise InvalidArgument("num_speculative_tokens", f"must be in [0, {limits.max_k}], got {k}")
        if len(r.stop) > MAX_STOP_STRINGS or any(not 0 < len(s) <= MAX_STOP_LENGTH for s in r.stop):
            raise InvalidArgument("stop", f"at most {MAX_STOP_STRINGS} non-empty strings of at most "
                                          f"{MAX_STOP_LENGTH} characters")
        seed = r.seed if r.HasField("seed") else random.getrandbits(63)
        params = common_pb2.SamplingParams(
            temperature=temperature, top_k=r.top_k, top_p=top_p, seed=seed, logit_bias=r.logit_bias,
            frequency_penalty=r.frequency_penalty, presence_penalty=r.presence_penalty,
            repetition_penalty=r.repetition_penalty if r.HasField("repetition_penalty") else 1.0,
            output_start=len(prompt))
        if r.HasField("repetition_penalty") and not r.repetition_penalty > 0:
            raise InvalidArgument("repetition_penalty", f"must be in (0, 100], got {r.repetition_penalty}")
        sampling_params.check_penalties(params, vocab_size=self.info.vocab_size)
        if not 0 <= r.top_logprobs <= MAX_TOP_LOGPROBS or (r.top_logprobs and not (r.logprobs or r.prompt_logprobs)):
            raise InvalidArgument("top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], with logprobs or "
                                                  f"prompt_logprobs set; got {r.top_logprobs}")
        return Request(r.request_id or uuid.uuid4().hex, prompt, max_new, k, params, list(r.stop),
                       r.constraint if r.constraint.WhichOneof("kind") else None, None,
                       r.top_logprobs if r.logprobs else None, r.top_logprobs if r.prompt_logprobs else None)

    def prompt_ids(self, r: pb.GenerateRequest) -> list[int]:
        which = r.WhichOneof("prompt")
        if which is None:
            raise InvalidArgument("prompt", "one of text, chat or token_ids is required")
        if which == "text":
            if not r.text:
                raise InvalidArgument("text", "must not be empty")
            return self.tokenizer(r.text)["input_ids"]
        if which == "chat":
            return chat_ids(self.tokenizer, r.chat)
        ids = list(r.token_ids.ids)
        if not ids:
            raise InvalidArgument("token_ids.ids", "must not be empty")
        for i, token in enumerate(ids):
            if not 0 <= token < self.info.vocab_size:
                raise InvalidArgument(f"token_ids.ids[{i}]",
                                      f"token id {token} is outside the vocabulary [0, {self.info.vocab_size})")
        return ids

    # -- generation ----------------------------------------------------------------------

    async def samples(self, request: pb.GenerateRequest, context):
        """`request.n` independent generations of one request, their events interleaved as
        they come, each marked with its sample's index: sample i draws with seed + i (a
        random seed where the request has none), so a seed reproduces them all. Each is a
        request of its own to admission and the services; a failed one ends them all."""
        if not 1 <= request.n <= sampling_params.MAX_SAMPLES:
            await abort(context, InvalidArgument("n", f"must be in [1, {sampling_params.MAX_SAMPLES}], got {request.n}"))
        seed = request.seed if request.HasField("seed") else random.getrandbits(62)
        events: asyncio.Queue = asyncio.Queue()
        sample_context = _SampleContext(context)

        async def one(i: int):
            try:  # whatever fails reaches the loop below, or it would wait for this sample's end forever
                sample = pb.GenerateRequest()
                sample.CopyFrom(request)
                sample.ClearField("n")
                sample.seed = (seed + i) % SEEDS  # a seed near the top wraps: every sample still has one
                async with contextlib.aclosing(self.generate(sample, sample_context)) as stream:
                    async for event in stream:
                        getattr(event, event.WhichOneof("event")).index = i
                        events.put_nowait(event)
            except asyncio.CancelledError:
                raise
            except BaseException as err:  # an abort, or a failure: it ends the call
                events.put_nowait(err)
            else:
                events.put_nowait(None)

        tasks = [asyncio.ensure_future(one(i)) for i in range(request.n)]
        try:
            ended = 0
            while ended < len(tasks):
                event = await events.get()
                if isinstance(event, SampleFailed):
                    await context.abort(event.code, event.details)
                if isinstance(event, BaseException):
                    raise event
                if event is None:
                    ended += 1
                else:
                    yield event
        finally:  # a cancelled call, or a failed sample: the others stop and free what they hold
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def Generate(self, request: pb.GenerateRequest, context):
        # Closed here, in this call, wherever it stops: a cancelled stream stops at its yield,
        # and the request's sessions are released now, not when the generator is collected.
        async with contextlib.aclosing(self.generate(request, context)) as events:
            async for event in events:
                yield event

    async def Complete(self, request: pb.GenerateRequest, context):
        if request.HasField("n") and request.n != 1:
            await abort(context, InvalidArgument("n", f"Complete returns one Result; got {request.n}: stream "
                                                      "several samples through Generate"))
        result = None
        async with contextlib.aclosing(self.generate(request, context)) as events:
            async for event in events:
                if event.HasField("result"):
                    result = event.result
        return result

    async def generate(self, request: pb.GenerateRequest, context):
        if request.HasField("n") and request.n != 1:
            async with contextlib.aclosing(self.samples(request, context)) as events:
                async for event in events:
                    yield event
            return
        req = await self.admit(request, context)
        flight = self.open(req, context)
        outcome, code = "cancelled", "CANCELLED"  # what the finally records unless told otherwise
        try:
            async with contextlib.aclosing(self.stream(flight)) as events:
                async for event in events:
                    yield event
            outcome, code = "ok", "OK"
        except (ServiceError, grpc.aio.AioRpcError) as err:
            status, details = _failure(req.label, err)
            outcome, code = "error", status.name
            await context.abort(status, details)
        finally:
            self.finish(flight, outcome, code)

    async def admit(self, request: pb.GenerateRequest, context) -> Request:
        """The request validated, its constraint compiled, and its turn come (a burst waits here)."""
        try:
            if self.tokenizer is None:
                raise Unavailable("still starting: waiting for the verifier")
            if self.verifiers.problem is not None:
                raise Precondition(self.verifiers.problem)
            req = self.parse(request)
            if req.constraint is not None:  # compiled off the event loop (up to a second), or taken from the cache
                req.guide = await asyncio.to_thread(self.vocab.guide, req.constraint, len(req.prompt))
            await self.admission.enter()
            return req
        except ServiceError as err:
            self.metrics.requests.labels("error", err.code.name).inc()
            await abort(context, err)

    def open(self, req: Request, context) -> Flight:
        """The request's sessions on a drafter and a verifier (links that take a replica at
        their first call), under an identity minted here, never taken from the client: two
        requests with one label (two orchestrators, a reused id) share nothing."""
        session_id = uuid.uuid4().hex
        logs.bind(req.label, session_id)
        log.info("[%s] start: session %s, %d prompt tokens, max_new_tokens=%d, K=%s, temperature=%g",
                 req.label, session_id, len(req.prompt), req.max_new_tokens,
                 "adaptive" if req.k is None else req.k, req.params.temperature)
        self.metrics.prompt_tokens.inc(len(req.prompt))
        stats = Stats(on_round=self.metrics.round)
        deadline = Deadline(context.time_remaining())
        labelled = logs.request_metadata(req.label)
        # A feature drafter drafts from the target's features: the verifier sends them with its tokens.
        feed = FeatureFeed(self.pool.feature_rule) if self.pool.feature_rule is not None else None
        verifier = VerifierLink(self.verifiers, session_id, req.prompt, req.params, stats,
                                self.limits.verifier_timeout_s, retry_s=self.limits.verifier_retry_s,
                                deadline=deadline, metadata=labelled, features=feed, constraint=req.constraint,
                                top_logprobs=req.top_logprobs)
        # Greedy requests only draft from other requests' outputs: a sampled request's tokens
        # depend on its drafts (their distribution does not), and its seed must reproduce them.
        drafter = DrafterLink(self.pool, session_id, req.params, stats, self.limits.drafter_timeout_s,
                              deadline=deadline, metadata=labelled, features=feed,
                              memory=self.output_memory if sampling_params.is_greedy(req.params) else None)
        span = tracing.tracer.start_span("Generate", context=tracing.incoming(context), kind=trace.SpanKind.SERVER,
                                         attributes={"request_id": req.label, "session_id": session_id,
                                                     "prompt_tokens": len(req.prompt)})
        flight = Flight(req, session_id, drafter, verifier, TextStream(self.tokenizer, req.stop), stats, span)
        self.in_flight[session_id] = flight
        return flight

    async def stream(self, flight: Flight):
        """The request's events: its chunks as the rounds commit them, then its Result."""
        req, text, stats, metrics = flight.req, flight.text, flight.stats, self.metrics
        policy = FixedK(req.k) if req.k is not None else AdaptiveK(
            self.costs, self.limits.adaptive_max_k, self.limits.default_k,
            probes_beside_runs=sampling_params.is_greedy(req.params), lookup_k_max=self.limits.max_k)
        # The prompt's own log-probabilities: one prefill, before (and whatever) the rounds.
        scored = await flight.verifier.score(req.prompt_top_logprobs) if req.prompt_top_logprobs is not None else []
        rounds = speculate(req.prompt, req.max_new_tokens, policy, set(self.info.eos_token_ids), flight.drafter,
                           flight.verifier, stats, overlap=self.limits.overlap,
                           trace_context=trace.set_span_in_context(flight.span), guide=req.guide) \
            if req.max_new_tokens else _nothing()
        last = None
        async with contextlib.aclosing(rounds):  # a stop string ends it early: stop its drafting too
            async for commit in rounds:
                ids, delta = text.add(commit.tokens)
                last = metrics.tokens(flight.started, last, len(ids))
                yield pb.GenerateResponse(chunk=pb.Chunk(token_ids=ids, text=delta, logprobs=commit.logprobs[:len(ids)]))
                if text.stop_hit is not None:
                    break
        tail = text.finish()
        if tail:
            yield pb.GenerateResponse(chunk=pb.Chunk(text=tail))
        yield pb.GenerateResponse(result=self.result(req, text, stats, scored))
        memory = self.output_memory(self.pool.lookup_rule)
        if memory is not None:  # with the prompt's end, which its first tokens follow
            memory.add(req.prompt[-memory.max_n:] + text.ids)
        metrics.e2e.observe(time.monotonic() - flight.started)
        log.info("[%s] done: %d tokens in %s", req.label, len(text.ids), stats.describe())
        if req.k is None:
            log.debug("[%s] costs: %s", req.label, self.costs.describe())

    def finish(self, flight: Flight, outcome: str, code: str) -> None:
        """The request's end, however it came: recorded, and both sessions released (in the
        background: a client that cancelled does not wait for it)."""
        self.metrics.finished(outcome, code, flight.stats)
        flight.span.set_attributes({"outcome": outcome, "code": code, "completion_tokens": len(flight.text.ids)})
        flight.span.end()
        del self.in_flight[flight.session_id]
        self.admission.leave()
        task = asyncio.ensure_future(self.close_sessions(flight.req.label, flight.drafter, flight.verifier,
                                                         flight.req.prompt + flight.text.ids))
        self.closing.add(task)
        task.add_done_callback(self.closing.discard)

    async def drained(self, wait_s: float = 10.0) -> None:
        """After the last call: the sessions those calls left on the services are released
        before the process goes (else they would wait for the services' idle timeout)."""
        # A request cut at the end (an HTTP handler the front cancelled) may not have run
        # its `finish` yet, which starts its sessions' close: wait for it first.
        deadline = time.monotonic() + wait_s
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        if self.closing:
            await asyncio.wait(set(self.closing), timeout=max(0.1, deadline - time.monotonic()))

    async def close_sessions(self, label: str, drafter: DrafterLink, verifier: VerifierLink,
                             history: list[int]) -> None:
        for link, close in ((drafter, drafter.close), (verifier, lambda: verifier.close(history))):
            try:
                await close()
            except grpc.aio.AioRpcError as err:
                log.warning("[%s] closing session %s failed: %s (the idle timeout will release it)",
                            label, link.session_id, err.code().name)

    def result(self, req: Request, text: TextStream, stats: Stats, scored=()) -> pb.Result:
        if text.stop_hit is not None or (text.ids and text.ids[-1] in self.info.eos_token_ids):
            finish = pb.FINISH_REASON_STOP
        elif req.guide is not None and req.guide.sync(req.prompt + text.ids) and req.guide.dead:
            finish = pb.FINISH_REASON_CONSTRAINT
        else:
            finish = pb.FINISH_REASON_LENGTH
        return pb.Result(
            request_id=req.label, token_ids=text.ids, text=text.text, finish_reason=finish, prompt_logprobs=scored,
            stop_sequence=text.stop_hit or "",
            usage=pb.Usage(prompt_tokens=len(req.prompt), completion_tokens=len(text.ids)),
            stats=stats.message(),
        )


class AdminServicer(orchestrator_pb2_grpc.OrchestratorAdminServiceServicer):
    def __init__(self, requests: OrchestratorServicer):
        self.requests = requests
        self.pool: DrafterPool | None = None
        self.source = None
        self.autoscaler: Autoscaler | None = None
        self.verifiers: VerifierPool | None = None
        self.verifier_source = None
        self.verifier_autoscaler: Autoscaler | None = None

    def ready(self, pool: DrafterPool, source, autoscaler: "Autoscaler | None", verifiers: VerifierPool,
              verifier_source, verifier_autoscaler: "Autoscaler | None" = None) -> None:
        self.pool, self.source, self.autoscaler = pool, source, autoscaler
        self.verifiers, self.verifier_source, self.verifier_autoscaler = verifiers, verifier_source, verifier_autoscaler

    async def ScaleDrafters(self, request: pb.ScaleDraftersRequest, context):
        return await self._scale(context, self.source, "drafter", request.replicas, 0)

    async def ScaleVerifiers(self, request: pb.ScaleVerifiersRequest, context):
        return await self._scale(context, self.verifier_source, "verifier", request.replicas, 1)

    async def _scale(self, context, source, what: str, replicas: int, fewest: int) -> pb.ScaleDraftersResponse:
        if self.pool is None:
            await abort(context, Unavailable("still starting"))
        if not hasattr(source, "scale"):
            await abort(context, Precondition(f"{what}s come from a {source.kind} set; scale them there "
                                              "(Ray deployments only)"))
        if replicas < fewest:
            await abort(context, InvalidArgument("replicas", f"must be >= {fewest}, got {replicas}"))
        log.info("scaling %ss to %d (admin request)", what, replicas)
        replicas = await source.scale(replicas)
        _, starting, pending = await source.placement(PLACEMENT_WAIT_S)
        detail = ""
        if pending:
            detail = (f"{pending} of {replicas} {what} replicas are not placed after {PLACEMENT_WAIT_S:.0f} s: "
                      f"the cluster has no room for them now ({source.resources()})")
            log.warning("%s", detail)
        return pb.ScaleDraftersResponse(replicas=replicas, pending=pending, starting=starting, detail=detail)

    async def ListVerifiers(self, request, context):
        if self.verifiers is None:
            await abort(context, Unavailable("still starting"))
        now = time.monotonic()
        return pb.ListVerifiersResponse(
            replicas=[pb.VerifierReplica(address=r.address, sessions=r.sessions, healthy=r.usable(now),
                                         free_kv_blocks=r.free_blocks, waiting_sessions=r.waiting,
                                         pass_seconds=r.pass_s, routed_by_prefix=r.routed["prefix"],
                                         routed_by_load=r.routed["load"], moved_away=r.moved_away,
                                         in_set=not r.removed)
                      for r in self.verifiers.replicas.values()],
            source=self.verifier_source.kind,
            last_scaling_decision=self.verifier_autoscaler.last_decision if self.verifier_autoscaler else "")

    async def ListDrafters(self, request, context):
        if self.pool is None:
            await abort(context, Unavailable("still starting"))
        now = time.monotonic()
        serving, starting, pending = await self.source.counts() if hasattr(self.source, "counts") else (0, 0, 0)
        # A replica serving but not in the pool yet (it joins at the next refresh) is starting too.
        starting = max(0, serving + starting - len(self.pool.replicas))
        return pb.ListDraftersResponse(
            replicas=[pb.DrafterReplica(address=r.address, sessions=r.sessions, healthy=r.healthy(now))
                      for r in self.pool.replicas.values()],
            source=self.source.kind, starting=starting, pending=pending,
            last_scaling_decision=self.autoscaler.last_decision if self.autoscaler else "")


    async def ListRequests(self, request, context):
        now = time.monotonic()
        return pb.ListRequestsResponse(requests=[
            pb.RequestInFlight(request_id=f.label, session_id=f.session_id,
                               drafter=f.drafter.replica.address if f.drafter.replica else "",
                               verifier=f.verifier.replica.address if f.verifier.replica else "",
                               generated_tokens=len(f.text.ids), elapsed_seconds=now - f.started)
            for f in list(self.requests.in_flight.values())])


def replica_source(addresses: str, dns: str, ray_controller: str, args):
    if ray_controller:
        return discovery.RaySource(ray_controller, args.ray_namespace, args.ray_address)
    if dns:
        return discovery.DnsSource(dns)
    return discovery.StaticSource([a.strip() for a in addresses.split(",") if a.strip()])


def autoscaler(args, pool: DrafterPool, source, metrics: OrchestratorMetrics | None = None) -> "Autoscaler | None":
    if not args.autoscale:
        return None
    if not hasattr(source, "scale"):
        raise SystemExit("--autoscale needs drafters launched through Ray (--drafter-ray)")
    policy = Policy(args.autoscale_min_replicas, args.autoscale_max_replicas, args.autoscale_target_sessions,
                    args.autoscale_cooldown)
    return Autoscaler(policy, pool, source, metrics=metrics)


def verifier_autoscaler(args, pool: VerifierPool, source, metrics: OrchestratorMetrics | None = None
                        ) -> "Autoscaler | None":
    if not args.autoscale_verifiers:
        return None
    if not hasattr(source, "scale"):
        raise SystemExit("--autoscale-verifiers needs verifiers launched through Ray (--verifier-ray)")
    policy = Policy(max(1, args.autoscale_verifiers_min_replicas), args.autoscale_verifiers_max_replicas,
                    args.autoscale_verifiers_target_sessions, args.autoscale_cooldown)
    return Autoscaler(policy, pool, source, metrics=metrics, what="verifiers")


async def _nothing():
    """The rounds of a request for no new tokens (its prompt's log-probabilities alone)."""
    return
    yield


def _failure(label: str, err: ServiceError | grpc.aio.AioRpcError) -> tuple[grpc.StatusCode, str]:
    """The status a request that failed as it ran ends with."""
    if isinstance(err, ServiceError):  # the request's own fault, found as it ran (a grammar over its bounds)
        log.info("[%s] refused while running: %s", label, err)
        return err.code, str(err)
    if err.code() == grpc.StatusCode.INVALID_ARGUMENT and not (err.details() or "").startswith(CLIENTS_FIELDS):
        # A field this orchestrator wrote (drafts, their q, positions): the fault is ours, not the client's.
        log.error("[%s] a service refused a request of ours (a fault of ours, not the client's): %s", label,
                  err.details())
        return grpc.StatusCode.INTERNAL, f"internal error: a service refused a request of ours: {err.details()}"
    log.error("[%s] a service call failed: %s %s", label, err.code().name, err.details())
    # Bad input, a full verifier, a passed deadline and a service's own failure keep their
    # codes: the client should not retry the first, should back off on the second, knows
    # the third; anything else is the retriable UNAVAILABLE.
    passed_on = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                 grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL)
    status = err.code() if err.code() in passed_on else grpc.StatusCode.UNAVAILABLE
    return status, f"a service call failed: {err.details()}"


# The fields of a service call that carry the client's own input as it sent it, which only
# the services can judge (a grammar past its bounds as it runs): a refusal of one of these is
# the client's; of any other field, ours.
CLIENTS_FIELDS = ("constraint",)


def chat_ids(tokenizer, chat: pb.Chat) -> list[int]:
    """The messages rendered by the target's chat template, ending with the assistant's turn."""
    if not chat.messages:
        raise InvalidArgument("chat.messages", "must not be empty")
    for i, m in enumerate(chat.messages):
        if m.role not in CHAT_ROLES:
            raise InvalidArgument(f"chat.messages[{i}].role", f"must be one of {CHAT_ROLES}, got {m.role!r}")
    if not tokenizer.chat_template:
        raise InvalidArgument("chat", "the target model has no chat template; send text")
    try:
        rendered = tokenizer.apply_chat_template(
            [{"role": m.role, "content": m.content} for m in chat.messages],
            add_generation_prompt=True, tokenize=False)
    except Exception as err:  # the template's own checks (roles that must alternate, ...)
        raise InvalidArgument("chat.messages", f"the target's chat template refused them: {err}") from err
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec-orchestrator", description=__doc__)
    server.add_server_flags(parser, "SPECDEC_ORCHESTRATOR", default_port=50051)
    add = flags.add
    add(parser, "--admin-host", env="SPECDEC_ORCHESTRATOR_ADMIN_HOST", default="127.0.0.1",
        help="address the admin service (scaling, drafter and request listings) binds; loopback keeps it "
             "off the network")
    add(parser, "--admin-port", env="SPECDEC_ORCHESTRATOR_ADMIN_PORT", type=int, default=50050,
        help="the admin service's port (0: any free port)")
    add(parser, "--http-port", env="SPECDEC_ORCHESTRATOR_HTTP_PORT", type=int, default=0,
        help="port of the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models), on "
             "--host, with the same TLS and tokens as gRPC; 0: none")
    add(parser, "--served-model-name", env="SPECDEC_SERVED_MODEL_NAME", default="",
        help="the model id the HTTP API lists and expects (default: the verifier's model name)")
    add(parser, "--auth-token-file", env="SPECDEC_ORCHESTRATOR_AUTH_TOKEN_FILE", default="",
        help="file of bearer tokens, one per line: Generate, Complete and the admin service then need "
             "'authorization: Bearer <token>' (health and reflection stay open)")
    security.add_client_flags(parser, "SPECDEC_ORCHESTRATOR")
    _replica_flags(parser)
    _speculation_flags(parser)
    return parser


def _replica_flags(parser) -> None:
    """Where the verifier and drafter replicas are, and how they scale."""
    add = flags.add
    add(parser, "--verifiers", "--verifier", env="SPECDEC_VERIFIER_ADDRESSES", default="127.0.0.1:50053",
        help="comma-separated verifier replica host:port list (each request keeps one replica for its life; "
             "see orchestrator/verifiers.py)")
    add(parser, "--verifier-dns", env="SPECDEC_VERIFIER_DNS", default="",
        help="host:port of a headless Service whose addresses are the verifier replicas; replaces --verifiers")
    add(parser, "--verifier-ray", env="SPECDEC_VERIFIER_RAY", default="",
        help="name of the Ray verifier controller actor (deploy/ray); replaces --verifiers")
    add(parser, "--verifier-route-slack", env="SPECDEC_VERIFIER_ROUTE_SLACK", type=int, default=4,
        help="sessions a verifier replica may carry above the least-loaded one and still take a request whose "
             "prompt prefix it holds (0: by load alone, ties to the prefix)")
    add(parser, "--verifier-routing", env="SPECDEC_VERIFIER_ROUTING", default="prefix", choices=ROUTINGS,
        help="how a request's verifier replica is chosen: prefix (its cached prompt prefix within the slack, "
             "else the least loaded) or round-robin")
    add(parser, "--drafters", env="SPECDEC_DRAFTER_ADDRESSES", default="127.0.0.1:50052",
        help="comma-separated drafter replica host:port list (empty: the target alone)")
    add(parser, "--drafter-dns", env="SPECDEC_DRAFTER_DNS", default="",
        help="host:port of a headless Service whose addresses are the drafter replicas; replaces --drafters")
    add(parser, "--drafter-ray", env="SPECDEC_DRAFTER_RAY", default="",
        help="name of the Ray drafter controller actor (deploy/ray); replaces --drafters")
    add(parser, "--ray-address", env="SPECDEC_RAY_ADDRESS", default="auto",
        help="Ray cluster for --drafter-ray and --verifier-ray")
    add(parser, "--ray-namespace", env="SPECDEC_RAY_NAMESPACE", default="specdec", help="Ray namespace")
    add(parser, "--draft-tokenizer", env="SPECDEC_DRAFT_TOKENIZER", default="",
        help="for drafters whose model has another vocabulary than the target's: their tokenizer (a directory, hub "
             "id or .gguf file; default: the drafter's model name, as it reports it); its drafts are carried "
             "over to the target's tokens")
    add(parser, "--drafter-refresh-interval", env="SPECDEC_DRAFTER_REFRESH_INTERVAL", type=float, default=5.0,
        help="seconds between two lookups of the drafter and verifier sets (DNS or Ray), and between two checks "
             "of each verifier's model")
    add(parser, "--autoscale", env="SPECDEC_AUTOSCALE", type=bool, default=False,
        help="size the Ray drafter pool from the measured load")
    add(parser, "--autoscale-min-replicas", env="SPECDEC_AUTOSCALE_MIN_REPLICAS", type=int, default=1,
        help="fewest drafters the autoscaler keeps")
    add(parser, "--autoscale-max-replicas", env="SPECDEC_AUTOSCALE_MAX_REPLICAS", type=int, default=4,
        help="most drafters the autoscaler starts")
    add(parser, "--autoscale-target-sessions", env="SPECDEC_AUTOSCALE_TARGET_SESSIONS", type=float, default=4.0,
        help="requests per drafter replica the autoscaler sizes the pool for")
    add(parser, "--autoscale-verifiers", env="SPECDEC_AUTOSCALE_VERIFIERS", type=bool, default=False,
        help="size the Ray verifier pool from the measured load (sessions, and sessions waiting for KV memory)")
    add(parser, "--autoscale-verifiers-min-replicas", env="SPECDEC_AUTOSCALE_VERIFIERS_MIN_REPLICAS", type=int,
        default=1, help="fewest verifiers the autoscaler keeps (at least 1)")
    add(parser, "--autoscale-verifiers-max-replicas", env="SPECDEC_AUTOSCALE_VERIFIERS_MAX_REPLICAS", type=int,
        default=4, help="most verifiers the autoscaler starts")
    add(parser, "--autoscale-verifiers-target-sessions", env="SPECDEC_AUTOSCALE_VERIFIERS_TARGET_SESSIONS",
        type=float, default=16.0, help="requests per verifier replica the autoscaler sizes the pool for")
    add(parser, "--autoscale-cooldown", env="SPECDEC_AUTOSCALE_COOLDOWN", type=float, default=30.0,
        help="seconds between two scaling decisions")


def _speculation_flags(parser) -> None:
    """The tokenizer, speculation, limits and timeouts."""
    add = flags.add
    add(parser, "--tokenizer", env="SPECDEC_ORCHESTRATOR_TOKENIZER", default=defaults.DEFAULT_TARGET,
        help="the target's tokenizer (a model directory, hub id or .gguf file)")
    add(parser, "--num-speculative-tokens", env="SPECDEC_NUM_SPECULATIVE_TOKENS", type=int, default=4,
        help="the long K a fresh deployment tries once K = 1 has paid; a request's K then adapts per round")
    add(parser, "--adaptive-max-speculative-tokens", env="SPECDEC_ADAPTIVE_MAX_SPECULATIVE_TOKENS", type=int,
        default=8, help="largest K the per-round choice considers for the draft model (a prompt-lookup round may "
                        "draft up to --max-speculative-tokens)")
    add(parser, "--overlap", env="SPECDEC_OVERLAP", type=bool, default=False,
        help="draft beside the verifier's passes: each round's successor while the round is verified, and "
             "drafts offered to greedy runs of the target alone as they go (pays when the drafters do not share "
             "the verifier's cores and their drafts pass often)")
    add(parser, "--warm-up", env="SPECDEC_WARM_UP", type=bool, default=True,
        help="before reporting ready, measure what a step of the target alone and rounds of 1 and "
             "--num-speculative-tokens drafts cost (about 40 tokens after a built-in text), so that the first "
             "requests do not pay for learning it")
    add(parser, "--lookup-memory-tokens", env="SPECDEC_LOOKUP_MEMORY_TOKENS", type=int, default=1 << 16,
        help="tokens of recent outputs kept for lookup drafts (a request without a match in its own history "
             "drafts from what followed the same tokens in an earlier output; the oldest leave first; 0: off)")
    add(parser, "--max-speculative-tokens", env="SPECDEC_MAX_SPECULATIVE_TOKENS", type=int, default=16,
        help="largest K a request may ask for, and that a prompt-lookup round drafts")
    add(parser, "--default-max-new-tokens", env="SPECDEC_DEFAULT_MAX_NEW_TOKENS", type=int, default=256,
        help="max_new_tokens of a request that sets none")
    add(parser, "--max-new-tokens-limit", env="SPECDEC_MAX_NEW_TOKENS_LIMIT", type=int, default=4096,
        help="largest max_new_tokens a request may ask for")
    add(parser, "--max-concurrent-requests", env="SPECDEC_MAX_CONCURRENT_REQUESTS", type=int, default=64,
        help="requests generating at once; more wait their turn (first come, first served)")
    add(parser, "--max-queued-requests", env="SPECDEC_MAX_QUEUED_REQUESTS", type=int, default=256,
        help="requests waiting for their turn before RESOURCE_EXHAUSTED (a waiting call's deadline still "
             "bounds its wait); see orchestrator/admission.py")
    add(parser, "--drafter-timeout", env="SPECDEC_DRAFTER_TIMEOUT", type=float, default=10.0,
        help="seconds one Propose call may take before the drafter counts as failed")
    add(parser, "--verifier-timeout", env="SPECDEC_VERIFIER_TIMEOUT", type=float, default=60.0,
        help="seconds one Verify call may take")
    add(parser, "--verifier-retry-timeout", env="SPECDEC_VERIFIER_RETRY_TIMEOUT", type=float, default=15.0,
        help="seconds a request waits for an unreachable verifier to come back (a restart) before it fails "
             "UNAVAILABLE; the client's deadline still bounds it")
    add(parser, "--startup-timeout", env="SPECDEC_STARTUP_TIMEOUT", type=float, default=600.0,
        help="seconds to wait for the verifier and drafters to load")


def check_limits(args) -> None:
    """Refuses, at start, limits the services would refuse at every request."""
    for flag, k in (("--max-speculative-tokens", args.max_speculative_tokens),
                    ("--adaptive-max-speculative-tokens", args.adaptive_max_speculative_tokens),
                    ("--num-speculative-tokens", args.num_speculative_tokens)):
        if not 0 <= k <= MAX_DRAFT_TOKENS:
            raise SystemExit(f"specdec-orchestrator: {flag} must be in [0, {MAX_DRAFT_TOKENS}] (the drafts a "
                             f"verifier checks in one call), got {k}")


async def connect_verifiers(args, tokenizer, credentials, options, metrics):
    """The verifier pool, once a replica's model is checked; -> (pool, its source, the model)."""
    source = replica_source(args.verifiers, args.verifier_dns, args.verifier_ray, args)
    addresses = await source.addresses()
    waited = time.monotonic() + args.startup_timeout
    while not addresses and time.monotonic() < waited:  # replicas still loading (Ray, DNS)
        await asyncio.sleep(min(1.0, args.drafter_refresh_interval))
        addresses = await source.addresses()
    verifiers = VerifierPool(addresses, model_files.vocab_fingerprint(tokenizer), args.tokenizer, credentials,
                             options, slack=args.verifier_route_slack, refresh_s=args.drafter_refresh_interval,
                             metrics=metrics, routing=args.verifier_routing)
    log.info("waiting for a verifier (%s): %s", source.kind, ", ".join(addresses) or "none yet")
    return verifiers, source, await verifiers.start(args.startup_timeout)


async def connect_drafters(args, info, tokenizer, credentials, options):
    """The drafter pool, each replica checked against the target where it answers;
    -> (pool, its source)."""
    source = replica_source(args.drafters, args.drafter_dns, args.drafter_ray, args)
    pool = DrafterPool(await source.addresses(), info.vocab_fingerprint, info.model_name, credentials=credentials,
                       options=options, target_layers=info.num_layers, target_hidden=info.hidden_size,
                       tokenizer=tokenizer, draft_tokenizer=args.draft_tokenizer)
    for replica in pool.replicas.values():
        try:
            await pool.check(replica, wait_s=args.startup_timeout)
            log.info("drafter %s is compatible with the target %s", replica.address, info.model_name)
        except grpc.aio.AioRpcError as err:
            log.warning("drafter %s not reachable yet (%s); will retry", replica.address, err.code().name)
    return pool, source


def gauge(metrics: OrchestratorMetrics, servicer: OrchestratorServicer, pool: DrafterPool) -> None:
    metrics.in_flight.set_function(lambda: len(servicer.in_flight))
    metrics.lookup_memory.set_function(lambda: servicer.memory.held if servicer.memory else 0)
    for healthy in (True, False):
        metrics.replicas.labels(str(healthy).lower()).set_function(
            lambda healthy=healthy: sum(r.healthy(time.monotonic()) == healthy for r in list(pool.replicas.values())))


def background(args, servicer: OrchestratorServicer, admin: AdminServicer) -> list:
    """What runs beside the calls once loaded: discovery, the autoscalers, the HTTP front."""
    async def follow(source, pool, *what):
        if source.kind != "static":
            await discovery.follow(source, pool, args.drafter_refresh_interval, *what)

    async def run(scaler):
        if scaler is not None:
            await scaler.run()

    async def http():
        if not args.http_port:
            return
        tokens = security.load_tokens(args.auth_token_file) if args.auth_token_file else []
        front = OpenAIFront(servicer, args.served_model_name or servicer.info.model_name, tokens)
        runner = await openai_api.serve(front.app(), args.host, args.http_port, security.ssl_context(args),
                                        args.shutdown_grace)
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()

    return [lambda: follow(admin.verifier_source, admin.verifiers, "verifiers"),
            lambda: follow(admin.source, admin.pool), lambda: run(admin.autoscaler),
            lambda: run(admin.verifier_autoscaler), http]


async def serve(args, on_listen=None) -> None:
    check_limits(args)
    limits = Limits(args.default_max_new_tokens, args.max_new_tokens_limit, args.num_speculative_tokens,
                    args.max_speculative_tokens, args.adaptive_max_speculative_tokens, args.max_concurrent_requests,
                    args.drafter_timeout, args.verifier_timeout, args.overlap, args.verifier_retry_timeout,
                    args.max_queued_requests, args.lookup_memory_tokens)
    tracing.setup("orchestrator", args.otlp_endpoint)
    metrics = OrchestratorMetrics()
    metrics.serve(args.host, args.metrics_port)
    servicer = OrchestratorServicer(limits, metrics)
    admin = AdminServicer(servicer)

    async def load():
        tokenizer = await asyncio.to_thread(model_files.load_tokenizer, args.tokenizer)
        credentials, options = security.channel_credentials(args), security.channel_options(args)
        verifiers, verifier_source, info = await connect_verifiers(args, tokenizer, credentials, options, metrics)
        pool, source = await connect_drafters(args, info, tokenizer, credentials, options)
        if args.warm_up:
            await warmup.measure_costs(servicer.costs, verifiers, pool, tokenizer, set(info.eos_token_ids),
                                       min(limits.default_k, limits.adaptive_max_k), limits.drafter_timeout_s,
                                       limits.verifier_timeout_s)
        servicer.ready(tokenizer, verifiers, pool)
        gauge(metrics, servicer, pool)
        admin.ready(pool, source, autoscaler(args, pool, source, metrics), verifiers, verifier_source,
                    verifier_autoscaler(args, verifiers, verifier_source, metrics))
        log.info("target %s (vocabulary %d), %d verifier replica(s) (%s), %d drafter replica(s) (%s)",
                 info.model_name, info.vocab_size, len(verifiers.replicas), verifier_source.kind,
                 len(pool.replicas), source.kind)

    await server.serve(
        name="orchestrator", host=args.host, port=args.port,
        service_names=[pb.DESCRIPTOR.services_by_name["OrchestratorService"].full_name],
        register=lambda s: orchestrator_pb2_grpc.add_OrchestratorServiceServicer_to_server(servicer, s),
        admin=server.Listener(
            args.admin_host, args.admin_port, [pb.DESCRIPTOR.services_by_name["OrchestratorAdminService"].full_name],
            lambda s: orchestrator_pb2_grpc.add_OrchestratorAdminServiceServicer_to_server(admin, s)),
        load=load,
        on_listen=on_listen,
        grace_s=args.shutdown_grace,
        background=background(args, servicer, admin),
        security=server.security(args, args.auth_token_file),
        serving=lambda: servicer.tokenizer is None or servicer.verifiers.problem is None,
        drained=servicer.drained,
    )


def main() -> None:
    args = build_parser().parse_args()
    flags.setup_logging(args.log_level, "orchestrator", args.log_format)
    server.refuse_taken_ports("orchestrator", args)
    try:
        asyncio.run(serve(args))
    except IncompatiblePair as err:
        log.error("refusing to start: %s", err)
        raise SystemExit(2)
