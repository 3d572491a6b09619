"""A GGUF model on its own blocks (`--quantize gguf`): the kernels de-quantize exactly
what gguf's reference code does, a row's result does not depend on the rows beside it,
and the default target on its blocks is the published float32 model but for activations
rounded to 16 bits per block, and exact through the engine against its own `generate`."""

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from passes import logits_by_forward, rounds_of_its_own_tokens
from specdec.runtime import ggml, modeling, quantize
from specdec.runtime.engine import Engine

KINDS = [ggml.Q4_0, ggml.Q4_1, ggml.Q5_0, ggml.Q5_1, ggml.Q8_0, ggml.Q4_K, ggml.Q5_K, ggml.Q6_K, ggml.Q8_M]


def cols_of(kind: int, cols: int) -> int:
    """`cols` rounded up to whole blocks of the type (a K type's: 256 weights)."""
    return -(-cols // ggml.block_weights(kind)) * ggml.block_weights(kind)


def random_blocks(kind: int, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Well-formed blocks with random scales, minimums and quants (a K type's: random
    bytes but its float16 scales)."""
    draw = np.random.default_rng(seed)
    if kind in ggml.K_TYPES:
        size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)][1]
        n = rows * cols // 256
        b = draw.integers(0, 256, (n, size), dtype=np.uint8)
        scales = [208] if kind == ggml.Q6_K else [0, 2]  # d (and d_min) at these bytes
        for at, scale in zip(scales, (0.002, 0.004)):
            b[:, at:at + 2] = (draw.random((n, 1)) * scale + 1e-4).astype(np.float16).view(np.uint8)
        return torch.from_numpy(b.reshape(rows, -1).copy())
    n = rows * cols // 32
    d = (draw.random(n) * 0.02 + 1e-3).astype(np.float16).view(np.uint8).reshape(n, 2)
    if kind in (ggml.Q5_0, ggml.Q5_1):
        q = draw.integers(0, 256, (n, 20), dtype=np.uint8)  # the fifth bits (4 bytes), then the nibbles
        parts = [d, q]
        if kind == ggml.Q5_1:
            m = (-draw.random(n) * 0.1).astype(np.float16).view(np.uint8).reshape(n, 2)
            parts = [d, m, q]
    elif kind == ggml.Q8_0:
        q = draw.integers(-128, 128, (n, 32), dtype=np.int8).view(np.uint8)
        parts = [d, q]
    elif kind == ggml.Q8_M:
        m = (-draw.random(n) * 2).astype(np.float16).view(np.uint8).reshape(n, 2)
        parts = [d, m, draw.integers(0, 256, (n, 32), dtype=np.uint8)]
    else:
        q = draw.integers(0, 256, (n, 16), dtype=np.uint8)
        parts = [d, q]
        if kind == ggml.Q4_1:
            m = (-draw.random(n) * 0.1).astype(np.float16).view(np.uint8).reshape(n, 2)
            parts = [d, m, q]
    return torch.from_numpy(np.concatenate(parts, axis=1).reshape(rows, -1).copy())


def reference_dequantize(blocks: torch.Tensor, kind: int) -> torch.Tensor:
    """gguf's reference code; for our Q8_M, Q4_1's formula as gguf writes it (q * d + m in
    float32) on 8-bit q."""
    if kind == ggml.Q8_M:
        b = blocks.numpy().reshape(-1, 36)
        d, m = (b[:, i:i + 2].copy().view(np.float16).astype(np.float32) for i in (0, 2))
        return torch.from_numpy((d * b[:, 4:].astype(np.float32) + m).reshape(blocks.shape[0], -1))
    return torch.from_numpy(quants.dequantize(blocks.numpy(), GGMLQuantizationType(kind)).copy()).float()


@pytest.mark.parametrize("kind", KINDS)
def test_blocks_dequantize_as_ggufs_reference_code(kind):
    cols = cols_of(kind, 96)
    blocks = random_blocks(kind, 21, cols)  # a last group of 5 rows, padded to 8
    packed = ggml.pack(blocks, kind)
    # The file's bytes, rearranged, and the padding's; Q4_K's and Q5_K's 6-bit sc and m
    # widened to a byte each: 32 bytes more a superblock of 8 rows.
    widened = 32 * 3 * cols // 256 if kind in (ggml.Q4_K, ggml.Q5_K) else 0
    assert packed.numel() == 24 * blocks.shape[1] + widened
    assert torch.equal(ggml._kernels().dequantize(packed, kind, 21, torch.arange(21)),
                       reference_dequantize(blocks, kind))
    ids = torch.tensor([[3, 0], [20, 3]])
    embedding = ggml.GGUFEmbedding(packed, kind, cols, 21)
    assert torch.equal(embedding(ids), reference_dequantize(blocks, kind)[ids])
    with pytest.raises(RuntimeError, match="out of range"):
        embedding(torch.tensor([21]))


@pytest.mark.parametrize("kind", KINDS)
def test_a_row_gives_the_same_result_alone_or_among_others(kind):
    # Every tile the kernel cuts a pass into (AVX2: 1 to 6 rows, 7 to 12 in two, 13 to 17
    # in three; AVX-512: 1 to 8, 9 to 16 in two, 17 in three), an odd number of output rows
    # (the threads split them).
    cols = cols_of(kind, 160)
    layer = ggml.GGUFLinear(random_blocks(kind, 77, cols, seed=kind), kind, cols)
    torch.manual_seed(0)
    rows = torch.randn(17, cols) * torch.tensor([0.01, 1, 100, 1, 5, 0.1, 30, 2, 7, 0.5, 3, 1, 20, 4, 0.2, 9, 1])[:, None]
    alone = [layer(rows[i:i + 1]) for i in range(17)]
    for width in range(1, 18):
        together = layer(rows[:width][None])[0]
        for i in range(width):
            assert torch.equal(together[i:i + 1], alone[i]), (width, i)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(layer(rows), torch.cat(alone))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [77, 88])  # the last pair of groups 8 + 5 rows; a group on its own
def test_every_path_of_the_build_gives_the_same_bits(kind, rows):
    # The widest path the CPU has runs by default; the narrower ones (portable C++ on every
    # build, AVX2 on x86) are what another machine runs: the same model, the same tokens.
    kernels = ggml._kernels()
    cols = cols_of(kind, 160)
    layer = ggml.GGUFLinear(random_blocks(kind, rows, cols, seed=kind), kind, cols)
    torch.manual_seed(kind)
    x = torch.randn(17, cols) * torch.logspace(-2, 2, 17)[:, None]
    by_path = {}
    default = kernels.set_isa("portable")
    try:
        for path in kernels.isas():
            kernels.set_isa(path)
            by_path[path] = [layer(x[:width]) for width in range(1, 18)]
    finally:
        kernels.set_isa(default)
    assert default == kernels.isas()[-1]
    for path, outs in by_path.items():
        for width, (got, want) in enumerate(zip(outs, by_path["portable"]), 1):
            assert torch.equal(got, want), (path, width)
    with pytest.raises(RuntimeError, match="no path"):
        kernels.set_isa("avx9")


@pytest.mark.parametrize("kind", KINDS)
def test_the_product_is_the_published_weights_times_activations_rounded_to_16_bits(kind):
    cols = cols_of(kind, 128)
    blocks = random_blocks(kind, 64, cols, seed=10 + kind)
    torch.manual_seed(kind)
    x = torch.randn(5, cols) * torch.tensor([1, 0.01, 100, 1, 1])[:, None]
    x[3, 32:64] = 0  # a block of zeros
    w = reference_dequantize(blocks, kind).double()
    want = x.double() @ w.T
    got = ggml.GGUFLinear(blocks, kind, cols)(x).double()
    # Each activation is off by at most half its block's step (the block's largest magnitude
    # / 32767); float32 sums add their own rounding on top.
    step = x.reshape(5, -1, 32).abs().amax(-1).double().repeat_interleave(32, -1) / 32767
    bound = 0.5 * step @ w.abs().T + 1e-6 * (x.double().abs() @ w.abs().T)
    assert ((got - want).abs() <= bound).all()  # rounding to 8 bits: 94-97% of outputs over it, by 11-12x (median)


def test_a_row_that_is_not_finite_gives_nan_and_leaves_its_neighbours_alone():
    layer = ggml.GGUFLinear(random_blocks(ggml.Q4_1, 16, 64), ggml.Q4_1, 64)
    x = torch.randn(3, 64)
    clean = layer(x)
    x[0, 40], x[2, 5] = float("nan"), float("inf")
    got = layer(x)
    assert got[0].isnan().all() and got[2].isnan().all()
    assert torch.equal(got[1], clean[1])


def test_fused_layers_take_their_own_columns():
    parts = [ggml.GGUFLinear(random_blocks(ggml.Q4_1, n, 64, seed=n), ggml.Q4_1, 64) for n in (32, 8, 8)]
    fused = ggml.fuse(parts)
    x = torch.randn(3, 64)
    assert torch.equal(fused(x), torch.cat([p(x) for p in parts], dim=1))
    assert ggml.fuse([parts[0], ggml.GGUFLinear(random_blocks(ggml.Q8_0, 8, 64), ggml.Q8_0, 64)]) is None


@pytest.fixture(scope="module")
def default_target():
    """(the default target on its GGUF blocks, the same model in float32, tokenizer)"""
    model, tokenizer = modeling.load_model(modeling.DEFAULT_TARGET)
    reference, _ = modeling.load_model(modeling.DEFAULT_TARGET)
    return quantize.quantize(model, "auto"), reference, tokenizer


def test_the_default_target_runs_on_its_own_blocks(default_target):
    model, reference, tokenizer = default_target
    assert quantize.method_of(model) == "gguf"
    kept = [m for m in model.modules() if isinstance(m, (ggml.GGUFLinear, ggml.GGUFEmbedding))]
    # 30 layers of fused q/k/v, o, fused gate/up and down; the embedding; the head (tied to it)
    assert len(kept) == 30 * 4 + 2
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    # All their blocks in one buffer from a 2 MiB boundary (huge pages where the system
    # gives them: ggml.arrange); the head's are the embedding's
    assert len({m.packed.untyped_storage().data_ptr() for m in kept}) == 1
    assert min(m.packed.data_ptr() for m in kept) % ggml.HUGE_PAGE == 0
    assert model.lm_head.packed.data_ptr() == model.model.embed_tokens.packed.data_ptr()
    ids = tokenizer("The history of the printing press begins in the fifteenth century, when")["input_ids"]
    with torch.no_grad():
        got = model(torch.tensor([ids])).logits[0]
        want = reference(torch.tensor([ids])).logits[0]
    # The published float32 model, but for activations rounded to 16 bits (logits some 6e-3
    # off; float32 alone, 2e-3) and the order of float sums
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-2)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("numerics", ["gguf", "int8"])
def test_the_default_target_rounds_equal_its_generate(numerics):
    """The default target on its GGUF blocks, and in int8: rounds of 4 verified tokens
    through the engine give its own `generate`'s greedy tokens, token for token. (In
    int8, attention in float32 parted them within a few dozen tokens: an int8 rounding
    step magnifies a last-bit difference.)"""
    model, tokenizer = modeling.load_model(modeling.DEFAULT_TARGET)
    model = quantize.quantize(model, numerics)
    with torch.no_grad():
        wants = {}
        for text in ["The history of the printing press begins in the fifteenth century, when",
                     "Photosynthesis is the process by which plants"]:
            ids = tokenizer(text)["input_ids"]
            wants[text] = model.generate(torch.tensor([ids]), max_new_tokens=48, do_sample=False,
                                         attention_mask=torch.ones(1, len(ids), dtype=torch.long))[0].tolist()
    engine = Engine(model, 64 << 20)  # the same model: the engine's pass against transformers' generate
    try:
        for text, want in wants.items():
            ids = tokenizer(text)["input_ids"]
            got = rounds_of_its_own_tokens(engine, ids, want)  # the target's own tokens as drafts
            assert got == want[len(ids):len(ids) + len(got)], text
    finally:
        engine.stop()


def test_each_layer_in_one_kernel_call_gives_the_python_pass_bits():
    """The engine's pass of the default target on its blocks, each decoder layer in one
    kernel call (layer_cpu.cpp), against its Python pass of the same modules
    (_llama_forward): the same logits, bit for bit, for rows of several lengths in one
    pass, and for one decode step."""
    from specdec.runtime.engine import model_runner

    model, tokenizer = modeling.load_model(modeling.DEFAULT_TARGET)
    engine = Engine(quantize.quantize(model, "gguf"), 64 << 20)
    try:
        kernel_forward = engine.runner.forward
        assert kernel_forward.func is model_runner._layer_kernel_forward
        seqs = [engine.new_sequence() for _ in range(3)]
        texts = ["Water boils at", "The capital of France is Paris, and the capital of Spain is",
                 "def fibonacci(n):\n    if n < 2:\n        return n\n    return"]
        for seq, text in zip(seqs, texts):
            seq.sync(0, tokenizer(text)["input_ids"])
        outputs = logits_by_forward(engine, seqs, (kernel_forward, model_runner._llama_forward))
        for forward, logits in zip((kernel_forward, model_runner._llama_forward), outputs):
            engine.runner.forward = forward
            seqs[0].extend([42])
            logits.append(engine.forward_now(seqs[0], 1)[0])  # one decode step
            seqs[0].sync(len(seqs[0].tokens) - 1, [])
        for ours, theirs in zip(*outputs):
            assert torch.equal(ours, theirs)
    finally:
        engine.stop()


def test_a_pass_in_one_kernel_call_stops_before_a_layer_once_nobody_reads_it():
    """The pass's stop flag: set, the layers' kernel call writes nothing to the caches and
    the pass ends as abandoned; clear, it runs. The runner sets it once every row of the
    running pass has lost its caller, not before."""
    from types import SimpleNamespace

    from specdec.runtime.engine import model_runner
    from specdec.runtime.engine.attention import Abandoned, Plan

    model, tokenizer = modeling.load_model(modeling.DEFAULT_TARGET)
    engine = Engine(quantize.quantize(model, "gguf"), 16 << 20)
    try:
        seq = engine.new_sequence()
        ids = tokenizer("Water boils at")["input_ids"]
        seq.sync(0, ids)
        want = engine.forward_now(seq, 1)[0]  # a prefill pass: engine.runner.plan is its plan
        plan, forward = engine.runner.plan, engine.runner.forward
        again = (model, torch.tensor([ids]), torch.arange(len(ids))[None], torch.tensor([len(ids) - 1]), plan)
        written = plan.write_slots
        caches = [t[written] for t in (*plan.pool.k, *plan.pool.v)]
        for t in (*plan.pool.k, *plan.pool.v):
            t.zero_()
        plan.stop.fill_(1)
        with pytest.raises(Abandoned):
            forward(*again)
        assert not any(t.any() for t in (*plan.pool.k, *plan.pool.v))
        plan.stop.fill_(0)
        with torch.inference_mode():
            assert torch.equal(forward(*again)[0], want)
        assert all(torch.equal(a, b[written]) for a, b in zip(caches, (*plan.pool.k, *plan.pool.v)))

        works = [SimpleNamespace(cancelled=False), SimpleNamespace(cancelled=False)]
        engine.runner.plan = Plan(plan.pool, plan.write_slots, [], plan.dtype, works)
        works[0].cancelled = True
        engine.runner.stop_if_abandoned()
        assert not engine.runner.plan.stop.item()  # one row is still read
        works[1].cancelled = True
        engine.runner.stop_if_abandoned()
        assert engine.runner.plan.stop.item()
        assert forward.func is model_runner._layer_kernel_forward
    finally:
        engine.stop()


def test_rms_norm_is_llamas_norm_row_by_row():
    """The one-call norm against transformers' LlamaRMSNorm (within float32 rounding: its
    sum of squares is float64), and each row the same bits alone and among others."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    norm = LlamaRMSNorm(576, eps=1e-5)
    norm.weight.data = torch.randn(576)
    x = torch.randn(1, 7, 576) * 3
    ours = ggml.RMSNorm(norm)
    torch.testing.assert_close(ours(x), norm(x), rtol=1e-6, atol=1e-6)
    for t in range(7):
        assert torch.equal(ours(x[:, t:t + 1])[0, 0], ours(x)[0, t])
    model = torch.nn.Sequential(torch.nn.Linear(576, 576), LlamaRMSNorm(576))
    assert ggml.replace_norms(model) == 1 and isinstance(model[1], ggml.RMSNorm)


