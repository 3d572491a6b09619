"""The verifier's gRPC server: sessions, each a token sequence with its keys and values
in the target's KV pool, and one forward pass per round over the new tokens plus the
drafts, batched with the rounds of the other sessions that are ready at the same time."""

import argparse
import asyncio
import contextlib
import logging
import math

import torch

from specdec import flags, grammar, logs, sampling_params, server, session_service, tracing
from specdec.runtime import modeling, serving
from specdec.errors import InvalidArgument, ServiceError, abort
from specdec.metrics import EngineMetrics
from specdec.sessions import SessionStore
from specdec.validation import MAX_DRAFT_TOKENS, MAX_TOP_LOGPROBS, check_length, check_token_ids
from specdec.api.verifier.v1 import verifier_pb2, verifier_pb2_grpc
from verifier_service.passes import score, verify
from verifier_service.runs import Offers, decode
from verifier_service.feature_cache import FeatureCache

log = logging.getLogger("verifier")

MAX_STOP_TOKENS = 64
MAX_DECODE_TOKENS = 1024
MAX_FEATURE_LAYERS = 8
MAX_LOOKUP_MATCH = 64


def batch_pass(done) -> verifier_pb2.BatchPass:
    return verifier_pb2.BatchPass(rows=done.rows, tokens=done.tokens, seconds=done.seconds,
                                  free_kv_blocks=done.free_blocks, waiting_sessions=done.waiting)




def check_top_logprobs(top: int) -> None:
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise InvalidArgument("top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {top}")


def check_lookup_rule(request: verifier_pb2.DecodeRequest) -> None:
    if not request.HasField("draft_lookup"):
        return
    rule = request.draft_lookup
    if not 1 <= rule.max_match <= MAX_LOOKUP_MATCH:
        raise InvalidArgument("draft_lookup.max_match", f"must be in [1, {MAX_LOOKUP_MATCH}], got {rule.max_match}")
    if not 1 <= rule.min_match <= rule.max_match:
        raise InvalidArgument("draft_lookup.min_match", f"must be in [1, max_match], got {rule.min_match}")
    if not 1 <= rule.max_drafts <= MAX_DRAFT_TOKENS:
        raise InvalidArgument("draft_lookup.max_drafts", f"must be in [1, {MAX_DRAFT_TOKENS}], got {rule.max_drafts}")
    if request.features.layers:
        raise InvalidArgument("draft_lookup", "not with features (a feature drafter's run drafts nothing)")


def check_draft_probs(probs, tokens, vocab_size: int, name: str = "draft_probs") -> None:
    """Each draft's q (`name`), where there are any: one per draft, a distribution that
    gives its draft some probability."""
    if not probs:
        return
    if len(probs) != len(tokens):
        raise InvalidArgument(name, f"has {len(probs)} entries for {len(tokens)} draft tokens")
    for i, (dist, token) in enumerate(zip(probs, tokens)):
        field = f"{name}[{i}]"
        if not dist.token_ids or len(dist.token_ids) != len(dist.probs):
            raise InvalidArgument(field, "needs as many probs as token_ids, at least one")
        check_token_ids(f"{field}.token_ids", dist.token_ids, vocab_size)
        if len(set(dist.token_ids)) != len(dist.token_ids):
            raise InvalidArgument(f"{field}.token_ids", "lists a token id more than once")
        if any(not math.isfinite(x) or x < 0 for x in dist.probs):
            raise InvalidArgument(f"{field}.probs", "must be finite and >= 0")
        if abs(sum(dist.probs) - 1.0) > 1e-3:
            raise InvalidArgument(f"{field}.probs", f"must sum to 1, got {sum(dist.probs):.6f}")
        if not any(t == token and x > 0 for t, x in zip(dist.token_ids, dist.probs)):
            raise InvalidArgument(field, f"gives draft token {token} no probability")


def check_offer(offer: verifier_pb2.DraftOffer, vocab_size: int, max_positions: int) -> None:
    if not 1 <= offer.position < max_positions:
        raise InvalidArgument("offer.position", f"must be in [1, {max_positions - 1}], got {offer.position}")
    if not 1 <= len(offer.tokens) <= MAX_DRAFT_TOKENS:
        raise InvalidArgument("offer.tokens", f"must hold 1 to {MAX_DRAFT_TOKENS} tokens, got {len(offer.tokens)}")
    check_token_ids("offer.tokens", offer.tokens, vocab_size)
    check_draft_probs(offer.probs, offer.tokens, vocab_size, "offer.probs")


