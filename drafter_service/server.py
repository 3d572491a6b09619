"""The drafter's gRPC server: sessions, each a token sequence (and its keys and values in
the draft model's KV pool) that a proposer extends with draft tokens; the draft steps of
sessions drafting at the same time share forward passes."""

import argparse
import asyncio
import contextlib
import logging

from specdec import features, flags, logs, model_files, sampling_params, server, session_service, tracing
from specdec.runtime import eagle, modeling, serving
from specdec.api.common.v1 import common_pb2
from specdec.api.drafter.v1 import drafter_pb2, drafter_pb2_grpc
from specdec.errors import InvalidArgument, ServiceError, abort
from specdec.metrics import EngineMetrics
from specdec.sessions import SessionStore
from specdec.wire import MESSAGE_SLACK_BYTES, SERVICE_MESSAGE_BYTES
from specdec.validation import MAX_DRAFT_TOKENS, check_length, check_token_ids
from drafter_service.proposers import FeatureProposer, ModelProposer, NoModel, Proposer, with_lookup_rule

log = logging.getLogger("drafter")



class DrafterServicer(session_service.SessionServicer, drafter_pb2_grpc.DrafterServiceServicer):
    pb, pb_grpc, service, name = drafter_pb2, drafter_pb2_grpc, "DrafterService", "drafter"

    def __init__(self):
        super().__init__()
        self.proposer: Proposer | None = None

    def ready(self, proposer: Proposer, store: SessionStore, metrics=None,
              info: common_pb2.ModelInfo | None = None) -> None:
        """Serves `proposer`, reporting `info` (default: the proposer's own; see `reported`)."""
        self.proposer = proposer
        super().ready(info or proposer.info(), store, metrics, getattr(proposer, "engine", None))

    def check_features(self, request: drafter_pb2.ProposeRequest) -> None:
        """INVALID_ARGUMENT naming the field unless the features are of committed
        positions before the last, as wide as this drafter reads them."""
        if not request.HasField("features"):
            return
        if not self.info.feature_layers:
            raise InvalidArgument("features", f"this drafter ({self.info.kind}) drafts from no features")
        features.check("features", request.features, self.info.hidden_size * len(self.info.feature_layers))
        committed = request.start + len(request.new_tokens)
        if request.features.start + request.features.rows > committed - 1:
            raise InvalidArgument("features", f"positions [{request.features.start}, "
                                              f"{request.features.start + request.features.rows}) reach past "
                                              f"the last committed token's ({committed - 1})")

    async def Propose(self, request: drafter_pb2.ProposeRequest, context):
        logs.bind_from(context, request.session_id)
        try:
            self.check_ready()
            k = request.num_draft_tokens
            if not 1 <= k <= MAX_DRAFT_TOKENS:
                raise InvalidArgument("num_draft_tokens", f"must be in [1, {MAX_DRAFT_TOKENS}], got {k}")
            sampling_params.validate(request.sampling, vocab_size=self.info.vocab_size)
            check_token_ids("new_tokens", request.new_tokens, self.info.vocab_size)
            if request.start == 0 and not request.new_tokens:
                raise InvalidArgument("new_tokens", "must not be empty when start is 0")
            check_length("new_tokens", request.start + len(request.new_tokens), self.info)
            self.check_features(request)
            if request.HasField("draw_position") and not 0 <= request.draw_position < 1 << 62:
                raise InvalidArgument("draw_position", f"must be in [0, 2**62), got {request.draw_position}")
            draw_at = request.draw_position if request.HasField("draw_position") else None
            session = self.store.get(request.session_id, request.start)
            with tracing.server_span("drafter.Propose", context, session_id=request.session_id, k=k,
                                     new_tokens=len(request.new_tokens)):
                async with self.model_work(session) as seq:  # a cancelled call's last step ends before the next
                    seq.sync(request.start, list(request.new_tokens))
                    self.proposer.take_features(seq, request.features)
                    k = min(k, self.info.max_positions - len(seq.tokens))
                    response = drafter_pb2.ProposeResponse()
                    # Closed before the session is let go, wherever the call stops.
                    async with contextlib.aclosing(self.proposer.propose(seq, k, request.sampling, draw_at)) as drafts:
                        async for token, q in drafts:
                            response.token_ids.append(token)
                            if q is not None:
                                response.qs.append(q)
                if response.token_ids:  # the session is let go first: the next call needn't wait for the send
                    yield response
        except ServiceError as err:
            await abort(context, err)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec-drafter", description=__doc__)
    server.add_server_flags(parser, "SPECDEC_DRAFTER", default_port=50052)
    flags.add(parser, "--proposer", env="SPECDEC_DRAFTER_PROPOSER", default="hybrid",
              choices=["model", "ngram", "hybrid"],
              help="model: a small causal LM (--model); ngram: prompt lookup, no model; hybrid: prompt lookup "
                   "when the context holds a match of --lookup-min-match tokens, the model otherwise (the "
                   "orchestrator drafts lookup rounds from its history by the rule this drafter reports)")
    flags.add(parser, "--model", env="SPECDEC_DRAFTER_MODEL", default=modeling.DEFAULT_DRAFT,
              help="draft model: a directory, a hub id or a .gguf file (with --proposer model or hybrid), or an "
                   "EAGLE-3 head's directory (it drafts from the target's features); the default is the draft "
                   "distilled from the default target")
    flags.add_session_service_flags(parser, "SPECDEC_DRAFTER")
    flags.add(parser, "--feature-window", env="SPECDEC_DRAFTER_FEATURE_WINDOW", type=int, default=None,
              help="with an EAGLE-3 head as --model: the most positions back it attends (default: the head's "
                   "own, or 256); the orchestrator keeps this many of the target's features a request")
    flags.add(parser, "--max-draft-support", env="SPECDEC_DRAFTER_MAX_DRAFT_SUPPORT", type=int, default=64,
              help="when sampling, draft from the top N tokens of q and send them")
    flags.add(parser, "--ngram-max", env="SPECDEC_DRAFTER_NGRAM_MAX", type=int, default=4,
              help="longest n-gram the prompt-lookup proposer matches")
    flags.add(parser, "--ngram-min", env="SPECDEC_DRAFTER_NGRAM_MIN", type=int, default=1,
              help="shortest n-gram the prompt-lookup proposer matches")
    flags.add(parser, "--lookup-min-match", env="SPECDEC_DRAFTER_LOOKUP_MIN_MATCH", type=int, default=3,
              help="with --proposer hybrid, the shortest match that drafts by lookup instead of the model")
    return parser


