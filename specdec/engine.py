"""The batching engine both services run their model through: continuous batching
over sessions, one forward pass at a time.

Every call that needs the model submits *work*: compute the keys and values of a
session's tokens that are not cached yet, and return the logits of its last `last`
tokens. Between passes, the engine's thread takes whatever work is waiting into one
pass, whatever the sessions' lengths: the tokens of all rows packed into one sequence
(the linear layers see one [1, tokens] input), each with its own position, and an
attention that reads each row's keys from the pool (`paged_attention`). Sessions join
and leave between passes.

Per pass, `max_batch_tokens` bounds the work: short rows (a round's drafts) go whole,
a long prefill goes in chunks of what is left, so a long prompt never stalls the
running streams for longer than one chunk. Memory: a session is admitted when the pool
has blocks for all its tokens; a running session that must grow takes blocks back from
the newest admitted session outside the pass, which keeps its tokens and recomputes
its cache when its turn comes (preemption by recompute). Sessions waiting for memory
form a bounded queue; past it, or for a session longer than the whole pool, a call
gets RESOURCE_EXHAUSTED."""

import asyncio
import concurrent.futures
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

import torch
from transformers import AttentionInterface

from specdec.errors import NeedsResync, Overloaded, RESYNC_DETAIL
from specdec.kv import KVPool, PagedSequence
from specdec.quantize import attention_dtype

log = logging.getLogger(__name__)

ATTENTION = "specdec_paged"
LOG_EVERY_S = 30.0
DEFAULT_THREADS = torch.get_num_threads()  # torch's default, one per core: before anything changes it
_one_thread_elsewhere = False


def one_thread_outside_engines() -> None:
    """Makes every thread of this process but an engine's run its operations on one
    core; call it before the model loads. libgomp's threads spin between two parallel
    operations only while the process has no more of them than cores; the pool a second
    thread leaves behind (the model loader's, the event loop's) makes each of a pass's
    ~200 parallel operations sleep and wake instead. Measured on 2 cores, int8
    (`python -m deploy.bench_engine --threads 2`): a step took 31.0 ms beside such a
    pool, 14.7 ms without it."""
    global _one_thread_elsewhere
    _one_thread_elsewhere = True
    torch.set_num_threads(1)


@dataclass
class Pass:
    """One forward pass: how many sessions (rows) and tokens it ran, and its time."""
    rows: int
    tokens: int
    seconds: float


@dataclass
class Group:
    """Rows that attend together, padded to the group's widest row (Q new tokens) and
    longest history (L positions). A long prefill chunk is a group of its own, so the
    rounds beside it are not padded to its size."""
    read_slots: torch.Tensor  # [b, L] slots each row reads; padding reads slot 0 (zeros)
    q_index: torch.Tensor     # [b, Q] packed index of each row's j-th new token (padding: 0)
    mask: torch.Tensor | None  # [b, 1, Q, L] query may attend key (None: every query attends every key)
    packed: torch.Tensor      # [t] packed indices of the group's new tokens
    flat: torch.Tensor        # [t] where each of them sits in the group's [b * Q] output


@dataclass
class Plan:
    """Where a pass reads and writes keys and values: T packed new tokens, each row's at
    positions [start, end) of its session, reading positions [0, end)."""
    pool: KVPool
    write_slots: torch.Tensor  # [T] pool slot of each new token
    groups: list[Group]
    dtype: torch.dtype  # attention computes in it (float64 for an int8 model: see specdec.quantize)
    works: list["Work"]  # the pass's

    def abandoned(self) -> bool:
        """Every row's caller has gone (a decode whose reader moved on to another call on
        the session): the rest of the pass would compute what nobody reads, and hold
        the session meanwhile."""
        return all(work.cancelled for work in self.works)