class VerifierServicer(session_service.SessionServicer, verifier_pb2_grpc.VerifierServiceServicer):
    pb, pb_grpc, service, name = verifier_pb2, verifier_pb2_grpc, "VerifierService", "verifier"
    vocab: grammar.Vocabulary | grammar.NoVocabulary | None = None  # the target's tokens as constraints match them
    feature_cache: FeatureCache | None = None  # prompt blocks' features, for feature drafters' requests

    async def guide(self, request, session) -> grammar.Guide | None:
        """The session's constraint: a call with start = 0 sets it (compiled off the event
        loop: a large grammar takes milliseconds), the others keep it. A call with start = 0
        begins a new output: what its in-run lookup drafts kept is not known yet."""
        if request.start != 0:
            return session.guide
        session.lookup_passed = session.lookup_index = None
        if request.constraint.WhichOneof("kind") is None:
            session.guide = None
            return None
        if not 1 <= request.constraint_start <= len(request.new_tokens):
            raise InvalidArgument("constraint_start", f"must be in [1, {len(request.new_tokens)}], "
                                                      f"got {request.constraint_start}")
        session.guide = await asyncio.to_thread(self.vocab.guide, request.constraint, request.constraint_start)
        return session.guide

    def check_features(self, features: verifier_pb2.FeatureRequest, committed: int) -> None:
        """INVALID_ARGUMENT naming the field unless the layers exist and the first position
        is a committed one."""
        layers = list(features.layers)
        if not layers:
            return
        if len(layers) > MAX_FEATURE_LAYERS or len(set(layers)) != len(layers):
            raise InvalidArgument("features.layers", f"at most {MAX_FEATURE_LAYERS} distinct layers, got {layers}")
        if not all(0 <= layer <= self.info.num_layers for layer in layers):
            raise InvalidArgument("features.layers", f"must be in [0, {self.info.num_layers}], got {layers}")
        if not 0 <= features.first_position < committed:
            raise InvalidArgument("features.first_position", f"must be in [0, {committed - 1}] (a committed "
                                                             f"position), got {features.first_position}")

    async def Verify(self, request: verifier_pb2.VerifyRequest, context):
        logs.bind_from(context, request.session_id)
        try:
            self.check_ready()
            if len(request.draft_tokens) > MAX_DRAFT_TOKENS:
                raise InvalidArgument("draft_tokens", f"at most {MAX_DRAFT_TOKENS}, got {len(request.draft_tokens)}")
            sampling_params.validate(request.sampling, vocab_size=self.info.vocab_size)
            check_top_logprobs(request.top_logprobs)
            check_token_ids("new_tokens", request.new_tokens, self.info.vocab_size)
            check_token_ids("draft_tokens", request.draft_tokens, self.info.vocab_size)
            check_draft_probs(request.draft_probs, request.draft_tokens, self.info.vocab_size)
            if request.start == 0 and not request.new_tokens:
                raise InvalidArgument("new_tokens", "must not be empty when start is 0")
            check_length("draft_tokens", request.start + len(request.new_tokens) + len(request.draft_tokens) + 1,
                         self.info)
            self.check_features(request.features, request.start + len(request.new_tokens))
            session = self.store.get(request.session_id, request.start)
            with tracing.server_span("verifier.Verify", context, session_id=request.session_id,
                                     new_tokens=len(request.new_tokens), drafts=len(request.draft_tokens)) as span:
                async with self.model_work(session) as seq:
                    a, t, done, features, logprobs = await verify(seq, request, await self.guide(request, session),
                                                                   self.feature_cache, session)
                span.set_attributes({"accepted": a, "batch_rows": done.rows})
            return verifier_pb2.VerifyResponse(num_accepted=a, next_token=t, batch_pass=batch_pass(done),
                                               features=features, logprobs=logprobs)
        except ServiceError as err:
            await abort(context, err)


    async def Score(self, request: verifier_pb2.ScoreRequest, context):
        logs.bind_from(context, request.session_id)
        try:
            self.check_ready()
            check_top_logprobs(request.top_logprobs)
            if not request.token_ids:
                raise InvalidArgument("token_ids", "must not be empty")
            check_token_ids("token_ids", request.token_ids, self.info.vocab_size)
            check_length("token_ids", len(request.token_ids), self.info)
            session = self.store.get(request.session_id, 0)
            with tracing.server_span("verifier.Score", context, session_id=request.session_id,
                                     tokens=len(request.token_ids)):
                async with self.model_work(session) as seq:
                    session.guide = session.lookup_passed = session.lookup_index = None  # as at start = 0
                    logprobs, done = await score(seq, list(request.token_ids), request.top_logprobs)
            return verifier_pb2.ScoreResponse(logprobs=logprobs, batch_pass=batch_pass(done))
        except ServiceError as err:
            await abort(context, err)

    async def Decode(self, requests, context):
        request = await anext(aiter(requests), None)  # the run's; then offers alone
        if request is None:
            return
        logs.bind_from(context, request.session_id)
        reader = None
        try:
            self.check_ready()
            if not 1 <= request.max_tokens <= MAX_DECODE_TOKENS:
                raise InvalidArgument("max_tokens", f"must be in [1, {MAX_DECODE_TOKENS}], got {request.max_tokens}")
            if len(request.stop_token_ids) > MAX_STOP_TOKENS:
                raise InvalidArgument("stop_token_ids", f"at most {MAX_STOP_TOKENS}, got {len(request.stop_token_ids)}")
            sampling_params.validate(request.sampling, vocab_size=self.info.vocab_size)
            check_top_logprobs(request.top_logprobs)
            check_lookup_rule(request)
            check_token_ids("new_tokens", request.new_tokens, self.info.vocab_size)
            check_token_ids("stop_token_ids", request.stop_token_ids, self.info.vocab_size)
            if request.start == 0 and not request.new_tokens:
                raise InvalidArgument("new_tokens", "must not be empty when start is 0")
            check_length("new_tokens", request.start + len(request.new_tokens) + 1, self.info)
            self.check_features(request.features, request.start + len(request.new_tokens))
            offers = None if request.features.layers else Offers()
            if request.HasField("offer"):
                self._take(request.offer, offers)
            reader = asyncio.ensure_future(self._offers(requests, offers))
            session = self.store.get(request.session_id, request.start)
            with tracing.server_span("verifier.Decode", context, session_id=request.session_id,
                                     new_tokens=len(request.new_tokens), max_tokens=request.max_tokens):
                async with self.model_work(session) as seq:
                    guide = await self.guide(request, session)
                    # Closed before the session is let go, wherever the stream stops (a caller
                    # that cancels leaves this generator at its yield): the decoding must end
                    # before another call may touch the session.
                    async with contextlib.aclosing(decode(seq, request, self.info.max_positions, guide,
                                                          session, self.feature_cache, offers)) as steps:
                        async for p in steps:
                            if reader.done() and reader.exception() is not None:
                                raise reader.exception()  # an offer refused: the run ends with its error
                            yield verifier_pb2.DecodeResponse(
                                token_id=p.token, batch_pass=batch_pass(p.batch_pass), features=p.features,
                                drafted=p.drafted, drafts_rejected=p.rejected, logprobs=p.logprobs,
                                lookup_drafts=p.by_lookup, offered_drafts=p.offered)
        except ServiceError as err:
            await abort(context, err)
        finally:
            if reader is not None:
                reader.cancel()
                if reader.done() and not reader.cancelled():
                    reader.exception()  # retrieved: a run that ended first has no use for it

    async def _offers(self, requests, offers: Offers | None) -> None:
        """The offers a run's caller sends after its first message, each replacing the last."""
        async for message in requests:
            if message != verifier_pb2.DecodeRequest(offer=message.offer):
                raise InvalidArgument("offer", "a message after a run's first carries an offer alone")
            self._take(message.offer, offers)

    def _take(self, offer: verifier_pb2.DraftOffer, offers: Offers | None) -> None:
        """An offer checked, and kept by the run (None: a feature run, which takes none)."""
        if offers is None:
            raise InvalidArgument("offer", "not with features (a feature drafter's run drafts nothing)")
        check_offer(offer, self.info.vocab_size, self.info.max_positions)
        offers.offer(offer)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec-verifier", description=__doc__)
    server.add_server_flags(parser, "SPECDEC_VERIFIER", default_port=50053)
    flags.add(parser, "--model", env="SPECDEC_VERIFIER_MODEL", default=modeling.DEFAULT_TARGET,
              help="target model: a directory, a hub id, a .gguf file, or the embedded default")
    flags.add_session_service_flags(parser, "SPECDEC_VERIFIER")
    flags.add(parser, "--feature-cache-bytes", env="SPECDEC_VERIFIER_FEATURE_CACHE_BYTES", type=flags.byte_size,
              default="64MiB", help="memory for the target's features of prompt blocks, which feature drafters "
              "read: a prompt that starts as an earlier one's takes them with its prefix-cached keys and values "
              "(0: off; with prefix caching only)")
    return parser


