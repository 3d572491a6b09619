"""The batching engine against a fresh forward of the same model: rollback by position,
rows of different lengths in one pass, chunked prefill, memory admission and
preemption, cancels, failed passes, and every block given back."""

import asyncio
import copy
import subprocess
import sys
import threading
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from cluster import as_tested
from passes import logits_by_forward
from specdec.runtime.engine import Engine, TokenSequence
from specdec.runtime.engine.block_manager import prefix_digests
from specdec.errors import NeedsResync, Overloaded

VOCAB = 300


@pytest.fixture(scope="module")
def models():
    """(model for the engine, the same weights for fresh reference forwards)"""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         initializer_range=0.1)
    model = LlamaForCausalLM(config).eval()
    reference = LlamaForCausalLM(copy.deepcopy(config)).eval()  # the engine sets its model's attention
    reference.load_state_dict(model.state_dict())
    return as_tested(model), as_tested(reference)


def engine(models, kv_bytes=1 << 20, **kwargs) -> Engine:
    return Engine(models[0], kv_bytes, **kwargs)


def fresh(models, tokens, last):
    with torch.no_grad():
        return models[1](torch.tensor([tokens], device=models[1].device)).logits[0, -last:]


def tokens(n, seed):
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_sync_keeps_the_matching_prefix():
    seq = TokenSequence()
    assert seq.sync(0, [1, 2, 3, 4]) == 0
    assert seq.sync(2, [3, 9]) == 3  # [3] matched, [4] replaced by [9]
    assert seq.tokens == [1, 2, 3, 9]


def test_sync_beyond_what_is_held_needs_resync():
    seq = TokenSequence()
    seq.sync(0, [1, 2])
    with pytest.raises(NeedsResync):
        seq.sync(3, [4])


def test_rollback_by_position_gives_the_same_logits(models):
    eng = engine(models)
    seq = eng.new_sequence()
    seq.sync(0, [10, 20, 30, 40])
    eng.forward_now(seq, 1)
    seq.extend([50, 60, 70])          # drafts
    eng.forward_now(seq, 4)
    assert seq.cached == 7
    seq.sync(4, [50, 61])             # one draft accepted, then a correction
    assert seq.cached == 5
    close(eng.forward_now(seq, 1)[0], fresh(models, [10, 20, 30, 40, 50, 61], 1))
    seq.sync(0, [10, 20, 99])         # a resync with a different history
    close(eng.forward_now(seq, 2)[0], fresh(models, [10, 20, 99], 2))
    # A call whose tokens are all cached still gets its logits (the positions are recomputed).
    close(eng.forward_now(seq, 2)[0], fresh(models, [10, 20, 99], 2))


def test_rows_of_different_lengths_share_one_pass(models):
    eng = engine(models, max_batch_tokens=512)
    lengths = [1, 3, 17, 40, 5]
    seqs = [eng.new_sequence() for _ in lengths]
    for i, (seq, n) in enumerate(zip(seqs, lengths)):
        seq.sync(0, tokens(n, i))
        eng.forward_now(seq, 1)  # prefill each alone
    for seq in seqs:
        seq.extend([7, 8, 9])        # three drafts each
    with eng.cond:                   # hold the engine so that all five are ready together
        works = [eng.submit(seq, 4) for seq in seqs]
    passes = eng.passes
    for seq, work in zip(seqs, works):
        logits, done = work.future.result()
        assert done.rows == len(seqs) and done.tokens == 4 * len(seqs)  # the last committed token and 3 drafts
        close(logits, fresh(models, seq.tokens, 4))
    assert eng.passes == passes + 1


def test_one_row_batched_or_alone_is_the_same_row(models):
    """Batch invariance, as far as this CPU's kernels give it: measured, not assumed."""
    eng = engine(models)
    alone, crowd = eng.new_sequence(), [eng.new_sequence() for _ in range(7)]
    alone.sync(0, tokens(30, 99))
    eng.forward_now(alone, 1)
    for i, seq in enumerate(crowd):
        seq.sync(0, tokens(10 + 7 * i, i))
        eng.forward_now(seq, 1)
    alone.extend([1, 2, 3])
    by_itself = eng.forward_now(alone, 4)[0]
    alone.sync(30, [1, 2, 3])  # rolled back and the same drafts again
    for seq in crowd:
        seq.extend([4, 5, 6])
    with eng.cond:
        works = [eng.submit(alone, 4)] + [eng.submit(seq, 4) for seq in crowd]
    batched, done = works[0].future.result()
    assert done.rows == 8
    close(batched, by_itself)
    assert torch.equal(batched.argmax(-1), by_itself.argmax(-1))


def test_long_prefill_runs_in_chunks_between_rounds(models):
    eng = engine(models, max_batch_tokens=32)  # rounds of <= 8 tokens go whole, prefills in chunks
    running = eng.new_sequence()
    running.sync(0, tokens(12, 1))
    eng.forward_now(running, 1)
    long = eng.new_sequence()
    long.sync(0, tokens(200, 2))
    with eng.cond:
        prefill = eng.submit(long, 1)
        running.extend([3, 4])
        rounds = [eng.submit(running, 2)]
    rounds[0].future.result()
    rounds_done = 1
    while not prefill.future.done():  # the running stream keeps getting rounds meanwhile
        running.sync(len(running.tokens) - 1, [5])
        running.extend([6])
        eng.forward_now(running, 2)
        rounds_done += 1
    logits, done = prefill.future.result()
    close(logits, fresh(models, long.tokens, 1))
    close(eng.forward_now(running, 1)[0], fresh(models, running.tokens, 1))
    assert rounds_done >= 3, rounds_done  # 200 tokens in chunks of at most 32 take several passes
    assert done.tokens <= 32 + 8


