"""Static passes (`--cuda-graphs`, `--batch-invariant`): a pass padded to its bucket's
shapes, as a CUDA graph replays it, run eagerly here on the CPU. The padding, the
bucket's read table and the write slots must leave the engine's results and every
session's cache as the usual pass leaves them; batch-invariant passes must give a row the
same bits whatever else its pass holds. tools/gpu_check.py runs the captured graphs."""

import ast
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from models import FAMILIES, build_family
from specdec.runtime import modeling, quantize
from specdec.runtime.engine import Engine
from specdec.runtime.engine.model_runner import FusedRMSNorm, StaticPasses, fuse_launches

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def target():
    model, _ = modeling.load_model(modeling.DEFAULT_TARGET)
    return quantize.quantize(model, "gguf")


def prompts(*sizes, seed=0, vocab=49000):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in sizes]


def test_buckets():
    static = StaticPasses.__new__(StaticPasses)
    static.lengths, static.tokens = [128, 256, 512], StaticPasses.TOKENS
    assert static.bucket(1, 1) == (1, 128)
    assert static.bucket(5, 129) == (8, 256)
    assert static.bucket(64, 512) == (64, 512)
    assert static.bucket(65, 10) is None  # a longer pass runs the usual way
    assert static.bucket(3, 513) is None


def test_every_bucket_a_session_can_reach_is_captured_before_the_first_pass(monkeypatch):
    """capture_all captures each (tokens, positions read) bucket once, up to the longest
    read this pool can hold, and a pass then replays its bucket's graph without capturing
    (the capture itself runs on a GPU alone: tests/gpu)."""
    static = StaticPasses.__new__(StaticPasses)
    static.lengths, static.tokens, static.graphs = [128, 256, 512, 1024], StaticPasses.TOKENS, {}
    static.pool = SimpleNamespace(capacity=18, block_size=16)  # 288 positions: no read past 512
    captured, replays = [], []

    def capture(t, length, layers):
        captured.append((t, length, layers))
        return SimpleNamespace(replay=lambda: replays.append((t, length))), ("logits",)

    monkeypatch.setattr(static, "_captured", capture)
    static.capture_all()
    buckets = [(t, length, ()) for length in (128, 256, 512) for t in StaticPasses.TOKENS]
    assert sorted(captured) == sorted(buckets) and len(captured) == len(set(captured))
    assert static._replay(8, 256, ()) == ("logits",)
    assert replays == [(8, 256)] and len(captured) == len(buckets)
    static.capture_all()  # a second call captures nothing again
    assert len(captured) == len(buckets)


FEATURES = (0, 15, 30)  # a feature drafter's layers: the first's input, a middle one's, the last one's output


def run(model, static: bool, texts, invariant: int = 0, features: tuple[int, ...] = FEATURES):
    """Each prompt but its last 3 tokens prefilled, then the 3 as one batched pass (a
    round each), then a decode step for the first keeping a feature drafter's layers ->
    (the logits, the features, the caches at every written slot, how many passes were
    static)."""
    engine = Engine(model, 64 << 20, cuda_graphs=static, prefix_caching=False, batch_invariant=invariant)
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
        last, _, kept = engine.submit(seqs[0], 1, layers=features).future.result()
        logits.append(last)
        slots = torch.cat([seq.slots(len(seq.tokens), engine.pool.block_size, "cpu") for seq in seqs])
        caches = [t[slots] for t in (*engine.pool.k, *engine.pool.v)]
        return logits, kept, caches, engine.runner.static.passes if engine.runner.static else 0
    finally:
        engine.stop()