async def serve(args, on_listen=None) -> None:
    tracing.setup("verifier", args.otlp_endpoint)
    serving.prepare_process(args)  # before the model loads (see there)
    servicer = VerifierServicer()
    metrics = EngineMetrics("verifier")
    metrics.serve(args.host, args.metrics_port)

    async def load():
        model, tokenizer = await asyncio.to_thread(modeling.load_model, args.model, args.dtype, args.device)
        engine = serving.engine(model, args, metrics)
        info = modeling.model_info(model, tokenizer, args.model, "target")
        info.numerics = engine.numerics
        info.num_layers, info.hidden_size = model.config.num_hidden_layers, model.config.hidden_size
        servicer.feature_cache = FeatureCache(args.feature_cache_bytes if args.prefix_caching else 0,
                                              engine.pool.block_size, metrics.feature_tokens)
        servicer.vocab = await asyncio.to_thread(grammar.vocabulary, tokenizer, info.vocab_size,
                                                 list(info.eos_token_ids))
        metrics.constraint_refusals.set_function(lambda: getattr(servicer.vocab, "refused", 0))
        # Warm up: a prefill and a multi-token pass, so the first request is not slow.
        seq = engine.new_sequence()
        seq.sync(0, [0, 1, 0, 1])
        await seq.logits(1)
        seq.extend([0, 1, 0])
        await seq.logits(4)
        engine.release(seq)
        servicer.ready(info, SessionStore(engine.new_sequence, args.max_sessions, args.session_idle_timeout,
                                          release=engine.release), metrics, engine)

    await servicer.serve(args, load, on_listen)


def main() -> None:
    torch.set_grad_enabled(False)
    args = build_parser().parse_args()
    flags.setup_logging(args.log_level, "verifier", args.log_format)
    server.refuse_taken_ports("verifier", args)
    asyncio.run(serve(args))
