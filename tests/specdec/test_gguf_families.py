"""GGUF files of every family the layer kernel runs, as users bring them from llama.cpp's
converter (written here by tests/models.py's `write_gguf`: Q8_0 blocks, Llama's q and k
rows in the converter's order, Gemma's norms as 1 + w). Each loads as its model, with the
numbers the file holds where transformers' GGUF loader would leave its config's defaults
(`model_files.gguf_config`: head widths, Gemma's caps and attention scale, Llama 3's and
Gemma 3's rope scaling); `--quantize auto` takes the file's own blocks (no second
quantization) to the layer kernel; and verify passes through the engine, at more threads
than this machine has cores, give the model's own `generate`."""

from pathlib import Path

import pytest
import torch

from models import FAMILIES, bpe_tokenizer, build_family, in_q8_0, write_gguf
from passes import logits_by_forward, rounds_of_its_own_tokens
from specdec import model_files
from specdec.runtime import ggml, modeling, quantize
from specdec.runtime.engine import Engine

THREADS = 5

# Shapes a GGUF file can say: Gemma's head tied to its embedding (the file has no other),
# Gemma 3's local and global layers in llama.cpp's fixed pattern (5 local, then a global
# one), and its attention scale the head's width (llama.cpp's, below 27B). Gemma 2 keeps
# the small caps and scale of models.py: the file holds the caps, and its scale is the
# head's width there too.
SHAPES = {"gemma2": dict(tie_word_embeddings=True),
          "gemma3_text": dict(tie_word_embeddings=True, layers=6, query_pre_attn_scalar=16,
                              layer_types=["sliding_attention"] * 5 + ["full_attention"],
                              rope_parameters={  # Gemma 3 4B's and up: its global layers' positions / 8
                                  "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                  "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
          # Llama 3.1's rope scaling: the file holds it as a tensor (all three of its cases
          # at these heads' 8 frequencies: as they are, interpolated, divided by 8)
          "llama": dict(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 8192})}
TEXT = "The history of the printing press begins in the fifteenth century, when"


@pytest.fixture(scope="module")
def tokenizer():
    """A small vocabulary: the file's metadata is read a few times a load."""
    return bpe_tokenizer([TEXT, "Water boils at a hundred degrees, and the printing of books changed"] * 20,
                         vocab_size=600)


@pytest.fixture(scope="module", params=FAMILIES)
def gguf_file(request, tmp_path_factory, tokenizer):
    family = request.param
    root = tmp_path_factory.mktemp(f"gguf-{family}")
    model = build_family(family, tokenizer, root / "checkpoint", seed=3, eos_token_id=None,
                         **SHAPES.get(family, {}))
    if family.startswith("gemma"):
        # Its input is the embedding times sqrt(hidden), its head that embedding: at these
        # weights the last token wins every step. A smaller embedding lets the layers count.
        with torch.no_grad():
            model.get_input_embeddings().weight.mul_(0.05)
    return model, write_gguf(model, tokenizer, root / f"{family}.gguf", ggml.Q8_0)


def test_a_gguf_file_of_each_family_runs_on_its_own_blocks_as_its_model(gguf_file, tokenizer):
    original, path = gguf_file
    loaded, its_tokenizer = modeling.load_model(str(path))
    ids = tokenizer(TEXT)["input_ids"]
    if not original.config.model_type.startswith("gemma"):  # Gemma files hold sentencepiece vocabularies, not this
        assert its_tokenizer(TEXT)["input_ids"] == ids
    with torch.no_grad():
        want = in_q8_0(original)(torch.tensor([ids])).logits
        got = loaded(torch.tensor([ids])).logits
    # The same weights; Gemma's norms come back as (1 + w) - 1, within float32's rounding of 1.
    # (Without the file's numbers, Llama 3's and Gemma 3's rope scaling moved a logit by 2e-3 and 5e-3.)
    assert torch.allclose(got, want, rtol=0, atol=1e-5), (got - want).abs().max()

    model = quantize.quantize(loaded, "auto")
    assert quantize.method_of(model) == "gguf"
    with torch.no_grad():
        want = model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                              attention_mask=torch.ones(1, len(ids), dtype=torch.long))[0].tolist()
    assert len(set(want[len(ids):])) > 8  # a degenerate model proves nothing
    engine = Engine(model, 16 << 20, threads=THREADS)
    try:
        assert engine.numerics == "gguf/float32/cpu/layer-kernel"
        got = rounds_of_its_own_tokens(engine, ids, want)
        assert got == want[len(ids):len(ids) + len(got)]
    finally:
        engine.stop()


