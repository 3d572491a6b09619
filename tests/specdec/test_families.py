"""Models brought from transformers on the CPU's fast path (`--quantize q8_m`, the default
for them; `q8_0` and `q4_0` on request): their weights quantized at load into blocks the
kernels multiply, the decoder layers of each Llama-family model in one kernel call. The
blocks: Q8_M's within half a step of each weight, GGUF's types gguf's reference
quantization. For a random model of each family (tests/models.py, FAMILIES): the
kernel's pass gives the Python pass's bits, rounds through the engine give the quantized
model's own `generate`, and a prompt in chunks gives one-token steps' bits, at more
threads than this machine has cores."""

import pytest
import torch

from models import FAMILIES, build_family
from passes import logits_by_forward, prefill, rounds_of_its_own_tokens
from specdec.runtime import ggml, modeling, quantize
from specdec.runtime.engine import Engine, model_runner

THREADS = 5  # more than this machine's cores: the split between threads is what could change a row


@pytest.fixture(scope="module", params=FAMILIES)
def family_dir(request, tmp_path_factory, smol_tokenizer):
    path = tmp_path_factory.mktemp(request.param)
    build_family(request.param, smol_tokenizer, path, seed=3)
    return request.param, path


def load(path, method="auto"):
    model, tokenizer = modeling.load_model(str(path))
    return quantize.quantize(model, method), tokenizer


@pytest.mark.parametrize("method", ["auto", "q8_0", "q4_0"])
def test_a_checkpoint_of_each_family_runs_its_layers_in_the_kernel(family_dir, method):
    family, path = family_dir
    model, _ = load(path, method)
    assert quantize.method_of(model) == ("q8_m" if method == "auto" else method)
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    if family == "qwen3":  # tied: the head multiplies the embedding's blocks
        assert model.lm_head.packed.data_ptr() == model.model.embed_tokens.packed.data_ptr()
    engine = Engine(model, 16 << 20)
    try:
        assert engine.numerics == f"{quantize.method_of(model)}/float32/cpu/layer-kernel"
    finally:
        engine.stop()


@pytest.mark.parametrize("kind", [ggml.Q8_0, ggml.Q4_0])
def test_blocks_quantized_at_load_are_ggufs_reference_quantization(kind):
    from gguf import GGMLQuantizationType, quants

    torch.manual_seed(kind)
    weight = torch.randn(24, 96) * torch.logspace(-3, 1, 24)[:, None]
    weight[5] = 0  # a row of zeros: scale 0
    blocks = ggml.blocks_of_weight(weight, kind)
    assert torch.equal(blocks, torch.from_numpy(quants.quantize(weight.numpy(), GGMLQuantizationType(kind))))
    held = ggml._kernels().dequantize(ggml.pack(blocks, kind), kind, 24, torch.arange(24))
    # Each weight within half a step of its block (Q8_0: the block's largest / 127; Q4_0:
    # / 8, and a whole step on the side opposite the largest, whose last level is 7, not 8),
    # plus the step's rounding to float16 (2^-11 of it, 2^-24 below float16's normal range)
    # times the largest quant.
    top, off = (127, 0.5) if kind == ggml.Q8_0 else (8, 1.0)
    step = weight.reshape(24, -1, 32).abs().amax(-1).repeat_interleave(32, -1) / top
    assert ((held - weight).abs() <= step * (off + top * 2 ** -11) + top * 2 ** -24).all()
    assert torch.equal(held[5], torch.zeros(96))


