"""Who runs in the next pass: the queue of work, and the rows a pass takes from it.

Per pass, `max_batch_tokens` bounds the work: short rows (a round's drafts, a decode
step) go whole, a long prefill goes in chunks of what is left, so a long prompt never
stalls the running streams for longer than one chunk. Sessions waiting for memory form
a bounded queue (see Engine.submit), admitted in the order they came."""

import concurrent.futures
import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from specdec.runtime.engine.block_manager import BlockManager
from specdec.runtime.engine.sequence import PagedSequence


@dataclass
class Pass:
    """One forward pass: how many sessions (rows) and tokens it ran, and its time."""
    rows: int
    tokens: int
    seconds: float
    free_blocks: int = 0  # blocks the pool could hand out after it
    waiting: int = 0  # sessions waiting for blocks after it


@dataclass(eq=False)
class Work:
    seq: PagedSequence
    last: int  # logits (and features, with `layers`) wanted for the last `last` tokens
    order: int
    again: bool = True  # the caller will submit again right after this
    # Decoding (Engine.decode): called on the engine's thread with the finished logits,
    # after it appended the next token to the sequence; True: go on with it next pass.
    then: Callable[[torch.Tensor, Pass], bool] | None = None
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    parts: list[torch.Tensor] = field(default_factory=list)  # logits from earlier chunks
    # The target's features wanted with the logits: at these layers (see Plan.feature_layers).
    layers: tuple[int, ...] = ()
    # Logits only for the last `logits_last` of the `last` (None: all): a prompt's features
    # are wanted, not its logits, each of which costs the output head a row.
    logits_last: int | None = None
    feature_parts: list[torch.Tensor] = field(default_factory=list)
    cancelled: bool = False
    in_pass: bool = False

    @property
    def remaining(self) -> int:
        return len(self.seq.tokens) - self.seq.cached


@dataclass(eq=False)
class Row:
    """A work's part of one pass: positions [start, start + n), of which the last
    `wanted` need logits (with the work's layers, features), and of those the last
    `logit_rows` logits."""
    work: Work
    start: int
    n: int
    wanted: int
    logit_rows: int


class Scheduler:
    """Not thread-safe: the engine calls it under its lock (`cond`)."""

    def __init__(self, blocks: BlockManager, cond: threading.Condition, max_batch_rows: int,
                 max_batch_tokens: int, gather: float):
        self.blocks, self.cond = blocks, cond
        self.max_batch_rows, self.max_batch_tokens = max_batch_rows, max_batch_tokens
        self.short = max(1, max_batch_tokens // 4)  # rows this short go whole: a round, not a prefill
        self.gather = gather
        self.queue: list[Work] = []
        self.refused: list[Work] = []  # work whose session outgrew the whole pool (the engine fails it)
        self.orders = itertools.count(1)

    def add(self, seq: PagedSequence, last: int, again: bool, then, layers: tuple[int, ...] = (),
            logits_last: int | None = None) -> Work:
        work = Work(seq, last, next(self.orders), again, then, layers=layers, logits_last=logits_last)
        self.queue.append(work)
        return work

    def waiting(self) -> int:
        """Work of sessions waiting for KV memory (a pass's own rows are not waiting,
        even when their session was closed during it)."""
        return sum(not w.seq.admitted and not w.in_pass for w in self.queue)

    def gather_coming(self, coming: set[PagedSequence], pass_seconds: float, stopped: Callable[[], bool]) -> None:
        """Sessions of the last pass come back at slightly different moments (their
        round trips through the network differ): wait a fraction of a pass for them, so
        that they share the next pass instead of splitting into two half-full ones."""
        deadline = time.monotonic() + self.gather * pass_seconds
        while self.queue and not stopped():
            queued = {w.seq for w in self.queue}
            if all(seq in queued or seq.released for seq in coming) or time.monotonic() >= deadline:
                return
            self.cond.wait(deadline - time.monotonic())

    def schedule(self) -> list[Row]:
        """This pass's rows (each a work and the tokens it computes now). Short rows first, oldest
        sessions first (they may take blocks from newer ones); then prefill chunks."""
        batch, in_pass = [], set()
        budget = self.max_batch_tokens
        # Admission is first come, first served: the first session that does not fit holds back
        # every later one (the memory that frees up is kept for it), so that a large prompt is
        # never passed over for ever by a stream of small ones.
        for work in sorted((w for w in self.queue if not w.seq.admitted), key=lambda w: w.order):
            if not self.blocks.admit(work.seq, len(work.seq.tokens) - work.last):
                break

        def age(work: Work):
            return (work.seq.admitted or float("inf"), work.order)

        short = sorted((w for w in self.queue if w.remaining <= self.short), key=age)
        long = sorted((w for w in self.queue if w.remaining > self.short), key=lambda w: w.order)
        for work in short + long:
            seq = work.seq
            if len(batch) == self.max_batch_rows or seq in in_pass:
                continue
            if not seq.admitted:
                continue  # it waits for memory
            n = work.remaining
            if n > self.short:  # a prefill: a chunk of what is left; the first one at least a short row's worth
                prefilling = any(row.n > self.short for row in batch)
                n = min(n, budget if prefilling else max(budget, self.short))
                if n <= 0:
                    continue
            if not self.blocks.reserve(seq, n, in_pass):
                if not self.blocks.fits(seq):  # a decode grew past the whole pool: it never will
                    self.refused.append(work)
                continue
            first_wanted = len(seq.tokens) - work.last
            first_logits = len(seq.tokens) - (work.last if work.logits_last is None else work.logits_last)
            batch.append(Row(work, seq.cached, n, max(0, min(n, seq.cached + n - first_wanted)),
                             max(0, min(n, seq.cached + n - first_logits))))
            in_pass.add(seq)
            budget -= n
        return batch
