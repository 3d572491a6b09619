"""The batching engine: see `specdec.engine.engine`."""

from specdec.engine.engine import Engine, one_thread_outside_engines, reproducible_blas
from specdec.engine.scheduler import Pass
from specdec.engine.sequence import PagedSequence, TokenSequence

__all__ = ["Engine", "Pass", "PagedSequence", "TokenSequence", "one_thread_outside_engines", "reproducible_blas"]
