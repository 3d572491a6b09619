"""The engine's passes as tests drive them: the same rows under different forwards (to
hold one forward to another's bits), a prompt in chunks, and rounds whose drafts are the
model's own tokens."""

import torch

from specdec.runtime.engine import Engine


def logits_by_forward(engine, seqs, forwards, last: int = 3) -> list[list[torch.Tensor]]:
    """For each forward in turn: every sequence's cache dropped, then one pass of all of
    them together (each computing its tokens again) -> the logits of each one's last
    `last` positions."""
    outputs = []
    for forward in forwards:
        engine.runner.forward = forward
        for seq in seqs:
            engine.crop(seq, 0)
        with engine.cond:
            works = [engine.submit(seq, last) for seq in seqs]
        outputs.append([work.future.result()[0] for work in works])
    return outputs


def prefill(model, ids: list[int], chunk: int, n_threads: int):
    """ids through a fresh engine in passes of `chunk` tokens -> (logits after every token
    [T, vocab], keys and values at the prompt's positions [layers, T, kv_heads, head_dim])."""
    engine = Engine(model, 64 << 20, threads=n_threads, max_batch_tokens=chunk, prefix_caching=False)
    try:
        seq = engine.new_sequence()
        seq.sync(0, ids)
        logits, _ = engine.forward_now(seq, len(ids))
        slots = seq.slots(len(ids), engine.pool.block_size, "cpu")
        return logits, torch.stack([k[slots] for k in engine.pool.k]), torch.stack([v[slots] for v in engine.pool.v])
    finally:
        engine.stop()


def rounds_of_its_own_tokens(engine, ids: list[int], want: list[int], k: int = 4) -> list[int]:
    """The greedy tokens after `ids` when verify passes check `want`'s own next k tokens
    as drafts (want: the prompt and the model's own greedy continuation)."""
    seq = engine.new_sequence()
    try:
        seq.sync(0, ids)
        got = engine.forward_now(seq, 1)[0].argmax(-1).tolist()
        for pos in range(len(ids), len(want) - k, k):
            seq.sync(pos, want[pos:pos + k])
            got += engine.forward_now(seq, k)[0].argmax(-1).tolist()
        return got
    finally:
        engine.release(seq)