def test_memory_admission_waits_and_preempts_by_recompute(models):
    # Room for 8 blocks of 16 tokens.
    per_token = 2 * 2 * 2 * 16 * 4
    eng = engine(models, kv_bytes=9 * 16 * per_token, max_waiting=1)
    assert eng.pool.capacity == 8
    old, new = eng.new_sequence(), eng.new_sequence()
    old.sync(0, tokens(60, 1))               # 4 blocks
    eng.forward_now(old, 1)
    new.sync(0, tokens(60, 2))               # 4 blocks: the pool is full
    eng.forward_now(new, 1)
    assert not eng.blocks.available
    # The older session grows: the newer one gives its blocks back.
    old.extend(tokens(10, 3))
    close(eng.forward_now(old, 1)[0], fresh(models, old.tokens, 1))
    assert new.cached == 0 and not new.blocks and eng.evictions == 1
    # The newer one waits for memory, then recomputes and is exact.
    waiting = eng.submit(new, 1)
    third = eng.new_sequence()
    third.sync(0, tokens(20, 4))
    with pytest.raises(Overloaded, match="waiting for KV memory"):
        eng.submit(third, 1)                 # the waiting queue (1) is full
    assert not waiting.future.done()
    eng.release(old)
    close(waiting.future.result(timeout=30)[0], fresh(models, new.tokens, 1))
    huge = eng.new_sequence()
    huge.sync(0, tokens(8 * 16 + 1, 5))
    with pytest.raises(Overloaded, match="KV pool holds"):
        eng.submit(huge, 1)
    eng.release(new)
    assert eng.blocks.available == eng.pool.capacity


def test_cancel_leaves_the_session_consistent(models):
    eng = engine(models, max_batch_tokens=16)
    seq = eng.new_sequence()
    seq.sync(0, tokens(400, 6))  # 25 chunks: the cancel lands inside one

    async def go():
        task = asyncio.ensure_future(eng.forward(seq, 1))
        deadline = asyncio.get_running_loop().time() + 10
        while not any(w.in_pass for w in list(eng.queue)):  # cancel it inside a pass: the path under test
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not any(w.in_pass for w in eng.queue) and not eng.queue
        seq.sync(50, tokens(5, 7))
        return await eng.forward(seq, 2)

    logits, _ = asyncio.run(go())
    close(logits, fresh(models, seq.tokens, 2))


def test_a_failed_pass_fails_its_rows_and_the_next_call_is_exact(models, monkeypatch):
    eng = engine(models)
    seq = eng.new_sequence()
    seq.sync(0, tokens(20, 8))
    eng.forward_now(seq, 1)
    real = eng.runner.run
    monkeypatch.setattr(eng.runner, "run", lambda batch: (_ for _ in ()).throw(RuntimeError("out of memory")))
    seq.extend([1, 2])
    with pytest.raises(RuntimeError, match="out of memory"):
        eng.forward_now(seq, 3)
    assert seq.cached == 0 and not seq.blocks  # dropped: its cache is in doubt
    monkeypatch.setattr(eng.runner, "run", real)
    close(eng.forward_now(seq, 3)[0], fresh(models, seq.tokens, 3))


def test_every_block_comes_back(models):
    eng = engine(models)
    seqs = [eng.new_sequence() for _ in range(6)]
    for i, seq in enumerate(seqs):
        seq.sync(0, tokens(5 + 11 * i, i))
    with eng.cond:
        works = [eng.submit(seq, 1) for seq in seqs]
    eng.release(seqs[0])  # closed while waiting
    for work in works[1:]:
        work.future.result()
    with pytest.raises(NeedsResync):  # its caller resends the session
        works[0].future.result()
    for seq in seqs[1:]:
        eng.release(seq)
    assert eng.blocks.available == eng.pool.capacity and not eng.blocks.holders and not eng.queue


def hold_passes(eng, monkeypatch) -> tuple[threading.Event, threading.Event]:
    """Every pass waits, once it has started, for the gate -> (started, gate)."""
    started, gate = threading.Event(), threading.Event()
    real = eng.runner.run

    def held(batch):
        started.set()
        gate.wait(10)
        return real(batch)

    monkeypatch.setattr(eng.runner, "run", held)
    return started, gate


def test_sessions_closed_during_a_pass_do_not_fill_the_waiting_queue(models, monkeypatch):
    """A client cancel releases a session whose row is in the running pass; new sessions
    arriving meanwhile are admitted (memory is free), not refused as if it were full."""
    eng = engine(models, max_waiting=1)
    entered, gate = hold_passes(eng, monkeypatch)
    closing = eng.new_sequence()
    closing.sync(0, tokens(10, 1))
    work = eng.submit(closing, 1)
    assert entered.wait(10)
    eng.release(closing)
    others = []
    for i in range(3):
        seq = eng.new_sequence()
        seq.sync(0, tokens(10, 10 + i))
        others.append(eng.submit(seq, 1))
    gate.set()
    with pytest.raises(NeedsResync):
        work.future.result(10)
    for other in others:
        other.future.result(10)


