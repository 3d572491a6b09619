"""The batching engine both services run their model through: continuous batching
over sessions, one forward pass at a time.

Every call that needs the model submits *work*: compute the keys and values of a
session's tokens that are not cached yet, and return the logits of its last `last`
tokens. Between passes, the engine's thread takes whatever work is waiting into one
pass, whatever the sessions' lengths. The parts, each with one job:

- `sequence`: a session's tokens and the blocks its cache lives in;
- `block_manager`: the KV pool, admission by memory, preemption by recompute;
- `scheduler`: the queue, and which rows (whole rounds, prefill chunks) a pass takes;
- `model_runner`: the pass's rows as batched tensors, one forward;
- `attention`: each row attending its own keys and values in the pool;
- this module: the engine's thread, the calls services make, and what a pass's end
  means for each work (logits, the next decode step, an error, a cancel)."""

import asyncio
import contextlib
import logging
import os
import threading
import time
from typing import AsyncIterator, Callable

import torch

from specdec.runtime import kernels
from specdec.runtime.engine.attention import Abandoned, check_supported
from specdec.runtime.engine.block_manager import BlockManager, KVPool
from specdec.runtime.engine.model_runner import ModelRunner
from specdec.runtime.engine.scheduler import Pass, Row, Scheduler, Work
from specdec.runtime.engine.sequence import PagedSequence
from specdec.errors import NeedsResync, Overloaded, RESYNC_DETAIL, Unavailable

log = logging.getLogger(__name__)

LOG_EVERY_S = 30.0
DEFAULT_THREADS = torch.get_num_threads()  # torch's default, one per core: before anything changes it
_one_thread_elsewhere = False


def one_thread_outside_engines() -> None:
    """Makes every thread of this process but an engine's run its operations on one
    core; call it before the model loads. libgomp's threads spin between two parallel
    operations only while the process has no more of them than cores; the pool a second
    thread leaves behind (the model loader's, the event loop's) makes each of a pass's
    ~200 parallel operations sleep and wake instead. Measured: docs/benchmarks.md#figures-behind-the-code."""
    global _one_thread_elsewhere
    _one_thread_elsewhere = True
    torch.set_num_threads(1)


def reproducible_blas() -> None:
    """Asks MKL, torch's BLAS for float32 products on x86 CPUs, for its reproducible mode
    (`MKL_CBWR=AUTO,STRICT`), in which a row of a product of one shape gets the same bits
    wherever it lies in it. Batch-invariant passes (`batch_invariant`) rely on that for
    a model's float32 products on a CPU: by default MKL computed the last rows of an 8-row
    product otherwise on an AMD EPYC VM (a verify pass's tokens 37 of 40 apart from their
    one-token steps, 4 of 8 batched rows apart from each alone; none with the mode), though
    not on the Intel VMs measured. MKL reads the setting at its first call, so this must
    come before the model loads; an MKL_CBWR set by the user stays."""
    os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")


async def _through_cancels(future: asyncio.Future) -> None:
    """Waits until `future` is done, even when the caller is cancelled again meanwhile (a
    client's cancel, then the server's shutdown): called while a cancel is handled, whose
    CancelledError the caller goes on raising."""
    while not future.done():
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait([future])


def _run_posts(calls: list[tuple[Callable, object]]) -> None:
    for call, arg in calls:
        call(arg)


def _closed() -> NeedsResync:
    return NeedsResync(f"the session was closed during the call; {RESYNC_DETAIL}")