def test_the_file_says_what_transformers_would_leave_at_its_defaults(gguf_file):
    """Without these numbers, the Qwen3 above does not load (its heads are 16 wide, the
    default 128) and the Gemma 2 computes with caps of 50 and 30 and a scale of 256."""
    original, path = gguf_file
    config = model_files.gguf_config(path)
    head_dim = original.config.head_dim
    assert config["head_dim"] == head_dim
    family = original.config.model_type
    if family == "gemma2":
        assert (config["attn_logit_softcapping"], config["final_logit_softcapping"]) == (1.0, 2.0)
    if family.startswith("gemma"):
        assert config["query_pre_attn_scalar"] == original.config.query_pre_attn_scalar == head_dim
    else:
        assert "query_pre_attn_scalar" not in config


def metadata_file(path, arch: str, fill) -> Path:
    """A GGUF file of `arch` holding what `fill(writer)` adds (no model)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    fill(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("arch, layers, hidden, heads, scale", [
    ("gemma2", 46, 4608, 32, 144), ("gemma3", 62, 5376, 32, 168),  # the 27B models: hidden / heads
    ("gemma2", 42, 3584, 16, 128), ("gemma3", 48, 3840, 16, 128),  # 9B and 12B's depths: the head's width
])
def test_a_27b_gemma_takes_llama_cpps_attention_scale(tmp_path, arch, layers, hidden, heads, scale):
    """llama.cpp scales a Gemma 27B's attention by hidden / heads, the others' by the head's
    width (here 128, which neither rule would give by accident)."""
    def fill(writer):
        writer.add_block_count(layers)
        writer.add_embedding_length(hidden)
        writer.add_head_count(heads)
        writer.add_key_length(128)

    assert model_files.gguf_config(metadata_file(tmp_path / "m.gguf", arch, fill))["query_pre_attn_scalar"] == scale


@pytest.mark.parametrize("arch, tensor, scaling, refusal", [
    ("llama", "rope_freqs.weight", None, "rope_freqs.weight is not Llama 3's rope scaling"),
    ("phi3", "rope_factors_long.weight", None, "LongRoPE's"),
    ("qwen2", None, "yarn", "its rope scaling is 'yarn'"),
])
def test_rope_scaling_transformers_would_drop_and_we_cannot_give_is_refused(tmp_path, arch, tensor, scaling, refusal):
    """Loaded without it, the model would not be the file's: rotary divisors not of Llama
    3's form, a Phi-3 128k's LongRoPE factors, YaRN."""
    import gguf
    import numpy as np

    def fill(writer):
        writer.add_rope_freq_base(5e5)
        if scaling:
            writer.add_rope_scaling_type(gguf.RopeScalingType(scaling))
            writer.add_rope_scaling_factor(4.0)
        writer.add_tensor(tensor or "token_embd.weight", np.array([1.0, 1.0, 3.0, 8.0], dtype=np.float32))

    with pytest.raises(ValueError, match=refusal):
        model_files.gguf_config(metadata_file(tmp_path / "m.gguf", arch, fill))


def q4_k_m(name: str) -> int:
    """llama.cpp's Q4_K_M mix, as the real pair's 1.5B holds it: Q6_K for the v
    projections, the MLPs' down projections and the head, Q4_K elsewhere."""
    return ggml.Q6_K if name.endswith(("attn_v.weight", "ffn_down.weight")) or name == "output.weight" else ggml.Q4_K