def test_a_session_closed_during_a_pass_keeps_its_blocks_until_the_pass_ends(models, monkeypatch):
    """A cancelled request's session is closed while its row is in the running pass (seen
    in the soak test): the pass still writes to its blocks, so they must not go back to
    the pool, or to a newcomer, before it ends. The other rows of the pass are exact.
    (Before: its blocks went back at once, and the whole pass failed, or worse, wrote into
    blocks a newcomer held.)"""
    eng = engine(models)
    entered, gate = threading.Event(), threading.Event()
    real = eng.runner.run

    def slow(batch):
        entered.set()
        gate.wait(10)
        return real(batch)

    monkeypatch.setattr(eng.runner, "run", slow)
    closing, staying = eng.new_sequence(), eng.new_sequence()
    closing.sync(0, tokens(40, 21))
    staying.sync(0, tokens(30, 22))
    with eng.cond:  # both in one pass
        works = [eng.submit(closing, 1), eng.submit(staying, 2)]
    assert entered.wait(10)
    held = list(closing.blocks)
    eng.release(closing)
    assert closing.blocks == held and not set(held) & (set(eng.blocks.free) | set(eng.blocks.idle))
    newcomer = eng.new_sequence()
    newcomer.sync(0, tokens(50, 23))
    late = eng.submit(newcomer, 1)
    assert not set(held) & set(newcomer.blocks)
    gate.set()
    with pytest.raises(NeedsResync):
        works[0].future.result(10)
    close(works[1].future.result(10)[0], fresh(models, staying.tokens, 2))
    close(late.future.result(10)[0], fresh(models, newcomer.tokens, 1))
    assert not closing.blocks
    for seq in (staying, newcomer):
        eng.release(seq)
    assert eng.blocks.available == eng.pool.capacity


def greedy_reference(models, prompt, n):
    out = list(prompt)
    for _ in range(n):
        out.append(int(fresh(models, out, 1)[0].argmax()))
    return out[len(prompt):]


def test_decode_runs_the_target_alone_beside_other_rows(models):
    """Decode picks a token per pass on the engine's thread; each is what a fresh forward
    picks, while another session's rounds share the passes; it stops when pick says."""
    eng = engine(models)
    seq, other = eng.new_sequence(), eng.new_sequence()
    seq.sync(0, tokens(30, 10))
    other.sync(0, tokens(40, 11))
    rows_seen = []

    def pick(logits):
        token = int(logits[-1].argmax())
        return [token], [], len(seq.tokens) + 1 < 30 + 12

    async def rounds():
        for i in range(8):
            other.extend([i + 1, i + 2])
            await eng.forward(other, 3)

    async def go():
        task = asyncio.ensure_future(rounds())
        got = []
        async for token, done in seq.decode(pick):
            got.append(token)
            rows_seen.append(done.rows)
        await task
        return got

    got = asyncio.run(go())
    assert got == greedy_reference(models, tokens(30, 10), 12)
    assert seq.tokens[30:] == got and seq.cached == 30 + 11  # the last token is not computed
    assert max(rows_seen) == 2  # it shared passes with the other session
    eng.release(seq)
    eng.release(other)
    assert eng.blocks.available == eng.pool.capacity and not eng.queue


def test_decode_checks_the_drafts_a_pick_gives_and_drops_those_it_rejects(models):
    """A pick may give drafts for the next pass: the pass computes them with the token
    before, the pick gets their logits too, and the drafts it does not keep leave the
    sequence and the cache. Each pass's drafts here: the greedy answer's next two tokens
    with the second one wrong, so each pass keeps one draft and rejects the other; the
    output is still the target alone's, in fewer passes."""
    eng = engine(models)
    seq = eng.new_sequence()
    prompt = tokens(20, 21)
    want = greedy_reference(models, prompt, 14)
    seq.sync(0, prompt)
    pending, passes = [], []

    def pick(logits):
        nonlocal pending
        assert logits.shape[0] == 1 + len(pending)
        rows = logits.argmax(dim=-1).tolist()
        kept = 0
        while kept < len(pending) and pending[kept] == rows[kept]:
            kept += 1
        committed = pending[:kept] + [rows[kept]]
        done = len(seq.tokens) - len(pending) + len(committed) - len(prompt)
        go_on = done < len(want)
        pending = [want[done], (want[done + 1] + 1) % 256] if go_on and done + 2 < len(want) else []
        return committed, pending, go_on

    async def go():
        got = []
        async for token, done in seq.decode(pick):
            got.append(token)
            passes.append(done)
        return got

    got = asyncio.run(go())
    assert got == want
    assert len({id(p) for p in passes}) < len(want) * 2 // 3  # passes committed two tokens
    assert seq.tokens == prompt + want and seq.cached == len(seq.tokens) - 1
    close(fresh(models, seq.tokens, 1)[0], fresh(models, prompt + want, 1)[0])
    eng.release(seq)
    assert eng.blocks.available == eng.pool.capacity and not eng.queue