class Engine:
    """Runs one model for all sessions of a service; see the module docstring."""

    def __init__(self, model, kv_cache_bytes: int, max_batch_rows: int = 64, max_batch_tokens: int = 256,
                 max_waiting: int = 64, block_size: int = 16, gather: float = 0.25, threads: int = 0,
                 metrics=None, prefix_caching: bool = True, cuda_graphs: bool | str = False,
                 batch_invariant: int = 0):
        if max_batch_rows < 1 or max_batch_tokens < 1:
            raise ValueError("max_batch_rows and max_batch_tokens must be >= 1")
        if not 0 <= batch_invariant <= 256:
            raise ValueError(f"batch_invariant must be 0 (off) or the tokens of every pass, 1 to 256; "
                             f"got {batch_invariant}")
        check_supported(model)
        self.model = model
        self.pool = KVPool(model.config, kv_cache_bytes, model.dtype, model.device, block_size)
        self.blocks = BlockManager(self.pool, metrics, prefix_caching)
        self.cond = threading.Condition()
        self.scheduler = Scheduler(self.blocks, self.cond, max_batch_rows, max_batch_tokens, gather)
        self.runner = ModelRunner(model, self.pool, self.scheduler.short, static=cuda_graphs,
                                  invariant=batch_invariant)
        self.max_waiting = max_waiting
        self.stopped = False
        self.failed: Unavailable | None = None  # the engine's thread failed outside a pass: every call fails
        self.pass_seconds = 0.0
        self.threads = threads or DEFAULT_THREADS  # intra-op threads of a pass
        # Totals, for the benchmark and the logs.
        self.passes = self.rows = self.tokens = 0
        self.busy_s = 0.0
        self.logged = (time.monotonic(), 0, 0, 0, 0.0)
        self.metrics = metrics  # specdec.metrics.EngineMetrics, or None
        # What a pass's picks hand to event loops, sent as one wake-up a loop (`_post`).
        self.posts: dict[asyncio.AbstractEventLoop, list[tuple[Callable, object]]] = {}
        self.posts_lock = threading.Lock()
        if metrics is not None:
            metrics.follow(queue=lambda: sum(not w.in_pass for w in list(self.queue)),
                           waiting=lambda: sum(not w.seq.admitted and not w.in_pass for w in list(self.queue)),
                           kv_used=lambda: self.blocks.used, kv_total=self.pool.capacity)
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

    @property
    def queue(self) -> list[Work]:
        return self.scheduler.queue

    @property
    def numerics(self) -> str:
        """How this engine's passes compute (quantization, dtype, device type, code path):
        what replicas that a session moves between must share. Not the thread count: a
        row's bits do not depend on it."""
        from specdec.runtime.quantize import method_of

        runner = self.runner
        forward = getattr(runner.forward, "func", runner.forward).__name__
        path = {"_layer_kernel_forward": "layer-kernel", "_llama_forward": "llama"}.get(forward, "transformers")
        if runner.static is not None and runner.static.capture:
            path += "+cuda-graphs"
        if runner.static is not None and runner.static.compiled is not None:
            path += "+compiled"
        if runner.static is not None and runner.static.invariant:
            path += f"+invariant-{runner.static.invariant}"
        return f"{method_of(self.model)}/{str(self.model.dtype).removeprefix('torch.')}/{self.model.device.type}/{path}"

    @property
    def evictions(self) -> int:
        return self.blocks.evictions

    def new_sequence(self) -> PagedSequence:
        return PagedSequence(self)

    # -- calls (any thread) --------------------------------------------------------------

    def submit(self, seq: PagedSequence, last: int, again: bool = True, then=None, layers: tuple[int, ...] = (),
               logits_last: int | None = None) -> Work:
        """Queues work; `again`: the caller will be back with more right after this one
        (the next pass may wait a little for it); `then`: see Work; `layers`: the target's
        features at these layers come with the logits (Plan.feature_layers), and with
        `logits_last`, logits only for that many of the last `last` positions."""
        with self.cond:
            if self.failed is not None:
                raise self.failed
            if seq.released:  # closed while the call waited for it: nothing may be admitted for it
                raise _closed()
            if not self.blocks.fits(seq):
                raise Overloaded(f"the session holds {len(seq.tokens)} tokens; the KV pool holds "
                                 f"{self.pool.capacity * self.pool.block_size}")
            if not seq.admitted:
                waiting = self.scheduler.waiting()
                if not (waiting == 0 and self.blocks.admit(seq, len(seq.tokens) - last)) \
                        and waiting >= self.max_waiting:
                    raise Overloaded(f"{waiting} sessions are waiting for KV memory")
            seq.cached = min(seq.cached, len(seq.tokens) - last)  # logits come from computing those positions
            self.blocks.crop(seq)  # never into a cached block
            work = self.scheduler.add(seq, last, again, then, tuple(layers), logits_last)
            self.cond.notify()
        return work

    async def forward(self, seq: PagedSequence, last: int, again: bool = True, layers: tuple[int, ...] = (),
                      logits_last: int | None = None):
        """Logits after each of the last `last` tokens of seq ([last, vocab]), and the
        pass that finished them; with `layers`, the features at those positions too
        ([last, len(layers) * hidden], the layers in the order given), and with
        `logits_last`, the logits of only that many of them."""
        work = self.submit(seq, last, again, layers=layers, logits_last=logits_last)
        done = asyncio.wrap_future(work.future)
        try:
            return await asyncio.shield(done)
        except asyncio.CancelledError:
            # The caller goes, but the session must not change under a pass that holds it.
            self.cancel(work)
            await _through_cancels(done)
            if not done.cancelled():
                done.exception()  # nobody wants it now
            raise

    async def decode(self, seq: PagedSequence, pick: Callable[[torch.Tensor], tuple[list[int], list[int], bool]],
                     layers: tuple[int, ...] = (), last: int = 1
                     ) -> AsyncIterator[tuple]:
        """The target alone, a pass at a time: pick(logits after the last token and after
        each draft the step before gave [1 + drafts, vocab]) gives the tokens the pass
        commits (the drafts it keeps, then its own), the drafts to check in the next pass
        (tokens the caller knows are likely, such as a grammar's forced ones) and whether
        to go on. Drafts it does not keep leave the sequence; the committed tokens and the
        drafts join it, and the session the next pass, on the engine's thread: no hand-off
        to the caller between passes, whose cost (a thread switch, the caller's own work)
        would fall on every token. Yields each (token, pass) as it is committed; the last
        token is not computed. With `layers` (no drafts then): (token, pass, features),
        the features of the positions the pass computed (the first pass: the last `last`
        of the sequence; then one a pass)."""
        loop = asyncio.get_running_loop()
        picked: asyncio.Queue = asyncio.Queue()
        pending: list[int] = []  # the drafts the running pass checks

        def then(logits: torch.Tensor, done: Pass, features: torch.Tensor | None) -> bool:
            nonlocal pending
            tokens, drafts, go_on = pick(logits[-1 - len(pending):])
            if len(tokens) - 1 < len(pending):  # the drafts it did not keep leave the sequence
                keep = len(seq.tokens) - len(pending) + len(tokens) - 1
                seq.tokens = seq.tokens[:keep]
                self.crop(seq, keep)
            if drafts and layers:
                raise ValueError("a decode that returns features checks no drafts")
            seq.extend(tokens[-1:] + drafts)
            work.last, work.logits_last, pending = 1 + len(drafts), None, drafts
            for token in tokens:
                self._post(loop, picked.put_nowait, (token, done, features) if layers else (token, done))
            return go_on

        work = self.submit(seq, last, then=then, layers=layers, logits_last=1)  # a pick reads the last
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
                await _through_cancels(finished)
            if not finished.cancelled():
                finished.exception()  # nobody wants it now

    def forward_now(self, seq: PagedSequence, last: int) -> tuple[torch.Tensor, Pass]:
        """`forward` for a caller that is not on an event loop (warm-up, benchmarks)."""
        return self.submit(seq, last).future.result()

    def cancel(self, work: Work) -> None:
        with self.cond:
            work.cancelled = True
            if work.in_pass:
                self.runner.stop_if_abandoned()
            elif work in self.queue:
                self._finish(work)
                self.cond.notify()

    def crop(self, seq: PagedSequence, length: int) -> None:
        """Forget cached positions from `length` on and the blocks the tokens no longer need."""
        with self.cond:
            seq.cached = min(seq.cached, length)
            if self.blocks.crop(seq):
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
                self.blocks.evict(seq)
            self.cond.notify()

    def stop(self) -> None:
        """Ends the engine's thread after the pass it is in, and waits for that. A process
        must not exit with the thread in a pass: CPython ends a daemon thread that takes the
        interpreter's lock back during exit with pthread_exit, whose unwinding through the
        noexcept frame of a torch or kernel call that had let the lock go aborts the process
        ("terminate called without an active exception")."""
        with self.cond:
            self.stopped = True
            self.cond.notify_all()
        if threading.current_thread() is not self.thread:
            self.thread.join()

    # -- the engine's thread ---------------------------------------------------------------

    def _loop(self, threads_set: threading.Event) -> None:
        try:
            self._serve(threads_set)
        except Exception as err:  # outside a forward pass: the engine's own state is in doubt
            log.exception("the engine's thread failed: every call fails from now on")
            with self.cond:
                self.failed = Unavailable(f"the model's engine failed ({type(err).__name__}: {err}); "
                                          "restart the service")
                self.stopped = True
                for work in list(self.queue):
                    work.in_pass = False
                    if work.future.done():
                        self.queue.remove(work)
                    else:
                        self._finish(work, error=self.failed)
                self.cond.notify_all()

    def _serve(self, threads_set: threading.Event) -> None:
        torch.set_grad_enabled(False)
        # A thread takes torch's default at its first call; take it now, so that a later
        # change of the default (one_thread_outside_engines) leaves this thread's alone.
        torch.get_num_threads()
        torch.set_num_threads(self.threads)
        kernels.take_threads()  # and the kernels take it too, before the default can change
        threads_set.set()
        coming: set[PagedSequence] = set()  # sessions of the last pass that said they would be back
        while True:
            with self.cond:
                while True:
                    if self.stopped:
                        return
                    if self.queue:
                        self.scheduler.gather_coming(coming, self.pass_seconds, lambda: self.stopped)
                        batch = self.scheduler.schedule()
                        if self._refuse():
                            continue  # their blocks are free now: schedule again
                        if batch:
                            break
                    self._send_posts()
                    self.cond.wait()
                for row in batch:
                    row.work.in_pass = True
                coming = {row.work.seq for row in batch if row.work.again}
            self._send_posts()  # see _post
            started = time.perf_counter()
            try:
                (logits, features), error = self.runner.run(batch), None
            except Abandoned:
                logits, features, error = None, None, None
            except Exception as err:  # a failed pass fails its rows, never the engine
                log.exception("forward pass of %d rows failed", len(batch))
                logits, features, error = None, None, err
            done = Pass(len(batch), sum(row.n for row in batch), time.perf_counter() - started)
            with self.cond:
                done.free_blocks, done.waiting = self.blocks.available, self.scheduler.waiting()
                deciding = self._commit(batch, logits, features, error, done)
            if deciding:
                # Decode steps pick their tokens outside the lock: a pick (softmax, sampling, a
                # copy to the host) must not hold up the calls of the service's event loop.
                decided = [(work, logits, *self._pick(work, logits, feats, done)) for work, logits, feats in deciding]
                with self.cond:
                    for outcome in decided:
                        self._picked(*outcome, done)

    def _refuse(self) -> bool:
        """Fails the work whose session outgrew the whole pool (a decode's tokens: a call's
        are checked at submit), and frees its blocks; -> whether there was any."""
        refused, self.scheduler.refused = self.scheduler.refused, []
        for work in refused:
            self.blocks.evict(work.seq)
            self._finish(work, error=Overloaded(f"the session holds {len(work.seq.tokens)} tokens; the KV pool "
                                                f"holds {self.pool.capacity * self.pool.block_size}"))
        return bool(refused)

    def _commit(self, batch: list[Row], logits: torch.Tensor | None, features: dict | None,
                error: Exception | None, done: Pass) -> list[tuple[Work, torch.Tensor, torch.Tensor | None]]:
        """A pass's end for each of its works; -> the decode steps whose token is to be
        picked (still marked in the pass, so that nothing frees their session meanwhile)."""
        self._count(done, error)
        kept = kept_logits = 0
        deciding = []
        for row in batch:
            work, seq = row.work, row.work.seq
            work.in_pass = False
            if seq.released:
                self._finish(work, error=_closed())
                self.blocks.evict(seq)  # closed during the pass: its blocks are free now
            elif error is not None:
                self.blocks.evict(seq)  # its cache is in doubt: it recomputes from its tokens
                self._finish(work, error=error)
            elif logits is None:  # abandoned (every row cancelled): what it wrote past row.start is not counted
                self._finish(work)
            else:
                picked = self._keep(row, logits[kept_logits:kept_logits + row.logit_rows], features, kept, done)
                if picked is not None:
                    deciding.append(picked)
            kept += row.wanted
            kept_logits += row.logit_rows
        self.cond.notify()
        return deciding

    def _keep(self, row: Row, logits: torch.Tensor, features: dict | None, kept: int, done: Pass):
        """A row's logits (and features, from `kept` on) kept with its work; a work that
        has all it asked for ends, or -> (work, logits, features) where its token is to
        be picked."""
        work, seq = row.work, row.work.seq
        seq.cached = row.start + row.n
        self.blocks.computed(seq)
        if row.start <= len(seq.tokens) - work.last:
            # This row computes from the first wanted position on: logits of earlier
            # passes are of a cache since preempted (recomputed now), not to be kept twice.
            work.parts, work.feature_parts = [], []
        work.parts.append(logits)
        if work.layers:
            work.feature_parts.append(torch.cat([features[layer][kept:kept + row.wanted]
                                                 for layer in work.layers], dim=-1))
        if work.cancelled:
            self._finish(work)
        elif work.remaining == 0:
            finished = work.parts[0] if len(work.parts) == 1 else torch.cat(work.parts)
            feats = torch.cat(work.feature_parts) if work.layers else None
            if work.then is not None:
                work.in_pass = True
                return work, finished, feats
            self._finish(work, result=(finished, done, feats) if work.layers else (finished, done))
        return None

    def _count(self, done: Pass, error: Exception | None) -> None:
        """A pass into the engine's counters, metrics and periodic log line."""
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
                     (now - self.logged[0]), len(self.blocks.holders), self.blocks.used,
                     self.pool.capacity, self.scheduler.waiting())
            self.logged = (now, self.passes, self.rows, self.tokens, self.busy_s)

    @staticmethod
    def _pick(work: Work, logits: torch.Tensor, features: torch.Tensor | None, done: Pass
              ) -> tuple[bool, Exception | None]:
        """Without the lock: -> (go on decoding, the pick's error)."""
        try:
            return work.then(logits, done, features), None
        except Exception as err:  # the caller's pick failed: its work ends, never the engine
            return False, err

    def _post(self, loop: asyncio.AbstractEventLoop, call: Callable, arg) -> None:
        """call(arg) on `loop`, with the pass's other posts to it, sent as the next pass
        starts (or the engine waits, or a work ends: a loop runs a work's end after its
        tokens). A wake-up a token took a share of the engine's thread that one a pass does
        not; a wake-up still costs the engine's thread the time the loop's thread then
        holds the interpreter's lock, and a thread of their own to send them measured no
        better (docs/benchmarks.md#the-engines-hand-off-to-the-event-loop-on-a-cpu)."""
        with self.posts_lock:
            self.posts.setdefault(loop, []).append((call, arg))

    def _send_posts(self) -> None:
        with self.posts_lock:
            if not self.posts:
                return
            posts, self.posts = self.posts, {}
        for loop, calls in posts.items():
            with contextlib.suppress(RuntimeError):  # a loop closed meanwhile: nobody waits there
                loop.call_soon_threadsafe(_run_posts, calls)

    def _picked(self, work: Work, logits: torch.Tensor, go_on: bool, error: Exception | None, done: Pass) -> None:
        work.in_pass = False
        if work.seq.released:
            self._finish(work, error=_closed())
            self.blocks.evict(work.seq)  # closed during the pick: its blocks are free now
        elif error is not None:
            self._finish(work, error=error)
        elif work.cancelled:
            self._finish(work)
        elif go_on:  # the token just picked is the work's next pass
            work.parts, work.feature_parts = [], []
        else:
            self._finish(work, result=(logits, done))

    def _finish(self, work: Work, result=None, error: Exception | None = None) -> None:
        """Takes the work off the queue and answers it (a cancel without result or error)."""
        self._send_posts()  # its tokens first
        if work in self.queue:
            self.queue.remove(work)
        if error is not None:
            work.future.set_exception(error)
        elif result is not None:
            work.future.set_result(result)
        else:
            work.future.cancel()