# (cuda_graphs, batch_invariant) -> static passes: for buckets, three short prefills (the
# longest prompt's runs the usual way), the batched rounds, the decode step; for passes of
# 8 tokens, the prefills in chunks of 8 (17, 34, 2 and 87 tokens: 3 + 5 + 1 + 11), the
# rounds' 12 tokens in 2 (a row split between them), the step.
@pytest.mark.parametrize("static, invariant, passes", [(True, 0, 5), (False, 8, 23)])
def test_a_static_pass_gives_the_usual_passes_bits(target, static, invariant, passes):
    texts = prompts(20, 37, 5, 90)  # 90: its prefill is longer than the largest bucket
    usual, usual_features, usual_caches, _ = run(target, False, texts)
    ours_, features, caches, ran = run(target, static, texts, invariant)
    assert ran == passes
    for ours, theirs in zip(ours_, usual):
        assert torch.equal(ours, theirs)
    assert features.shape == usual_features.shape == (1, len(FEATURES) * target.config.hidden_size)
    assert torch.equal(features, usual_features)
    for ours, theirs in zip(caches, usual_caches):
        assert torch.equal(ours, theirs)


@pytest.fixture(scope="module", params=[f for f in FAMILIES if f != "llama"])
def family(request, tmp_path_factory, smol_tokenizer):
    """(family, path): a random checkpoint of each other Llama-family model (tests/models.py)."""
    path = tmp_path_factory.mktemp(request.param)
    build_family(request.param, smol_tokenizer, path, seed=5)
    return request.param, path


@pytest.mark.parametrize("static, invariant, passes", [(True, 0, 5), (False, 8, 23)])
def test_a_static_pass_of_each_family_gives_the_usual_passes_bits(family, static, invariant, passes):
    """Each family's layers (biases, head norms, Gemma's four norms, scaled embedding,
    local layers with their own rotary embedding, Gemma 2's capped scores and logits) in
    padded passes, prompts longer than Gemma's window of 24, against the usual pass (the
    layer kernel)."""
    model, _ = modeling.load_model(str(family[1]))
    model = quantize.quantize(model, "q8_m")
    texts = prompts(20, 37, 5, 90)
    usual, usual_features, usual_caches, _ = run(model, False, texts, features=(0, 1, 2))
    ours_, features, caches, ran = run(model, static, texts, invariant, features=(0, 1, 2))
    assert ran == passes
    for ours, theirs in zip(ours_, usual):
        assert torch.equal(ours, theirs)
    assert torch.equal(features, usual_features)
    for ours, theirs in zip(caches, usual_caches):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("name", ["gemma2", "gemma3_text"])  # the families built with a window (of 24)
def test_a_windowed_static_pass_attends_within_the_window(name, tmp_path, smol_tokenizer):
    """The control for the test above: past its window a sliding-window layer's padded
    pass is not the same as attending every position."""
    build_family(name, smol_tokenizer, tmp_path, seed=5)
    model = quantize.quantize(modeling.load_model(str(tmp_path))[0], "q8_m")
    texts = prompts(40, seed=6)
    windowed = run(model, False, texts, invariant=8, features=(0,))[0]
    for layer in model.model.layers:
        layer.self_attn.sliding_window = None
    everywhere = run(model, False, texts, invariant=8, features=(0,))[0]
    assert not torch.equal(windowed[0], everywhere[0])