def test_decode_stopped_early_leaves_the_session_consistent(models):
    eng = engine(models)
    seq = eng.new_sequence()
    prompt = tokens(25, 12)
    seq.sync(0, prompt)

    async def go():
        got = []
        steps = seq.decode(lambda logits: ([int(logits[-1].argmax())], [], True))
        async for token, _ in steps:
            got.append(token)
            if len(got) == 3:
                break
        await steps.aclose()  # the caller went: the decoding stops
        assert not eng.queue
        held = len(seq.tokens)
        assert held >= 25 + 3 and seq.cached <= held
        seq.sync(25 + 3, [])  # the next call keeps what it read
        logits, _ = await eng.forward(seq, 1)
        return got, logits

    got, logits = asyncio.run(go())
    assert got == greedy_reference(models, prompt, 3)
    close(logits, fresh(models, prompt + got, 1))


def test_a_failing_pick_ends_its_decode_not_the_engine(models):
    eng = engine(models)
    seq = eng.new_sequence()
    seq.sync(0, tokens(10, 13))
    picks = []

    def pick(logits):
        picks.append(1)
        if len(picks) == 3:
            raise ValueError("bad pick")
        return [int(logits[-1].argmax())], [], True

    async def go():
        got = []
        with pytest.raises(ValueError, match="bad pick"):
            async for token, _ in seq.decode(pick):
                got.append(token)
        return got

    assert len(asyncio.run(go())) == 2
    seq.sync(12, [])
    close(eng.forward_now(seq, 1)[0], fresh(models, seq.tokens, 1))


def test_a_decode_closed_at_its_yield_stops_before_its_closer_returns(models):
    """A server stream whose caller cancels is closed where it waits, at a yield: the
    verifier's decode generators must close the engine's decoding with them, so that
    nothing appends to the session once the next call may hold it."""
    from specdec.api.verifier.v1 import verifier_pb2
    from verifier_service.runs import decode

    eng = engine(models)
    seq, other = eng.new_sequence(), eng.new_sequence()
    other.sync(0, tokens(8, 6))
    prompt = tokens(20, 5)
    request = verifier_pb2.DecodeRequest(start=0, new_tokens=prompt, max_tokens=200)

    async def go():
        stream = decode(seq, request, 4096)
        got = [(await anext(stream)).token for _ in range(3)]
        await stream.aclose()  # GeneratorExit at its yield, as a cancelled call's stream gets
        assert not eng.queue
        held = len(seq.tokens)
        for _ in range(2):  # passes run after the close: a decode still queued would have joined them
            await other.logits(1)
            other.extend([7])
        assert len(seq.tokens) == held >= 20 + 3  # it may have run ahead of its reader, not on
        return got

    assert asyncio.run(go()) == greedy_reference(models, prompt, 3)



def test_a_decode_whose_reader_left_abandons_its_pass_at_the_next_layer(models):
    """The reader of a decode moves on (a lookup round cuts the run): the pass in flight
    computes a token nobody reads, and the next call waits for it. It stops at its next
    layer, keeps no part of what it wrote, and the session goes on from what was read."""
    eng = engine(models)
    seq = eng.new_sequence()
    prompt = tokens(20, 9)
    seq.sync(0, prompt)
    picks, gate, reached = [], threading.Event(), threading.Event()
    armed = [False]

    def pick(logits):
        picks.append(1)
        return [int(logits[-1].argmax())], [], True

    def hold(*_):
        if armed[0]:
            reached.set()
            gate.wait(10)

    hook = models[0].model.layers[1].input_layernorm.register_forward_pre_hook(hold)

    async def go():
        steps = seq.decode(pick)
        got = [(await anext(steps))[0] for _ in range(2)]
        armed[0] = True
        assert await asyncio.to_thread(reached.wait, 10)  # a pass is between its layers
        picked = len(picks)
        closing = asyncio.ensure_future(steps.aclose())
        while not (eng.queue and all(work.cancelled for work in eng.queue)):  # the close marks the work in the pass
            await asyncio.sleep(0.001)
        gate.set()
        await closing
        assert len(picks) == picked  # the held pass never finished
        assert seq.cached == len(seq.tokens) - 1 and not eng.queue
        seq.sync(len(prompt) + 2, [])  # the next call keeps what it read
        logits, _ = await eng.forward(seq, 1)
        return got, logits

    try:
        got, logits = asyncio.run(go())
    finally:
        hook.remove()
    assert got == greedy_reference(models, prompt, 2)
    close(logits, fresh(models, prompt + got, 1))


THREADS_SCRIPT = """
import threading, torch
from transformers import LlamaConfig, LlamaForCausalLM
from specdec.runtime import engine, quantize

engine.one_thread_outside_engines()
model = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2)).eval()
quantize.quantize(model, "int8")  # attention in float64: our kernel, a library of its own
in_pass = []
model.model.norm.register_forward_hook(lambda *_: in_pass.append(torch.get_num_threads()))
eng = engine.Engine(model, 1 << 20, threads=2)
assert eng.runner.kernel is not None
seq = eng.new_sequence()
seq.sync(0, [1, 2, 3])
eng.forward_now(seq, 1)
later = []
thread = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
thread.start()
thread.join()
print(in_pass[0], torch.get_num_threads(), later[0])
"""


