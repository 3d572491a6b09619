"""The batching engine: see `specdec.runtime.engine.engine`."""

from specdec.runtime.engine.engine import Engine, one_thread_outside_engines, reproducible_blas
from specdec.runtime.engine.scheduler import Pass
from specdec.runtime.engine.sequence import PagedSequence, TokenSequence

__all__ = ["Engine", "Pass", "PagedSequence", "TokenSequence", "one_thread_outside_engines", "reproducible_blas"]