def test_q8_m_blocks_hold_each_weight_within_half_a_step_of_a_grid_no_coarser_than_q8_0s():
    torch.manual_seed(1)
    weight = torch.randn(24, 96) * torch.logspace(-3, 1, 24)[:, None]
    weight[3] = weight[3].abs() + 2  # a block of one sign: Q8_0's step would be twice as coarse
    weight[5] = 0.25  # a constant row: range 0
    blocks = ggml.blocks_of_weight(weight, ggml.Q8_M)
    assert blocks.shape == (24, 3 * 36) and blocks.dtype == torch.uint8
    held = ggml._kernels().dequantize(ggml.pack(blocks, ggml.Q8_M), ggml.Q8_M, 24, torch.arange(24))
    raw = blocks.reshape(-1, 36)
    d, m = (raw[:, i:i + 2].contiguous().view(torch.float16).float().repeat_interleave(32, -1).reshape(24, 96)
            for i in (0, 2))
    # Half a step of the block's grid, plus m's rounding to float16.
    assert ((held - weight).abs() <= 0.5 * d + m.abs() * 2 ** -10 + 2 ** -24).all()
    b = weight.reshape(24, -1, 32)
    coarsest = torch.maximum((b.amax(-1) - b.amin(-1)) / 255, b.abs().amax(-1) / 127).repeat_interleave(32, -1)
    assert (d <= coarsest * (1 + 2 ** -10)).all()
    assert (d[3] <= coarsest[3] / 1.9).all()  # the one-sided block: its range's grid, twice as fine
    assert torch.equal(held[5], torch.full((96,), 0.25))


def test_blocks_de_quantized_from_a_gguf_file_keep_their_levels_in_q8_m():
    """A GGUF file's Q4_1 layers and Q8_0 embedding, de-quantized (a user's checkpoint of the
    default target) and quantized again at load: Q8_M keeps every weight within a small
    part of Q8_0's step of where it was, from either; Q8_0 moves Q4_1's up to half a step."""
    from gguf import GGMLQuantizationType, quants

    torch.manual_seed(2)
    weight = torch.randn(64, 128) * 0.05 + 0.01

    def moved(source, kind):
        published = torch.from_numpy(quants.dequantize(quants.quantize(weight.numpy(), source), source).copy())
        blocks = ggml.blocks_of_weight(published, kind)
        held = ggml._kernels().dequantize(ggml.pack(blocks, kind), kind, 64, torch.arange(64))
        q8_0_step = published.reshape(64, -1, 32).abs().amax(-1) / 127
        return ((held - published).abs().reshape(64, -1, 32).amax(-1) / q8_0_step).max().item()

    assert moved(GGMLQuantizationType.Q4_1, ggml.Q8_M) < 0.15 < 0.45 < moved(GGMLQuantizationType.Q4_1, ggml.Q8_0)
    assert moved(GGMLQuantizationType.Q8_0, ggml.Q8_M) < 0.1


def test_a_layer_whose_inputs_are_not_whole_blocks_is_refused_by_name_and_auto_takes_int8(tmp_path, smol_tokenizer):
    build_family("llama", smol_tokenizer, tmp_path, seed=1, hidden=48)  # 48 = 1.5 blocks
    model, _ = modeling.load_model(str(tmp_path))
    with pytest.raises(ValueError, match="q_proj.*whole blocks of 32"):
        quantize.quantize(model, "q8_0")
    assert quantize.method_of(quantize.quantize(model, "auto")) == "int8"


def test_the_layer_kernel_gives_the_python_pass_bits(family_dir, smol_tokenizer):
    model, tokenizer = load(family_dir[1])
    engine = Engine(model, 16 << 20, threads=THREADS)
    try:
        kernel_forward = engine.runner.forward
        assert kernel_forward.func is model_runner._layer_kernel_forward
        seqs = [engine.new_sequence() for _ in range(3)]
        for seq, text in zip(seqs, ["Water boils at", "The capital of France is Paris, and of Spain",
                                    "def fibonacci(n):\n    if n < 2:\n        return n\n"]):
            seq.sync(0, tokenizer(text)["input_ids"])
        kernel, python = logits_by_forward(engine, seqs, (kernel_forward, model_runner._llama_forward))
        for ours, theirs in zip(kernel, python):
            assert torch.equal(ours, theirs)
    finally:
        engine.stop()