def test_only_the_engines_thread_runs_a_pass_on_several_cores():
    # In a process of its own: it changes torch's threads for the whole process. A pass
    # runs on the threads asked for; the thread that made the engine, and a thread
    # started after it, run on one (a second OpenMP pool would slow every pass). The
    # count holds after the pass's first call into our kernels, whose library reads it
    # lazily from the process-wide setting (it read 1, the default set meanwhile).
    done = subprocess.run([sys.executable, "-c", THREADS_SCRIPT], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["2", "1", "1"]


STOP_SCRIPT = """
import sys, time, torch
from transformers import LlamaConfig, LlamaForCausalLM
from specdec.runtime.engine import Engine
config = LlamaConfig(vocab_size=300, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192)
engine = Engine(LlamaForCausalLM(config).eval(), 64 << 20, threads=4)
seq = engine.new_sequence()
seq.sync(0, [t % 300 for t in range(6000)])
work = engine.submit(seq, 1)
deadline = time.monotonic() + 60
while not work.in_pass and time.monotonic() < deadline:  # until the prefill's first pass has started
    time.sleep(0.001)
started = work.in_pass and not work.future.done()
engine.stop()
print(started, engine.thread.is_alive())
"""


def test_a_process_that_stops_its_engine_mid_pass_exits_cleanly():
    # Before Engine.stop waited for its thread, such an exit aborted the process at every try
    # here ("terminate called without an active exception": see Engine.stop).
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", STOP_SCRIPT], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.split() == ["True", "False"]


def test_a_session_with_a_known_prefix_computes_only_the_rest(models):
    """Prefix caching: the full blocks of a prompt that another session computed (a
    system prompt; a chat's earlier turns) are taken as they are, and never written."""
    eng = engine(models)  # blocks of 16 tokens
    first, second = eng.new_sequence(), eng.new_sequence()
    prefix = tokens(36, 40)
    first.sync(0, prefix + tokens(4, 41))
    eng.forward_now(first, 1)
    second.sync(0, prefix + tokens(10, 42))
    logits, done = eng.forward_now(second, 2)
    close(logits, fresh(models, second.tokens, 2))
    assert second.blocks[:2] == first.blocks[:2]  # 32 tokens shared: two full blocks
    assert done.tokens == len(second.tokens) - 32 and eng.blocks.reused_tokens == 32
    # The first rolls back into a shared block: it computes those positions into its own.
    shared = second.blocks[1]
    first.sync(20, tokens(8, 43))
    close(eng.forward_now(first, 3)[0], fresh(models, first.tokens, 3))
    assert first.blocks[1] != shared and second.blocks[1] == shared
    second.extend(tokens(3, 44))
    close(eng.forward_now(second, 4)[0], fresh(models, second.tokens, 4))
    # Released, the blocks keep what they hold until the memory is needed: a later
    # session with the same prefix still finds them.
    eng.release(first)
    eng.release(second)
    assert eng.blocks.available == eng.pool.capacity
    third = eng.new_sequence()
    third.sync(0, prefix + tokens(5, 45))
    logits, done = eng.forward_now(third, 1)
    close(logits, fresh(models, third.tokens, 1))
    assert done.tokens == len(third.tokens) - 32


def test_a_prefix_hit_whose_key_collides_serves_nothing_of_another_prompt(models):
    """A block registered under the key of another prompt's first block (a client that
    found a second preimage of the key) is not taken: a hit compares the block's own
    tokens. (Before: keys were Python's hash of the tokens, a hit compared nothing, and
    the second session was served the first's keys and values.)"""
    eng = engine(models)
    first, second = eng.new_sequence(), eng.new_sequence()
    first.sync(0, tokens(20, 46))
    eng.forward_now(first, 1)
    forged = prefix_digests(tokens(20, 47)[:16], 16)[0]  # the key the second prompt's block has
    with eng.cond:  # as if first's block had been registered under it
        eng.blocks.cached[forged] = first.blocks[0]
        eng.blocks.hash_of[first.blocks[0]] = forged
    second.sync(0, tokens(20, 47))
    logits, done = eng.forward_now(second, 1)
    assert eng.blocks.reused_tokens == 0 and done.tokens == 20
    close(logits, fresh(models, second.tokens, 1))


def test_prefix_keys_are_digests_of_every_token_before():
    a = prefix_digests(list(range(48)), 16)
    assert len(a) == 3 and all(isinstance(h, bytes) and len(h) == 32 for h in a)  # SHA-256
    assert prefix_digests(list(range(48)), 16, a[:1]) == a
    b = prefix_digests([99] + list(range(1, 48)), 16)
    assert all(x != y for x, y in zip(a, b))  # a changed first token changes every later key


@pytest.mark.parametrize("where", ["schedule", "_commit", "_picked"])
def test_an_error_outside_the_pass_fails_every_call_instead_of_hanging(models, monkeypatch, where):
    """The engine's thread raising outside the forward (its scheduling, a pass's commit, a
    decode's pick): the calls waiting on it and every later call fail with UNAVAILABLE.
    (Before: the thread died, and every caller waited forever.)"""
    from concurrent.futures import TimeoutError as Timeout

    from specdec.errors import Unavailable

    eng = engine(models)
    target = eng.scheduler if where == "schedule" else eng

    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(target, where, broken)
    seq = eng.new_sequence()
    seq.sync(0, tokens(10, 48))
    if where == "_picked":
        async def decode():
            async for _ in seq.decode(lambda logits: ([int(logits[-1].argmax())], [], True)):
                pass

        with pytest.raises(Unavailable, match="engine failed"):
            asyncio.run(asyncio.wait_for(decode(), 10))
    else:
        with pytest.raises(Unavailable, match="engine failed"):
            try:
                eng.submit(seq, 1).future.result(timeout=10)
            except Timeout:
                pytest.fail("the call was never answered")
    other = eng.new_sequence()
    other.sync(0, tokens(5, 49))
    with pytest.raises(Unavailable):
        eng.submit(other, 1)


def test_a_reserve_that_cannot_succeed_evicts_nobody():
    """(Before: it evicted every newer session, then failed anyway.)"""
    from specdec.runtime.engine.block_manager import BlockManager, KVPool
    from specdec.runtime.engine.sequence import PagedSequence

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=1, num_attention_heads=4)
    pool = KVPool(config, 5 * 16 * 2 * 64 * 4, torch.float32, "cpu")  # 4 blocks a session can get
    blocks = BlockManager(pool, prefix_caching=False)
    old, new = PagedSequence(None), PagedSequence(None)
    old.tokens, new.tokens = list(range(32)), list(range(16))
    assert blocks.admit(old, 0) and blocks.admit(new, 0) and blocks.available == 1
    old.cached, new.cached = 32, 16  # computed
    assert not blocks.reserve(old, 64, set())  # 4 more blocks: the free one and new's are not enough
    assert new.blocks and blocks.evictions == 0
    assert blocks.reserve(old, 32, set())  # 2 more: new's block and the free one
    assert not new.blocks and blocks.evictions == 1