def make_proposer(args, metrics=None) -> Proposer:
    if args.proposer == "ngram":
        return NoModel()
    if not args.model:
        raise SystemExit("--proposer model needs --model")
    path = model_files.resolve(args.model)
    if eagle.is_head(path):
        head = eagle.load_head(path, dtype=modeling.DTYPES[args.dtype], device=args.device,
                               window=args.feature_window)
        window_bytes = head.window * len(head.aux_layers) * head.config.target_hidden * features.BYTES
        if window_bytes + MESSAGE_SLACK_BYTES > SERVICE_MESSAGE_BYTES:
            raise SystemExit(f"specdec-drafter: a window of {head.window} positions of this head's features "
                             f"({len(head.aux_layers)} layers x {head.config.target_hidden}) takes {window_bytes} "
                             f"bytes, more than a message between the services holds ({SERVICE_MESSAGE_BYTES}); "
                             f"lower --feature-window")
        proposer = FeatureProposer(head, model_files.load_tokenizer(path), args.model, args.threads,
                                   args.max_draft_support)
    else:
        model, tokenizer = modeling.load_model(args.model, args.dtype, args.device)
        output_ids = modeling.restrict_output(model, args.model)
        proposer = ModelProposer(serving.engine(model, args, metrics), tokenizer, args.model,
                                 args.max_draft_support, output_ids)
    return proposer


def lookup_rule(args) -> tuple[int, int] | None:
    """The (shortest, longest) suffix match the orchestrator drafts lookup rounds by, for
    --proposer ngram and hybrid; refused at start unless 1 <= shortest <= longest."""
    if args.proposer == "ngram":
        rule = args.ngram_min, args.ngram_max
    elif args.proposer == "hybrid":
        rule = args.lookup_min_match, max(args.ngram_max, args.lookup_min_match)
    else:
        return None
    if not 1 <= rule[0] <= rule[1]:
        raise SystemExit(f"specdec-drafter: the lookup rule needs 1 <= the shortest match ({rule[0]}) <= the "
                         f"longest ({rule[1]}): see --ngram-min, --ngram-max and --lookup-min-match")
    return rule


def reported(proposer: Proposer, args) -> common_pb2.ModelInfo:
    """What this drafter reports: its proposer's info and its lookup rule, if any."""
    rule = lookup_rule(args)
    return proposer.info() if rule is None else with_lookup_rule(proposer.info(), args.proposer, *rule)


async def serve(args, on_listen=None) -> None:
    lookup_rule(args)  # a bad rule is refused before the model loads
    tracing.setup("drafter", args.otlp_endpoint)
    serving.prepare_process(args)  # before the model loads (see there)
    servicer = DrafterServicer()
    metrics = EngineMetrics("drafter")
    metrics.serve(args.host, args.metrics_port)

    async def load():
        proposer = await asyncio.to_thread(make_proposer, args, metrics)
        # Warm up: a few drafts on a throwaway sequence, so the first request is not slow.
        seq = proposer.new_sequence()
        seq.sync(0, [0, 1, 0, 1])
        info = proposer.info()
        if info.feature_layers:  # zeros for features: the head's passes run once, as they will
            width = info.hidden_size * len(info.feature_layers)
            proposer.take_features(seq, common_pb2.Features(start=0, rows=3, width=width,
                                                            data=bytes(3 * width * features.BYTES)))
        async for _ in proposer.propose(seq, 2, common_pb2.SamplingParams(top_p=1.0)):
            pass
        proposer.release(seq)
        servicer.ready(proposer, SessionStore(proposer.new_sequence, args.max_sessions, args.session_idle_timeout,
                                              release=proposer.release), metrics, info=reported(proposer, args))

    await servicer.serve(args, load, on_listen)


def main() -> None:
    args = build_parser().parse_args()
    flags.setup_logging(args.log_level, "drafter", args.log_format)
    server.refuse_taken_ports("drafter", args)
    asyncio.run(serve(args))
