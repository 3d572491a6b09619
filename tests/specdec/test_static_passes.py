"""Static passes (`--cuda-graphs`): a pass padded to its bucket's shapes, as a CUDA graph
replays it, run eagerly here on the CPU. The padding, the bucket's read table and the
write slots must leave the engine's results and every session's cache as the usual pass
leaves them; tests/gpu runs the captured graphs."""

import pytest
import torch

from specdec import modeling, quantize
from specdec.engine import Engine
from specdec.engine.model_runner import StaticPasses


@pytest.fixture(scope="module")
def target():
    model, _ = modeling.load_model(modeling.DEFAULT_TARGET)
    return quantize.quantize(model, "gguf")


def prompts(*sizes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 49000, (n,), generator=g).tolist() for n in sizes]


def test_buckets():
    static = StaticPasses.__new__(StaticPasses)
    static.lengths, static.tokens = [128, 256, 512], StaticPasses.TOKENS
    assert static.bucket(1, 1) == (1, 128)
    assert static.bucket(5, 129) == (8, 256)
    assert static.bucket(64, 512) == (64, 512)
    assert static.bucket(65, 10) is None  # a longer pass runs the usual way
    assert static.bucket(3, 513) is None


def run(model, static: bool, texts):
    """Each prompt but its last 3 tokens prefilled, then the 3 as one batched pass (a
    round each), then a decode step for the first -> (the logits, the caches at every
    written slot, how many passes were static)."""
    engine = Engine(model, 64 << 20, cuda_graphs=static, prefix_caching=False)
    try:
        seqs = [engine.new_sequence() for _ in texts]
        for seq, ids in zip(seqs, texts):
            seq.sync(0, ids[:-3])
            engine.forward_now(seq, 1)
        with engine.cond:
            for seq, ids in zip(seqs, texts):
                seq.sync(len(ids) - 3, ids[-3:])
            works = [engine.submit(seq, 3) for seq in seqs]
        logits = [work.future.result()[0] for work in works]
        seqs[0].extend([42])
        logits.append(engine.forward_now(seqs[0], 1)[0])
        slots = torch.cat([seq.slots(len(seq.tokens), engine.pool.block_size, "cpu") for seq in seqs])
        caches = [t[slots] for t in (*engine.pool.k, *engine.pool.v)]
        return logits, caches, engine.runner.static.passes if static else 0
    finally:
        engine.stop()


def test_a_static_pass_gives_the_usual_passes_bits(target):
    texts = prompts(20, 37, 5, 90)  # 90: its prefill is longer than the largest bucket
    usual, usual_caches, _ = run(target, False, texts)
    static, static_caches, passes = run(target, True, texts)
    assert passes == 3 + 1 + 1  # three short prefills, the batched rounds, the decode step
    for ours, theirs in zip(static, usual):
        assert torch.equal(ours, theirs)
    for ours, theirs in zip(static_caches, usual_caches):
        assert torch.equal(ours, theirs)


def test_padding_writes_only_its_own_slot(target):
    engine = Engine(target, 16 << 20, cuda_graphs=True, prefix_caching=False)
    try:
        seq = engine.new_sequence()
        seq.sync(0, prompts(5, seed=1)[0])  # a bucket of 8 tokens: 3 of padding
        for t in (*engine.pool.k, *engine.pool.v):
            t[1:].fill_(7.0)
        engine.forward_now(seq, 1)
        written = seq.slots(5, engine.pool.block_size, "cpu").tolist() + [StaticPasses.PAD_SLOT]
        for t in (*engine.pool.k, *engine.pool.v):
            untouched = torch.ones(len(t), dtype=torch.bool)
            untouched[written] = False
            untouched[0] = False
            assert (t[untouched] == 7.0).all()
            assert not (t[0] != 0).any()  # the zeros padding rows of the usual pass read
        assert engine.runner.static.passes == 1
    finally:
        engine.stop()