def test_a_decode_that_outgrows_the_pool_fails_and_stalls_nobody(models):
    """A session decoding past what the whole pool holds fails RESOURCE_EXHAUSTED, and
    gives its blocks back. (Before: it stayed queued, holding the pool; every later
    session waited for it until its deadline.)"""
    from specdec.errors import Overloaded

    per_token = 2 * 2 * 2 * 16 * 4
    eng = engine(models, kv_bytes=5 * 16 * per_token)  # 4 blocks of 16 tokens a session can get
    assert eng.pool.capacity == 4
    growing, later = eng.new_sequence(), eng.new_sequence()
    growing.sync(0, tokens(60, 53))

    async def go():
        async def decode():
            async for _ in growing.decode(lambda logits: ([int(logits[-1].argmax())], [], True)):
                pass

        with pytest.raises(Overloaded, match="KV pool"):
            await asyncio.wait_for(decode(), 10)
        later.sync(0, tokens(10, 54))
        return await asyncio.wait_for(later.logits(1), 10)

    logits, _ = asyncio.run(go())
    close(logits, fresh(models, later.tokens, 1))
    assert not growing.blocks


@pytest.mark.parametrize("call", ["forward", "decode"])
def test_a_call_cancelled_twice_still_waits_for_the_pass_that_holds_its_session(models, monkeypatch, call):
    """A handler cancelled a second time while its pass runs (a client's cancel, then the
    server's shutdown) must not return before the pass lets its session go: the next call
    would crop blocks the pass is writing. (Before: the second cancel ended the wait.)"""
    eng = engine(models)
    running, release = hold_passes(eng, monkeypatch)
    seq = eng.new_sequence()
    seq.sync(0, tokens(10, 55))

    async def go():
        async def decode():
            async for _ in seq.decode(lambda logits: ([int(logits[-1].argmax())], [], True)):
                pass

        task = asyncio.ensure_future(seq.logits(1) if call == "forward" else decode())
        assert await asyncio.to_thread(running.wait, 10)
        task.cancel()

        async def cancel_taken():  # the handler has marked its work cancelled, and waits for the pass
            while not all(work.cancelled for work in eng.queue):
                await asyncio.sleep(0.01)

        await asyncio.wait_for(cancel_taken(), 5)
        task.cancel()  # again, while the pass still holds the session
        done, _ = await asyncio.wait({task}, timeout=0.5)  # (before: it ended here at once)
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        return bool(done)

    assert asyncio.run(go()) is False


def test_without_prefix_caching_every_session_computes_its_prompt(models):
    eng = engine(models, prefix_caching=False)
    prefix = tokens(40, 50)
    for seed in (51, 52):
        seq = eng.new_sequence()
        seq.sync(0, prefix + tokens(3, seed))
        _, done = eng.forward_now(seq, 1)
        assert done.tokens == len(seq.tokens)
    assert eng.blocks.reused_tokens == 0


@pytest.mark.parametrize("numerics", ["none", "int8"])
def test_llama_models_skip_transformers_plumbing_to_the_same_bits(models, numerics):
    """The engine's own pass of a Llama model (its modules, without transformers'
    plumbing; q, k and v as one product when quantized) against transformers' forward of
    the same pass: the same logits, bit for bit, for rows of several lengths."""
    from specdec.runtime.engine import model_runner
    from specdec.runtime.quantize import method_of, quantize

    if method_of(models[0]) != "none":
        pytest.skip("this suite's models are quantized already (the default suite runs both cases)")
    if numerics != "none" and models[0].device.type != "cpu":
        pytest.skip(f"--quantize {numerics} is the CPU path")
    model = quantize(copy.deepcopy(models[0]), numerics)
    eng = engine((model, None))
    assert eng.runner.forward is model_runner._llama_forward
    seqs = [eng.new_sequence() for _ in range(3)]
    for i, seq in enumerate(seqs):
        seq.sync(0, tokens(9 + 7 * i, 60 + i))
    outputs = logits_by_forward(eng, seqs, (model_runner._llama_forward, model_runner._transformers_forward))
    for ours, theirs in zip(*outputs):
        assert torch.equal(ours, theirs)