class _Abandoned(Exception):
    pass


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, specdec_plan=None,
                    **kwargs):
    """query: [1, heads, T, d], key/value: [1, kv_heads, T, d] for the packed new tokens.
    Writes the new keys and values to the pool, then attends each row to its own."""
    plan = specdec_plan
    if plan is None:
        raise RuntimeError("this model runs through specdec's Engine now: load another copy for other uses")
    if plan.abandoned():
        raise _Abandoned  # before this layer writes: the rows' caches stay as they were before the pass
    layer = module.layer_idx
    k_pool, v_pool = plan.pool.k[layer], plan.pool.v[layer]
    k_pool.index_copy_(0, plan.write_slots, key[0].transpose(0, 1).to(k_pool.dtype))
    v_pool.index_copy_(0, plan.write_slots, value[0].transpose(0, 1).to(v_pool.dtype))
    if len(plan.groups) == 1 and plan.groups[0].read_slots.shape[0] == 1:
        # The pass's one row (a decode step, one session's round): its tokens in order,
        # nothing to pick out or place back.
        o = _attend(plan.groups[0], query.to(plan.dtype), k_pool, v_pool, plan.dtype, scaling)
        return o.transpose(1, 2).to(query.dtype), None
    queries = query[0].transpose(0, 1).to(plan.dtype)  # [T, heads, d]
    out = torch.empty_like(queries)
    for g in plan.groups:
        b = g.read_slots.shape[0]
        q = queries.index_select(0, g.q_index.view(-1)).view(b, -1, *queries.shape[1:]).transpose(1, 2)
        o = _attend(g, q, k_pool, v_pool, plan.dtype, scaling)
        b, heads, width, d = o.shape
        out.index_copy_(0, g.packed, o.transpose(1, 2).reshape(b * width, heads, d)[g.flat])
    return out.unsqueeze(0).to(query.dtype), None


def _attend(g: Group, q, k_pool, v_pool, dtype, scaling) -> torch.Tensor:
    """q: [b, heads, Q, d] -> [b, heads, Q, d], each row attending the slots it reads."""
    b, length = g.read_slots.shape
    # index_select, not indexing with the [b, L] tensor: a third less time at a step's sizes
    k = k_pool.index_select(0, g.read_slots.view(-1)).view(b, length, *k_pool.shape[1:])
    v = v_pool.index_select(0, g.read_slots.view(-1)).view(b, length, *v_pool.shape[1:])
    k, v = k.transpose(1, 2).to(dtype), v.transpose(1, 2).to(dtype)  # [b, kv_heads, L, d]
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=g.mask, scale=scaling,
                                                            enable_gqa=True)


AttentionInterface.register(ATTENTION, paged_attention)


@dataclass(eq=False)
class Row:
    """A work's part of one pass: positions [start, start + n), of which the last
    `wanted` need logits."""
    work: "Work"
    start: int
    n: int
    wanted: int


@dataclass(eq=False)
class Work:
    seq: PagedSequence
    last: int  # logits wanted for the last `last` tokens
    order: int
    again: bool = True  # the caller will submit again right after this
    # Decoding (Engine.decode): called on the engine's thread with the finished logits,
    # after it appended the next token to the sequence; True: go on with it next pass.
    then: Callable[[torch.Tensor, "Pass"], bool] | None = None
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    parts: list[torch.Tensor] = field(default_factory=list)  # logits from earlier chunks
    cancelled: bool = False
    in_pass: bool = False

    @property
    def remaining(self) -> int:
        return len(self.seq.tokens) - self.seq.cached


def check_supported(model) -> None:
    """The pool holds every position of every layer: refuse models that attend otherwise."""
    config = model.config
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"} or getattr(config, "use_sliding_window", False):
        raise ValueError(f"{config.model_type}: only models whose every layer attends to every position are "
                         f"supported (layer types {sorted(kinds)})")
    if not model._can_set_attn_implementation():
        raise ValueError(f"{config.model_type}: the model does not use transformers' attention interface")


def _closed() -> NeedsResync:
    return NeedsResync(f"the session was closed during the call; {RESYNC_DETAIL}")


