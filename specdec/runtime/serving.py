"""A model's runtime as a session service (the drafter, the verifier) runs it: the
process set up before the model loads, and the model's batching engine from the
session-service flags (specdec.flags.add_session_service_flags)."""

import logging

from specdec.runtime.engine import Engine, one_thread_outside_engines, reproducible_blas
from specdec.runtime.quantize import quantize

log = logging.getLogger(__name__)


def prepare_process(args) -> None:
    """What a session service's process sets before its model loads: its threads outside
    the engine on one core each, and, for batch-invariant passes, MKL's reproducible mode
    (see each)."""
    one_thread_outside_engines()
    if args.batch_invariant:
        reproducible_blas()


def engine(model, args, metrics=None) -> Engine:
    """The model's batching engine, sized by the session-service flags (and the model
    quantized as they say: the drafter cuts its output head first). --cuda-graphs is for
    a model on a GPU: a deployment passes it to every service, and one whose model is on a
    CPU runs its passes the usual way (the same padded passes, run eagerly, are slower)."""
    graphs = args.cuda_graphs
    if graphs != "off" and model.device.type != "cuda":
        log.warning("--cuda-graphs %s: the model is on %s, its passes run the usual way", graphs, model.device)
        graphs = "off"
    return Engine(quantize(model, args.quantize), args.kv_cache_bytes, args.max_batch_rows, args.max_batch_tokens,
                  args.max_waiting_sessions, threads=args.threads, metrics=metrics, prefix_caching=args.prefix_caching,
                  cuda_graphs=graphs, batch_invariant=args.batch_invariant)