def test_a_call_preempted_between_its_chunks_returns_exactly_its_logits(models, monkeypatch):
    """A long call whose wanted positions straddle a chunk boundary, evicted between its
    chunks (an older session grows into a full pool): the recompute must not add the
    first chunk's logits a second time. (Before: 40 rows came back for 36 wanted, the
    acceptance rule reading shifted logits.)"""
    per_token = 2 * 2 * 2 * 16 * 4
    eng = engine(models, kv_bytes=5 * 16 * per_token, max_batch_tokens=8)  # 4 blocks of 16; chunks of 8
    assert eng.pool.capacity == 4
    old, new = eng.new_sequence(), eng.new_sequence()
    old.sync(0, tokens(16, 70))
    eng.forward_now(old, 1)                       # 1 block
    first_chunk, gate = threading.Event(), threading.Event()
    real = eng.runner.run

    def run(batch):
        out = real(batch)
        if any(row.work.seq is new for row in batch) and not first_chunk.is_set():
            first_chunk.set()
            gate.wait(10)                         # hold the engine after the first chunk
        return out

    monkeypatch.setattr(eng.runner, "run", run)
    new.sync(0, tokens(40, 71))
    work = eng.submit(new, 36)                    # 3 blocks: the pool is full; wanted from position 4
    assert first_chunk.wait(10)
    old.extend([5])                               # the older session needs a second block
    grows = eng.submit(old, 1)
    gate.set()
    close(grows.future.result(10)[0], fresh(models, old.tokens, 1))
    assert new.cached == 0 and not new.admitted   # preempted between its chunks
    eng.release(old)
    logits, _ = work.future.result(30)
    assert logits.shape[0] == 36
    close(logits, fresh(models, new.tokens, 36))


def test_a_call_on_a_closed_session_takes_no_blocks(models):
    """A call that waited on its session's lock while the session was closed: it is told
    to resend, and takes no blocks (before, it was admitted with fresh ones, which a
    cancel then left with a dead session)."""
    eng = engine(models)
    seq = eng.new_sequence()
    seq.sync(0, tokens(20, 80))
    eng.release(seq)
    with pytest.raises(NeedsResync):
        eng.submit(seq, 1)
    assert eng.blocks.available == eng.pool.capacity and not eng.blocks.holders and not eng.queue


def test_admission_is_first_come_first_served(models):
    """A session waiting for memory is not passed over by later, smaller ones (before,
    the scheduler skipped it and admitted whatever fitted behind it: a large prompt could
    wait for ever behind a stream of small newcomers)."""
    per_token = 2 * 2 * 2 * 16 * 4
    eng = engine(models, kv_bytes=9 * 16 * per_token)  # 8 blocks of 16
    holder, big, small = eng.new_sequence(), eng.new_sequence(), eng.new_sequence()
    holder.sync(0, tokens(60, 90))
    eng.forward_now(holder, 1)                     # 4 blocks held
    big.sync(0, tokens(90, 91))                    # 6 blocks: it waits
    first = eng.submit(big, 1)
    small.sync(0, tokens(20, 92))                  # 2 blocks: they are free
    with eng.cond:                                 # one schedule sees both calls
        second = eng.submit(small, 1)
        beside = eng.submit(holder, 1)
    beside.future.result(10)
    assert not small.admitted and not second.future.done()  # it waits behind the first
    eng.release(holder)
    close(first.future.result(30)[0], fresh(models, big.tokens, 1))
    close(second.future.result(30)[0], fresh(models, small.tokens, 1))
    assert big.admitted < small.admitted


def test_calls_are_not_held_up_by_a_decode_step_picking_its_token(models):
    """A decode's pick (softmax, sampling, a copy to the host) runs outside the engine's
    lock: the service's event loop, which submits, crops and cancels under that lock,
    never waits for it (before, every RPC stalled behind each pass's picks)."""
    eng = engine(models)
    seq, other = eng.new_sequence(), eng.new_sequence()
    seq.sync(0, tokens(12, 93))
    other.sync(0, tokens(12, 94))
    picking, picked = threading.Event(), threading.Event()

    def pick(logits):
        picking.set()
        assert picked.wait(10)
        return [int(logits[-1].argmax())], [], False

    async def go():
        return [token async for token, _ in seq.decode(pick)]

    decoding = threading.Thread(target=lambda: got.extend(asyncio.run(go())))
    got = []
    decoding.start()
    assert picking.wait(10)
    submitted = []
    caller = threading.Thread(target=lambda: submitted.append(eng.submit(other, 1)))
    caller.start()
    caller.join(5)
    held_up = caller.is_alive()
    picked.set()
    caller.join(10)
    decoding.join(10)
    assert not held_up, "submit waited for the pick"
    assert got == greedy_reference(models, tokens(12, 93), 1)
    close(submitted[0].future.result(10)[0], fresh(models, other.tokens, 1))