class Engine:
    """Runs one model for all sessions of a service; see the module docstring."""

    def __init__(self, model, kv_cache_bytes: int, max_batch_rows: int = 64, max_batch_tokens: int = 256,
                 max_waiting: int = 64, block_size: int = 16, gather: float = 0.25, threads: int = 0,
                 metrics=None):
        if max_batch_rows < 1 or max_batch_tokens < 1:
            raise ValueError("max_batch_rows and max_batch_tokens must be >= 1")
        check_supported(model)
        model.set_attn_implementation(ATTENTION)
        self.model, self.device = model, model.device
        self.attention_dtype = attention_dtype(model, model.dtype)
        self.pool = KVPool(model.config, kv_cache_bytes, model.dtype, model.device, block_size)
        self.max_batch_rows, self.max_batch_tokens, self.max_waiting = max_batch_rows, max_batch_tokens, max_waiting
        self.short = max(1, max_batch_tokens // 4)  # rows this short go whole: a round, not a prefill
        self.queue: list[Work] = []
        self.cond = threading.Condition()
        self.orders = itertools.count(1)
        self.admissions = itertools.count(1)
        self.holders: set[PagedSequence] = set()  # sessions holding blocks
        self.stopped = False
        self.gather, self.pass_seconds = gather, 0.0
        self.threads = threads or DEFAULT_THREADS  # intra-op threads of a pass
        # Totals, for the benchmark and the logs.
        self.passes = self.rows = self.tokens = self.evictions = 0
        self.busy_s = 0.0
        self.logged = (time.monotonic(), 0, 0, 0, 0.0)
        self.metrics = metrics  # specdec.metrics.EngineMetrics, or None
        if metrics is not None:
            metrics.follow(queue=lambda: sum(not w.in_pass for w in list(self.queue)),
                           waiting=lambda: sum(not w.seq.admitted and not w.in_pass for w in list(self.queue)),
                           kv_used=lambda: self.pool.capacity - len(self.pool.free), kv_total=self.pool.capacity)
        threads_set = threading.Event()
        self.thread = threading.Thread(target=self._loop, args=(threads_set,), name="engine", daemon=True)
        self.thread.start()
        threads_set.wait()
        if _one_thread_elsewhere:
            torch.set_num_threads(1)  # torch's default for threads to come, which the engine's set
        log.info("KV pool: %d blocks of %d tokens (%d tokens, %.1f MiB at %d bytes per token); batches of up to "
                 "%d rows and %d tokens", self.pool.capacity, block_size, self.pool.capacity * block_size,
                 self.pool.capacity * block_size * self.pool.bytes_per_token / 2 ** 20, self.pool.bytes_per_token,
                 max_batch_rows, max_batch_tokens)

    def new_sequence(self) -> PagedSequence:
        return PagedSequence(self)

    # -- calls (any thread) --------------------------------------------------------------

    def submit(self, seq: PagedSequence, last: int, again: bool = True, then=None) -> Work:
        """Queues work; `again`: the caller will be back with more right after this one
        (the next pass may wait a little for it); `then`: see Work."""
        with self.cond:
            if self.pool.blocks_for(len(seq.tokens)) > self.pool.capacity:
                raise Overloaded(f"the session holds {len(seq.tokens)} tokens; the KV pool holds "
                                 f"{self.pool.capacity * self.pool.block_size}")
            if not seq.admitted:
                waiting = self._waiting()
                if not (waiting == 0 and self._admit(seq)) and waiting >= self.max_waiting:
                    raise Overloaded(f"{waiting} sessions are waiting for KV memory")
            seq.cached = min(seq.cached, len(seq.tokens) - last)  # logits come from computing those positions
            work = Work(seq, last, next(self.orders), again, then)
            self.queue.append(work)
            self.cond.notify()
        return work

    async def forward(self, seq: PagedSequence, last: int, again: bool = True) -> tuple[torch.Tensor, Pass]:
        """Logits after each of the last `last` tokens of seq ([last, vocab]), and the
        pass that finished them."""
        work = self.submit(seq, last, again)
        done = asyncio.wrap_future(work.future)
        try:
            return await asyncio.shield(done)
        except asyncio.CancelledError:
            # The caller goes, but the session must not change under a pass that holds it.
            self.cancel(work)
            await asyncio.wait([done])
            if not done.cancelled():
                done.exception()  # nobody wants it now
            raise

    async def decode(self, seq: PagedSequence, pick: Callable[[torch.Tensor], tuple[int, bool]]
                     ) -> AsyncIterator[tuple[int, Pass]]:
        """The target alone, one token per pass: pick(logits after the last token [vocab])
        gives the next token and whether to go on. The token joins the sequence, and the
        session the next pass, on the engine's thread: no hand-off to the caller between
        passes, whose cost (a thread switch, the caller's own work) would fall on every
        token. Yields each (token, pass) as it is picked; the last token is not computed."""
        loop = asyncio.get_running_loop()
        picked: asyncio.Queue = asyncio.Queue()

        def then(logits: torch.Tensor, done: Pass) -> bool:
            token, go_on = pick(logits[-1])
            seq.extend([token])
            loop.call_soon_threadsafe(picked.put_nowait, (token, done))
            return go_on

        work = self.submit(seq, 1, then=then)
        finished = asyncio.wrap_future(work.future)
        # The work's end comes through the same queue, behind every token picked before it:
        # one wait per token, not a wait on two futures.
        finished.add_done_callback(lambda _: picked.put_nowait(None))
        try:
            while (item := await picked.get()) is not None:
                yield item
            finished.result()  # the pass's error, if one failed
        finally:
            if not finished.done():
                # The caller stops early (or was cancelled): the session must not change
                # under a pass that holds it.
                self.cancel(work)
                await asyncio.wait([finished])
            if not finished.cancelled():
                finished.exception()  # nobody wants it now

    def forward_now(self, seq: PagedSequence, last: int) -> tuple[torch.Tensor, Pass]:
        """`forward` for a caller that is not on an event loop (warm-up, benchmarks)."""
        return self.submit(seq, last).future.result()

    def cancel(self, work: Work) -> None:
        with self.cond:
            work.cancelled = True
            if not work.in_pass and work in self.queue:
                self._finish(work)
                self.cond.notify()

    def crop(self, seq: PagedSequence, length: int) -> None:
        """Forget cached positions from `length` on and the blocks the tokens no longer need."""
        with self.cond:
            seq.cached = min(seq.cached, length)
            keep = self.pool.blocks_for(max(seq.cached, len(seq.tokens)))
            if seq.admitted and len(seq.blocks) > keep:
                self.pool.release(seq.blocks[keep:])
                del seq.blocks[keep:]
                self.cond.notify()

    def release(self, seq: PagedSequence) -> None:
        """A closed session: its blocks go back to the pool; a call still waiting on it
        learns that the session is gone (the caller resends it). A session in the running
        pass keeps its blocks until the pass ends: the pass is writing to them, and they
        must not reach another session before it has."""
        with self.cond:
            seq.released = True
            for work in [w for w in self.queue if w.seq is seq and not w.in_pass]:
                self._finish(work, error=_closed())
            if not any(w.seq is seq and w.in_pass for w in self.queue):
                self._evict(seq)
            self.cond.notify()

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify()

    # -- the engine's thread ---------------------------------------------------------------

    def _loop(self, threads_set: threading.Event) -> None:
        torch.set_grad_enabled(False)
        # A thread takes torch's default at its first call; take it now, so that a later
        # change of the default (one_thread_outside_engines) leaves this thread's alone.
        torch.get_num_threads()
        torch.set_num_threads(self.threads)
        threads_set.set()
        coming: set[PagedSequence] = set()  # sessions of the last pass that said they would be back
        while True:
            with self.cond:
                while True:
                    if self.stopped:
                        return
                    if self.queue:
                        self._gather(coming)
                        if batch := self._schedule():
                            break
                    self.cond.wait()
                for row in batch:
                    row.work.in_pass = True
                coming = {row.work.seq for row in batch if row.work.again}
            started = time.perf_counter()
            try:
                logits, error = self._run(batch), None
            except _Abandoned:
                logits, error = None, None
            except Exception as err:  # a failed pass fails its rows, never the engine
                log.exception("forward pass of %d rows failed", len(batch))
                logits, error = None, err
            done = Pass(len(batch), sum(row.n for row in batch), time.perf_counter() - started)
            with self.cond:
                self._commit(batch, logits, error, done)

    def _gather(self, coming: set[PagedSequence]) -> None:
        """Sessions of the last pass come back at slightly different moments (their
        round trips through the network differ): wait a fraction of a pass for them, so
        that they share the next pass instead of splitting into two half-full ones."""
        deadline = time.monotonic() + self.gather * self.pass_seconds
        while self.queue and not self.stopped:
            queued = {w.seq for w in self.queue}
            if all(seq in queued or seq.released for seq in coming) or time.monotonic() >= deadline:
                return
            self.cond.wait(deadline - time.monotonic())

    def _schedule(self) -> list[Row]:
        """This pass's rows (each a work and the tokens it computes now). Short rows first, oldest
        sessions first (they may take blocks from newer ones); then prefill chunks."""
        batch, in_pass = [], set()
        budget = self.max_batch_tokens

        def age(work: Work):
            return (work.seq.admitted or float("inf"), work.order)

        short = sorted((w for w in self.queue if w.remaining <= self.short), key=age)
        long = sorted((w for w in self.queue if w.remaining > self.short), key=lambda w: w.order)
        for work in short + long:
            seq = work.seq
            if len(batch) == self.max_batch_rows or seq in in_pass:
                continue
            n = work.remaining
            if n > self.short:  # a prefill: a chunk of what is left; the first one at least a short row's worth
                prefilling = any(row.n > self.short for row in batch)
                n = min(n, budget if prefilling else max(budget, self.short))
                if n <= 0:
                    continue
            if not self._reserve(seq, n, in_pass):
                continue
            first_wanted = len(seq.tokens) - work.last
            batch.append(Row(work, seq.cached, n, max(0, min(n, seq.cached + n - first_wanted))))
            in_pass.add(seq)
            budget -= n
        return batch

    def _reserve(self, seq: PagedSequence, n: int, in_pass: set) -> bool:
        """Blocks for seq's next n positions: a new session is admitted only with blocks
        for all its tokens; a running one may take blocks back from newer sessions."""
        pool = self.pool
        if not seq.admitted:
            return self._admit(seq)
        need = pool.blocks_for(seq.cached + n) - len(seq.blocks)
        while need > len(pool.free):
            newer = [s for s in self.holders if s.admitted > seq.admitted and s not in in_pass]
            if not newer:
                return False
            victim = max(newer, key=lambda s: s.admitted)
            log.info("KV pool full: a session of %d tokens gives its blocks back (it recomputes later)",
                     len(victim.tokens))
            self.evictions += 1
            if self.metrics is not None:
                self.metrics.evictions.inc()
            self._evict(victim)
        if need > 0:
            seq.blocks.extend(pool.allocate(need))
        return True

    def _waiting(self) -> int:
        """Work of sessions waiting for KV memory (a pass's own rows are not waiting,
        even when their session was closed during it)."""
        return sum(not w.seq.admitted and not w.in_pass for w in self.queue)

    def _admit(self, seq: PagedSequence) -> bool:
        need = self.pool.blocks_for(len(seq.tokens))
        if need > len(self.pool.free):
            return False
        seq.blocks = self.pool.allocate(need)
        seq.admitted = next(self.admissions)
        self.holders.add(seq)
        return True

    def _evict(self, seq: PagedSequence) -> None:
        self.pool.release(seq.blocks)
        seq.blocks, seq.cached, seq.admitted = [], 0, 0
        self.holders.discard(seq)

    def _run(self, batch: list[Row]) -> torch.Tensor:
        """One forward over every row's next tokens; -> logits of the wanted positions."""
        device = self.device
        ids, positions, keep, placed = [], [], [], []
        for row in batch:
            seq, start, end = row.work.seq, row.start, row.start + row.n
            placed.append((row, len(ids), seq.slots(end, device)))  # the slots it reads, its own last
            keep += range(len(ids) + row.n - row.wanted, len(ids) + row.n)
            ids += seq.tokens[start:end]
            positions += range(start, end)
        writes = [slots[row.start:] for row, _, slots in placed]
        short = [p for p in placed if p[0].n <= self.short]
        groups = [self._group(g) for g in ([short] if short else []) + [[p] for p in placed if p[0].n > self.short]]
        plan = Plan(self.pool, writes[0] if len(writes) == 1 else torch.cat(writes), groups, self.attention_dtype,
                    [row.work for row in batch])
        with torch.inference_mode():
            out = self.model(input_ids=torch.tensor([ids], device=device),
                             position_ids=torch.tensor([positions], device=device),
                             logits_to_keep=torch.tensor(keep, dtype=torch.long, device=device),
                             use_cache=False, specdec_plan=plan)
            logits = out.logits[0].float()
        if device.type == "cuda":  # the pass's time is read right after: let it end first
            torch.cuda.synchronize(device)
        return logits

    def _group(self, placed: list[tuple[Row, int, torch.Tensor]]) -> Group:
        """The attention layout of rows (each with its offset in the packed tokens and the
        slots it reads)."""
        device = self.device
        width = max(row.n for row, _, _ in placed)
        length = max(row.start + row.n for row, _, _ in placed)
        # Each row's slots, padded to the longest with slot 0 (zeros, never attended).
        read_slots = torch.nn.utils.rnn.pad_sequence([slots for _, _, slots in placed], batch_first=True)
        q_index, q_pos, packed, flat = [], [], [], []
        for b, (row, offset, _) in enumerate(placed):
            end = row.start + row.n
            pad = width - row.n
            q_index.append(list(range(offset, offset + row.n)) + [0] * pad)
            q_pos.append(list(range(row.start, end)) + [0] * pad)  # padding attends slot 0 only
            packed += range(offset, offset + row.n)
            flat += range(b * width, b * width + row.n)
        mask = None
        if len(placed) > 1 or width > 1:  # one row of one token attends all it reads: no mask to build or apply
            mask = (torch.arange(length, device=device)[None, None, :]
                    <= torch.tensor(q_pos, device=device)[:, :, None]).unsqueeze(1)
        return Group(read_slots, torch.tensor(q_index, device=device), mask,
                     torch.tensor(packed, device=device), torch.tensor(flat, device=device))

    def _commit(self, batch: list[Row], logits: torch.Tensor | None, error: Exception | None, done: Pass) -> None:
        self.passes += 1
        self.rows += done.rows
        self.tokens += done.tokens
        self.busy_s += done.seconds
        self.pass_seconds = 0.9 * self.pass_seconds + 0.1 * done.seconds
        if self.metrics is not None:
            self.metrics.passes.observe(done.seconds)
            self.metrics.rows.observe(done.rows)
            self.metrics.tokens.observe(done.tokens)
            if error is not None:
                self.metrics.failed_passes.inc()
        now = time.monotonic()
        if now - self.logged[0] >= LOG_EVERY_S:
            passes = self.passes - self.logged[1]
            log.info("%d passes in %.0f s: %.1f rows and %.1f tokens per pass, %.1f ms each, busy %.0f%%, "
                     "%d sessions hold %d of %d KV blocks, %d waiting", passes, now - self.logged[0],
                     (self.rows - self.logged[2]) / passes, (self.tokens - self.logged[3]) / passes,
                     (self.busy_s - self.logged[4]) * 1e3 / passes, 100 * (self.busy_s - self.logged[4]) /
                     (now - self.logged[0]), len(self.holders), self.pool.capacity - len(self.pool.free),
                     self.pool.capacity, self._waiting())
            self.logged = (now, self.passes, self.rows, self.tokens, self.busy_s)
        kept = 0
        for row in batch:
            work, seq = row.work, row.work.seq
            work.in_pass = False
            if seq.released:
                self._finish(work, error=_closed())
                self._evict(seq)  # closed during the pass: its blocks are free now
            elif error is not None:
                self._evict(seq)  # its cache is in doubt: it recomputes from its tokens
                self._finish(work, error=error)
            elif logits is None:  # abandoned (every row cancelled): what it wrote past row.start is not counted
                self._finish(work)
            else:
                seq.cached = row.start + row.n
                work.parts.append(logits[kept:kept + row.wanted])
                if work.cancelled:
                    self._finish(work)
                elif work.remaining == 0:
                    self._done(work, work.parts[0] if len(work.parts) == 1 else torch.cat(work.parts), done)
            kept += row.wanted
        self.cond.notify()

    def _done(self, work: Work, logits: torch.Tensor, done: Pass) -> None:
        if work.then is None:
            self._finish(work, result=(logits, done))
            return
        try:
            go_on = work.then(logits, done)
        except Exception as err:  # the caller's pick failed: its work ends, never the engine
            self._finish(work, error=err)
            return
        if go_on:  # the token just picked is the work's next pass
            work.parts = []
        else:
            self._finish(work, result=(logits, done))

    def _finish(self, work: Work, result=None, error: Exception | None = None) -> None:
        """Takes the work off the queue and answers it (a cancel without result or error)."""
        if work in self.queue:
            self.queue.remove(work)
        if error is not None:
            work.future.set_exception(error)
        elif result is not None:
            work.future.set_result(result)
        else:
            work.future.cancel()