def dense(dtype: torch.dtype = torch.float32):
    """A model of the default target's widths (2 layers, a smaller vocabulary), random,
    dense: its matrix products block their rows by how many there are."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=8192, hidden_size=576, intermediate_size=1536, num_hidden_layers=2,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048)
    return LlamaForCausalLM(config).to(dtype).eval()


def bits_apart(model, invariant: int) -> tuple[int, int, int]:
    """At 4 threads (more than this machine's cores): a 100-token prompt's greedy steps
    against its own tokens fed back as drafts of 4 (one 5-token pass a round, crossing the
    128-position bucket), and 8 sessions' next tokens in one pass against each alone ->
    (positions, rows, all compared) whose logits differ in any bit."""
    engine = Engine(model, 64 << 20, threads=4, prefix_caching=False, batch_invariant=invariant)
    try:
        ids = prompts(100, seed=2, vocab=8000)[0]
        seq = engine.new_sequence()
        seq.sync(0, ids)
        steps = [engine.forward_now(seq, 1)[0][-1]]
        tokens = [int(steps[-1].argmax())]
        for _ in range(39):
            seq.extend([tokens[-1]])
            steps.append(engine.forward_now(seq, 1)[0][-1])
            tokens.append(int(steps[-1].argmax()))
        seq.sync(len(ids), [])
        verified = []
        for at in range(0, 40, 5):
            seq.sync(len(ids) + at, tokens[at:at + 5])
            verified += list(engine.forward_now(seq, 5)[0])
        positions = sum(not torch.equal(a, b) for a, b in zip(steps[1:], verified))  # steps[0]: the prefill's
        engine.release(seq)

        seqs = [engine.new_sequence() for _ in range(8)]
        alone = []
        for seq, text in zip(seqs, prompts(*range(30, 110, 10), seed=3, vocab=8000)):
            seq.sync(0, text)
            alone.append(engine.forward_now(seq, 1)[0][-1])
            seq.sync(len(text) - 1, [])
        with engine.cond:
            for seq, text in zip(seqs, prompts(*range(30, 110, 10), seed=3, vocab=8000)):
                seq.sync(len(text) - 1, text[-1:])
            works = [engine.submit(seq, 1) for seq in seqs]
        rows = sum(not torch.equal(a, w.future.result()[0][-1]) for a, w in zip(alone, works))
        return positions, rows, len(verified) + len(seqs)
    finally:
        engine.stop()


def bits_apart_as_a_service(dtype: str, invariant: int) -> tuple[int, int, int]:
    """bits_apart in a fresh process, set up as a session service started with
    --batch-invariant sets up its own (serving.prepare_process: MKL's reproducible mode,
    which MKL reads at its first call; this test process made that call long ago)."""
    code = ("from types import SimpleNamespace; from specdec.runtime import serving; "
            f"serving.prepare_process(SimpleNamespace(batch_invariant={invariant})); import torch; "
            "from tests.specdec.test_static_passes import bits_apart, dense; "
            f"print(bits_apart(dense(torch.{dtype}), invariant={invariant}))")
    env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests"), *filter(None, [env.get("PYTHONPATH")])])  # its `models`
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return ast.literal_eval(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batch_invariant_passes_give_a_row_the_same_bits_in_any_pass(dtype):
    assert bits_apart_as_a_service(dtype, invariant=8) == (0, 0, 40 + 8)
    # The same model's usual passes do differ (else this test could not fail).
    positions, rows, _ = bits_apart(dense(getattr(torch, dtype)), invariant=0)
    assert positions + rows > 0


def fused(dtype: torch.dtype):
    """dense(dtype) as a GPU runs it: fewer launches a step (model_runner.fuse_launches)."""
    model = dense(dtype)
    fuse_launches(model)
    return model


def test_a_fused_model_computes_the_models_logits():
    model, ours = dense(), fused(torch.float32)
    assert sum(isinstance(m, FusedRMSNorm) for m in ours.modules()) == 2 * 2 + 1
    assert all(hasattr(layer.self_attn, "shared_q_k_v") and hasattr(layer.mlp, "shared_gate_up")
               for layer in ours.model.layers)
    assert_same_logits(model, ours)
    assert quantize.share_products(ours) == 0  # fused once


def assert_same_logits(model, ours) -> None:
    """The fused model `ours` computes `model`'s logits, called as a module and through the
    engine (its own forward, which takes a shared product once)."""
    ids = torch.tensor([prompts(40, seed=4, vocab=8000)[0]])
    with torch.no_grad():
        theirs, mine = model(ids).logits, ours(ids).logits
    torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)
    engine = Engine(ours, 64 << 20, prefix_caching=False)
    try:
        seq = engine.new_sequence()
        seq.sync(0, ids[0].tolist())
        torch.testing.assert_close(engine.forward_now(seq, 1)[0][-1], theirs[0, -1], rtol=1e-4, atol=1e-4)
    finally:
        engine.stop()


def test_fused_batch_invariant_passes_give_a_row_the_same_bits_in_any_pass():
    assert bits_apart(fused(torch.bfloat16), invariant=8) == (0, 0, 40 + 8)


def fused_family(path, dtype: torch.dtype):
    model, _ = modeling.load_model(str(path))
    model = model.to(dtype)
    fuse_launches(model)
    return model


def test_a_fused_model_of_each_family_computes_the_models_logits(family):
    model, _ = modeling.load_model(str(family[1]))
    ours = fused_family(family[1], torch.float32)
    norms = 2 * (4 if family[0].startswith("gemma") else 2) + 1
    if family[0] in ("qwen3", "gemma3_text"):
        norms += 2 * 2  # each layer's q and k head norms
    assert sum(isinstance(m, FusedRMSNorm) for m in ours.modules()) == norms
    if family[0] != "phi3":  # its q|k|v and gate|up are one product already (quantize.share_fused)
        assert all(hasattr(layer.self_attn, "shared_q_k_v") and hasattr(layer.mlp, "shared_gate_up")
                   for layer in ours.model.layers)
    assert_same_logits(model, ours)


def test_fused_batch_invariant_passes_of_each_family_give_a_row_the_same_bits_in_any_pass(family):
    """As a GPU runs a checkpoint of the family with --batch-invariant (bfloat16, fewer
    launches), at more threads than cores."""
    model = fused_family(family[1], torch.bfloat16)
    assert bits_apart(model, invariant=8) == (0, 0, 40 + 8)
    if family[0] != "gemma2":
        # The control: the usual passes differ. Not Gemma 2's, at this size: its attention
        # is written out (sdpa cannot cap scores), and there, as in its products, a row's
        # bits came out the same in every pass here even without invariance.
        positions, rows, _ = bits_apart(model, invariant=0)
        assert positions + rows > 0


def test_static_passes_refuse_a_model_off_the_llama_familys_path():
    """A dynamic rotary embedding (frequencies that follow a pass's longest position)
    takes transformers' own forward, which static passes cannot pad."""
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1,
                         rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    model = LlamaForCausalLM(config).eval()
    with pytest.raises(ValueError, match="static passes.*Llama-family models only.*not LlamaForCausalLM"):
        Engine(model, 1 << 20, batch_invariant=8)
    engine = Engine(model, 1 << 20)  # its usual passes run
    try:
        assert engine.numerics.endswith("/transformers")
    finally:
        engine.stop()


def test_batch_invariant_tokens_are_checked():
    model = dense()
    for bad in (-1, 257):
        with pytest.raises(ValueError, match="batch_invariant"):
            Engine(model, 16 << 20, batch_invariant=bad)


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


def test_a_service_whose_model_is_on_a_cpu_runs_its_passes_the_usual_way(caplog):
    """`specdec up --cuda-graphs on` gives the flag to every service; a model on a CPU
    (a drafter on a CPU node) keeps the usual passes, and says so; --batch-invariant still
    applies (its padded passes are what make a row's bits its own on any device)."""
    import argparse

    from specdec.runtime import serving

    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1)).eval()
    args = argparse.Namespace(quantize="none", kv_cache_bytes=1 << 20, max_batch_rows=4, max_batch_tokens=64,
                              max_waiting_sessions=4, threads=1, prefix_caching=False, cuda_graphs="on",
                              batch_invariant=0)
    engine = serving.engine(model, args)
    try:
        assert engine.runner.static is None
        assert "the model is on cpu" in caplog.text
    finally:
        engine.stop()
    engine = serving.engine(model, argparse.Namespace(**{**vars(args), "batch_invariant": 8}))
    try:
        assert engine.runner.static is not None and engine.runner.static.invariant == 8
        assert not engine.runner.static.capture
    finally:
        engine.stop()