def test_a_k_quant_file_runs_on_its_own_blocks_and_the_engine_is_its_generate(tmp_path, tokenizer):
    """A Qwen2 file of Q4_K and Q6_K blocks (a width of whole 256-weight superblocks): every
    linear layer, the head and the embedding take the file's blocks (each checked against
    what transformers de-quantized from the file, `ggml._blocks_of`), the logits are the
    published model's but for the activations' 16-bit rounding, and the engine's rounds
    of its own tokens are its `generate`."""
    original = build_family("qwen2", tokenizer, tmp_path / "checkpoint", seed=4, hidden=256, eos_token_id=None)
    path = write_gguf(original, tokenizer, tmp_path / "qwen2-q4_k_m.gguf", q4_k_m)
    loaded, _ = modeling.load_model(str(path))  # transformers' de-quantization: the published float32 model
    ids = tokenizer(TEXT)["input_ids"]
    with torch.no_grad():
        published = loaded(torch.tensor([ids])).logits
    model = quantize.quantize(loaded, "auto")
    assert quantize.method_of(model) == "gguf"
    kinds = {name: m.kind for name, m in model.named_modules() if isinstance(m, (ggml.GGUFLinear, ggml.GGUFEmbedding))}
    assert kinds["lm_head"] == ggml.Q6_K and kinds["model.embed_tokens"] == ggml.Q4_K
    assert kinds["model.layers.0.mlp.down_proj"] == ggml.Q6_K and kinds["model.layers.1.self_attn.v_proj"] == ggml.Q6_K
    assert not [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    with torch.no_grad():
        got = model(torch.tensor([ids])).logits
        want = model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                              attention_mask=torch.ones(1, len(ids), dtype=torch.long))[0].tolist()
    # The rounding's share: on this model 7e-4 of a largest logit of 6.3, as its Q8_0 and
    # Q4_0 files give (7.2e-4 and 7.9e-4): the same 16-bit activations, whatever the blocks.
    assert (got - published).abs().max() <= 2e-4 * published.abs().max(), (got - published).abs().max()
    assert len(set(want[len(ids):])) > 8  # a degenerate model proves nothing
    engine = Engine(model, 16 << 20, threads=THREADS)
    try:
        assert engine.numerics == "gguf/float32/cpu/layer-kernel"  # v's blocks are not q's and k's: 3 products
        got = rounds_of_its_own_tokens(engine, ids, want)
        assert got == want[len(ids):len(ids) + len(got)]
    finally:
        engine.stop()


def test_products_of_several_block_types_run_in_the_layer_kernel_as_the_python_pass(tmp_path, tokenizer):
    """Where q, k and v (gate and up) are in blocks of different types they are not one
    product (ggml.fuse), and the layer kernel takes each type's rows as a part of the
    layer's product: the same logits, bit for bit, as the Python pass of the same modules,
    for rows of several lengths in one pass and for a decode step, at more threads than
    cores."""
    from specdec.runtime.engine import model_runner

    def mix(name: str) -> int:  # up in Q6_K too, so that gate and up are two products
        return ggml.Q6_K if name.endswith("ffn_up.weight") else q4_k_m(name)

    original = build_family("qwen2", tokenizer, tmp_path / "checkpoint", seed=4, hidden=256, eos_token_id=None)
    model, _ = modeling.load_model(str(write_gguf(original, tokenizer, tmp_path / "mixed.gguf", mix)))
    model = quantize.quantize(model, "auto")
    layer = model.model.layers[0]
    assert not hasattr(layer.self_attn, "shared_q_k_v") and not hasattr(layer.mlp, "shared_gate_up")
    assert (layer.self_attn.k_proj.kind, layer.self_attn.v_proj.kind, layer.mlp.up_proj.kind) == \
        (ggml.Q4_K, ggml.Q6_K, ggml.Q6_K)
    engine = Engine(model, 16 << 20, threads=THREADS)
    try:
        kernel_forward = engine.runner.forward
        assert kernel_forward.func is model_runner._layer_kernel_forward
        seqs = [engine.new_sequence() for _ in range(3)]
        for seq, text in zip(seqs, [TEXT, "Water boils at", "the printing of books changed"]):
            seq.sync(0, tokenizer(text)["input_ids"])
        outputs = logits_by_forward(engine, seqs, (kernel_forward, model_runner._llama_forward))
        for forward, logits in zip((kernel_forward, model_runner._llama_forward), outputs):
            engine.runner.forward = forward
            seqs[0].extend([42])
            logits.append(engine.forward_now(seqs[0], 1)[0])
            seqs[0].sync(len(seqs[0].tokens) - 1, [])
        assert len(set(outputs[0][0].argmax(-1).tolist())) > 1  # the rows' logits differ: a real model
        for ours, theirs in zip(*outputs):
            assert torch.equal(ours, theirs)
    finally:
        engine.stop()