def test_rounds_through_the_engine_give_the_models_own_generate(family_dir):
    """Verify passes of 4 of its own tokens, at more threads than cores, against the same
    quantized model's transformers `generate`."""
    model, tokenizer = load(family_dir[1])
    texts = ["The history of the printing press begins in the fifteenth century, when",
             "Photosynthesis is the process by which plants"]
    with torch.no_grad():
        wants = {}
        for text in texts:
            ids = tokenizer(text)["input_ids"]
            wants[text] = model.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False,
                                         attention_mask=torch.ones(1, len(ids), dtype=torch.long))[0].tolist()
    assert len({t for text in texts for t in wants[text][-40:]}) > 16  # a degenerate model proves nothing
    engine = Engine(model, 16 << 20, threads=THREADS)
    try:
        for text, want in wants.items():
            ids = tokenizer(text)["input_ids"]
            got = rounds_of_its_own_tokens(engine, ids, want)
            assert got == want[len(ids):len(ids) + len(got)], text
    finally:
        engine.stop()


def test_a_prompt_in_chunks_gives_one_token_steps_bits(family_dir):
    model, _ = load(family_dir[1])
    ids = torch.randint(0, model.config.vocab_size, (96,), generator=torch.Generator().manual_seed(4)).tolist()
    want = prefill(model, ids, 1, 1)
    for chunk in (96, 37, 5):
        got = prefill(model, ids, chunk, THREADS)
        assert all(torch.equal(g, w) for g, w in zip(got, want)), chunk


def passes_past_the_window(model, tokens: list[int], threads: int = THREADS) -> torch.Tensor:
    """tokens through the engine: a 20-token prefill, a verify pass of 5, then one-token
    steps -> the logits after every token."""
    engine = Engine(model, 1 << 22, threads=threads)
    try:
        seq = engine.new_sequence()
        seq.sync(0, tokens[:20])
        got = [engine.forward_now(seq, 20)[0]]
        seq.sync(20, tokens[20:25])
        got.append(engine.forward_now(seq, 5)[0])
        for token in tokens[25:]:
            seq.sync(len(seq.tokens), [token])
            got.append(engine.forward_now(seq, 1)[0][-1:])
        return torch.cat(got)
    finally:
        engine.stop()


def full_attention(model, tokens: list[int]) -> torch.Tensor:
    """The model's own forward with its window wider than the tokens (the control: the
    window counts)."""
    window, model.config.sliding_window = model.config.sliding_window, 1 << 20
    try:
        with torch.no_grad():
            return model(torch.tensor([tokens]), use_cache=False).logits[0]
    finally:
        model.config.sliding_window = window


# auto: the layers in one kernel call; int8: the Python pass, attention in the kernel; none:
# the Python pass, attention through torch (masks).
@pytest.mark.parametrize("family, method", [("mistral", "auto"), ("phi3", "auto"), ("mistral", "int8"),
                                            ("mistral", "none")])