def write_gguf(path, tensors: dict):
    """A GGUF file holding `tensors` (name -> (type, rows, cols)) with random blocks."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    draw = np.random.default_rng(0)
    for name, (kind, rows, cols) in tensors.items():
        block, size = gguf.GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
        raw = draw.integers(0, 256, (rows, cols // block * size), dtype=np.uint8)
        writer.add_tensor(name, raw, raw_dtype=GGMLQuantizationType(kind))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("head", ["output.weight", "token_embd.weight"])
def test_a_file_whose_head_is_in_another_block_type_is_not_gguf_supported(tmp_path, head):
    """A file whose output head (or tied embedding) is in a type the kernels do not
    multiply (Q3_K here; llama.cpp writes a Q4 file's head in Q6_K, which they now do):
    --quantize auto must not pick the GGUF path for it. (Before: only the layers' types
    were looked at.)"""
    path = tmp_path / "model.gguf"
    write_gguf(path, {"blk.0.attn_q.weight": (ggml.Q8_0, 256, 256), "token_embd.weight": (ggml.Q8_0, 64, 256),
                      head: (GGMLQuantizationType.Q3_K, 64, 256)})
    assert not ggml.supported(str(path))
    path = tmp_path / "fine.gguf"
    write_gguf(path, {"blk.0.attn_q.weight": (ggml.Q8_0, 256, 256), head: (ggml.Q8_0, 64, 256)})
    assert ggml.supported(str(path))


def test_a_head_the_kernels_cannot_multiply_is_refused_not_left_in_float32(monkeypatch):
    """(Before: load_blocks skipped it without a word, and a float32 head multiplied one
    row and several rows differently: Decode and Verify disagreed.)"""
    model, _ = modeling.load_model(modeling.DEFAULT_TARGET)
    real = ggml._blocks_of

    def no_head(weight, tensor, config, name):
        return None if tensor.name == "token_embd.weight" and name == "lm_head" else real(weight, tensor, config, name)

    monkeypatch.setattr(ggml, "_blocks_of", no_head)
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())  # untied: its own tensor
    with pytest.raises(ValueError, match="lm_head .* use --quantize int8"):
        ggml.load_blocks(model, model.config.specdec_gguf)