def test_decode_drafts_lookup_matches_within_its_run_and_keeps_the_targets_tokens(models):
    """DecodeRequest.draft_lookup: where the committed tokens end in an n-gram that
    occurred before, what followed it is drafted into the next pass and checked there;
    the tokens are the target alone's, and the notes count the drafts kept and rejected.
    Without it, a run drafts nothing."""
    from specdec.api.verifier.v1 import verifier_pb2
    from verifier_service.runs import decode

    prompt = tokens(8, 21)  # the tiny model's greedy answer falls into loops: lookup drafts them
    want = greedy_reference(models, prompt, 64)
    rule = verifier_pb2.LookupRule(min_match=2, max_match=4, max_drafts=8)

    session = SimpleNamespace(lookup_passed=None, lookup_index=None)  # the session's lookup state

    async def run(**fields):
        seq = engine(models).new_sequence()
        request = verifier_pb2.DecodeRequest(start=0, new_tokens=prompt, max_tokens=64, **fields)
        picked = [p async for p in decode(seq, request, 4096, None, session)]
        outcomes.extend(picked)
        return [p.token for p in picked], sum(p.drafted for p in picked), sum(p.rejected for p in picked)

    outcomes = []
    got, kept, rejected = asyncio.run(run(draft_lookup=rule))
    assert got == want
    assert kept >= 4, (kept, rejected)  # the loops' drafts pass (how many a loop's end rejects: the numerics')
    # Each pass that drafted says so on its own token: a rejection is always on one.
    assert any(p.by_lookup for p in outcomes)
    assert all(p.by_lookup for p in outcomes if p.rejected)
    assert not any(p.by_lookup and p.drafted for p in outcomes)
    outcomes.clear()
    assert session.lookup_passed is not None  # the request's next run starts from it
    held = session.lookup_index.tokens  # the next call of the request adds to it what it lacks
    assert len(held) > len(prompt) and held == (prompt + want)[:len(held)]
    assert asyncio.run(run()) == (want, 0, 0)
    assert not any(p.by_lookup for p in outcomes)


@pytest.mark.parametrize("offered,kept,passes", [
    ("right", 9, 1),          # its guess (the first token) holds: 9 right drafts kept, the 10th rejected
    ("wrong-guess", 0, 0),    # its first token is not the run's: never used
    ("from-the-prompt", 9, 1),  # drafted after the prompt's first 6 tokens: those must hold too
    ("wrong-earlier", 0, 0),  # ... and one of them does not
])
def test_decode_checks_offered_drafts_after_their_guess_and_keeps_the_targets_tokens(models, offered, kept, passes):
    """DecodeRequest.offer: a drafter's drafts after a history the run has since gone past;
    a pass uses those after the committed history only where the offer's first tokens are
    what it committed there. The tokens are the target alone's either way."""
    from specdec.api.verifier.v1 import verifier_pb2
    from verifier_service.runs import Offers, decode

    prompt = tokens(8, 23)
    want = greedy_reference(models, prompt, 32)
    wrong = (want[10] + 1) % VOCAB
    offers = Offers()
    if offered == "right":
        offers.offer(verifier_pb2.DraftOffer(position=len(prompt), tokens=want[:10] + [wrong] + want[11:20]))
    elif offered == "wrong-guess":
        offers.offer(verifier_pb2.DraftOffer(position=len(prompt), tokens=[(want[0] + 1) % VOCAB] + want[1:20]))
    else:
        earlier = prompt[6:] if offered == "from-the-prompt" else [prompt[6], (prompt[7] + 1) % VOCAB]
        offers.offer(verifier_pb2.DraftOffer(position=6, tokens=earlier + want[:10] + [wrong] + want[11:20]))

    async def run():
        seq = engine(models).new_sequence()
        request = verifier_pb2.DecodeRequest(start=0, new_tokens=prompt, max_tokens=32)
        return [p async for p in decode(seq, request, 4096, offers=offers)]

    picked = asyncio.run(run())
    assert [p.token for p in picked] == want
    assert sum(p.drafted for p in picked) == kept and sum(p.offered for p in picked) == passes
    assert sum(p.rejected for p in picked) == 10 * passes  # the wrong draft and the 9 after it, on its own token
    assert not any(p.by_lookup for p in picked)


def test_decodes_sharing_passes_wake_their_loop_once_a_pass_with_every_token(models):
    """The tokens a pass's picks commit reach the decodes' event loop together, in one
    wake-up as the next pass starts (`Engine._post`): 4 sessions decoding 10 tokens each
    in shared passes wake their loop about once a pass, not once a token, and every token
    arrives before its decode's end."""
    eng = engine(models)
    seqs = [eng.new_sequence() for _ in range(4)]
    prompts = [tokens(16, 40 + i) for i in range(4)]
    for seq, prompt in zip(seqs, prompts):
        seq.sync(0, prompt)
    wakeups = []

    def picker(seq, prompt):
        return lambda logits: ([int(logits[-1].argmax())], [], len(seq.tokens) + 1 < len(prompt) + 10)

    async def go():
        loop = asyncio.get_running_loop()
        plain = loop.call_soon_threadsafe

        def counted(*args, **kwargs):
            if threading.current_thread() is eng.thread:
                wakeups.append(1)
            return plain(*args, **kwargs)

        loop.call_soon_threadsafe = counted

        async def one(seq, prompt):
            return [token async for token, _ in seq.decode(picker(seq, prompt))]
        return await asyncio.gather(*(one(seq, prompt) for seq, prompt in zip(seqs, prompts)))

    got = asyncio.run(go())
    for prompt, out in zip(prompts, got):
        assert out == greedy_reference(models, prompt, 10)
    # 40 tokens in about 11 passes: at most a wake-up a pass (and one more a decode's end,
    # for its future), never one a token.
    assert eng.passes <= 20 and len(wakeups) <= eng.passes + 4, (eng.passes, len(wakeups))