def test_a_sliding_window_on_every_layer_is_attended_within_past_it_as_the_models_own_forward(
        tmp_path, smol_tokenizer, family, method):
    """Mistral and Phi-3 with a window of 24 on every layer, at more threads than cores,
    70 tokens: as their own forward."""
    build_family(family, smol_tokenizer, tmp_path, seed=1, sliding_window=24)
    model, _ = load(tmp_path, method)
    assert modeling.max_positions(model) == 4096  # sessions go on past the window
    tokens = torch.randint(0, model.config.vocab_size, (70,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.no_grad():
        want = model(torch.tensor([tokens])).logits[0]
    unwindowed = full_attention(model, tokens)
    assert not torch.allclose(want[30:], unwindowed[30:], rtol=1e-3, atol=1e-3)
    got = passes_past_the_window(model, tokens)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert got.argmax(-1).tolist() == want.argmax(-1).tolist()


def test_qwen2s_windows_on_some_layers_run_in_the_kernel_as_the_models_own_forward(tmp_path, smol_tokenizer):
    """Qwen2 with its window on the layers from max_window_layers on: the other layers attend
    everything, in the same kernel call (its local flags), at more threads than cores."""
    build_family("qwen2", smol_tokenizer, tmp_path, seed=1, layers=3, sliding_window=24, use_sliding_window=True,
                 max_window_layers=1)
    model, _ = load(tmp_path)
    assert [layer.self_attn.sliding_window for layer in model.model.layers] == [None, 24, 24]
    tokens = torch.randint(0, model.config.vocab_size, (70,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.no_grad():
        want = model(torch.tensor([tokens])).logits[0]
    assert not torch.allclose(want[30:], full_attention(model, tokens)[30:], rtol=1e-3, atol=1e-3)
    got = passes_past_the_window(model, tokens)
    engine = Engine(model, 1 << 22)
    try:
        assert engine.numerics == "q8_m/float32/cpu/layer-kernel"
    finally:
        engine.stop()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert got.argmax(-1).tolist() == want.argmax(-1).tolist()


def test_a_phi3_with_a_partial_or_dynamic_rotary_embedding_takes_the_generic_path(tmp_path, smol_tokenizer):
    # Phi-3's 128k models: `longrope`, whose frequencies change once a pass reaches past
    # the original context.
    longrope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8, "long_factor": [4.0] * 8}
    for rope in ({"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}, longrope):
        build_family("phi3", smol_tokenizer, tmp_path, seed=1, rope_parameters=rope,
                     original_max_position_embeddings=1024)
        model, _ = load(tmp_path)
        engine = Engine(model, 16 << 20)
        try:
            assert engine.runner.forward is model_runner._transformers_forward, rope
        finally:
            engine.stop()


def uncapped(model, tokens: list[int]) -> torch.Tensor:
    """The model's own forward with its caps lifted (the control: they count)."""
    config = model.config
    caps = config.attn_logit_softcapping, config.final_logit_softcapping
    config.final_logit_softcapping = None
    for layer in model.model.layers:
        layer.self_attn.attn_logit_softcapping = None
    try:
        with torch.no_grad():
            return model(torch.tensor([tokens]), use_cache=False).logits[0]
    finally:
        config.final_logit_softcapping = caps[1]
        for layer in model.model.layers:
            layer.self_attn.attn_logit_softcapping = caps[0]


@pytest.mark.parametrize("method", ["auto", "none"])
@pytest.mark.parametrize("gemma", ["gemma2", "gemma3_text"])
def test_gemmas_local_layers_and_caps_past_the_window_as_the_models_own_forward(gemma, method):
    """Gemma 2 and 3: local (sliding-window) layers beside global ones (Gemma 3's with a
    rotary embedding of their own), Gemma 2's attention scores and logits soft-capped,
    past the window as transformers' own forward: on its blocks in the layer kernel
    (auto), and in float32 through the Python pass (none), at more threads than cores."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    caps = dict(attn_logit_softcapping=1.0, final_logit_softcapping=2.0, query_pre_attn_scalar=16) \
        if gemma == "gemma2" else {}
    config = AutoConfig.for_model(gemma, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=24,
                                  max_position_embeddings=1024,
                                  layer_types=["sliding_attention"] * 3 + ["full_attention"], **caps)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.1)
    assert modeling.max_positions(model) == 1024
    model = quantize.quantize(model, method)
    tokens = torch.randint(0, 512, (70,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        want = model(torch.tensor([tokens])).logits[0]
    assert not torch.allclose(want[30:], full_attention(model, tokens)[30:], rtol=1e-3, atol=1e-3)
    if caps:
        assert not torch.allclose(want, uncapped(model, tokens), rtol=1e-2, atol=1e-2)
        assert want.abs().max() < 2.0  # the final cap
    got = passes_past_the_window(model, tokens)
    engine = Engine(model, 1 << 22)
    try:
        assert engine.numerics.endswith("layer-kernel" if method == "auto" else "cpu/llama"), engine.numerics
    finally:
        engine.stop()
    assert len(set(want.argmax(-1).tolist())) > 10  # not a degenerate model
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_a_quantized_model_keeps_its_float_models_predictions(family_dir):
    """The blocks change a weight by at most half a step, nothing else: what a module adds
    beside its weight (Gemma's embedding scale, sqrt(hidden), lost once by the blocks'
    embedding: 15% of argmaxes agreed) stays."""
    model, _ = modeling.load_model(str(family_dir[1]))
    tokens = torch.randint(0, model.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = model(tokens).logits[0]
        got = quantize.quantize(model, "q8_m")(tokens).logits[0]
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9
    assert (got - want).abs().max() < 0.1 * want.abs().max()
