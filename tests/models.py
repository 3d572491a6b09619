"""Small models built for the tests: random weights, real architectures, real tokenizers.

A random pair is useful only when it is not degenerate: the target's greedy output must
vary, and the draft must agree with it on part of the tokens so both the accept and the
correction paths run. The draft is the target with small noise on every weight."""

import json
import math
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast


def build_llama(tokenizer, path: Path, *, seed: int, hidden: int = 64, layers: int = 2,
                init_range: float = 0.02, eos_token_id: int | None = None, intermediate: int | None = None,
                heads: int = 4, kv_heads: int = 2) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=intermediate or 2 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=4096, tie_word_embeddings=False,
        initializer_range=init_range, bos_token_id=None, eos_token_id=eos_token_id, pad_token_id=None,
    )
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = eos_token_id
    model.generation_config.pad_token_id = eos_token_id
    save(model, tokenizer, path)
    return model


# Families the CPU's layer kernel runs (specdec.runtime.engine.model_runner._llama_like), each with
# what it differs by switched on: Qwen2's q/k/v biases, Qwen3's head norms (and a tied head),
# Gemma 3's four norms a layer (offset from 1), embedding scale, GELU-tanh, query scale and
# a local layer (a window of 24, its own rotary embedding) before a global one (its head
# untied: tied to a random embedding that it scales up, each token's own logit won, and
# greedy output repeated 4 tokens).
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text")


def build_family(family: str, tokenizer, path: Path, *, seed: int, hidden: int = 64, layers: int = 2,
                 init_range: float = 0.1, eos_token_id: int | None = 2, **config):
    """A random model of `family` (a transformers model_type) of a small real shape; its
    biases and head norms drawn away from their initial 0 and 1, so that they count."""
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = dict(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                 num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
                 max_position_embeddings=4096, tie_word_embeddings=family == "qwen3", initializer_range=init_range,
                 bos_token_id=None, eos_token_id=eos_token_id, pad_token_id=None)
    if family == "mistral":
        shape["sliding_window"] = None
    if family.startswith("gemma"):
        shape.update(sliding_window=24, layer_types=(["sliding_attention"] * (layers - 1) + ["full_attention"]))
    if family == "gemma2":  # caps small enough to count at these weights' scores and logits
        shape.update(attn_logit_softcapping=1.0, final_logit_softcapping=2.0, query_pre_attn_scalar=hidden // 4)
    config = AutoConfig.for_model(family, **{**shape, **config})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            gemma_norm = family.startswith("gemma") and "layernorm" in name  # its weights start at 0: (1 + w) = 1
            if name.endswith(("bias", "q_norm.weight", "k_norm.weight")) or gemma_norm:
                p.add_(torch.randn_like(p) * (0.05 if name.endswith("bias") else 0.3))
    model.generation_config.eos_token_id = eos_token_id
    model.generation_config.pad_token_id = eos_token_id
    save(model, tokenizer, path)
    return model


def noisy_copy(model, tokenizer, path: Path, *, noise: float, seed: int):
    """The draft: every weight plus Gaussian noise of `noise` times that weight's spread."""
    torch.manual_seed(seed)
    draft = type(model)(model.config).eval()
    draft.load_state_dict(model.state_dict())
    draft.generation_config = model.generation_config
    with torch.no_grad():
        for p in draft.parameters():
            spread = p.std() if p.numel() > 1 else p.abs()
            p.add_(torch.randn_like(p) * spread * noise)
    save(draft, tokenizer, path)
    return draft


def save(model, tokenizer, path: Path) -> None:
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


MICRO_WORDS = ["<eos>", "a", "b", "c", "d", "e", "f", "g"]  # the micro pair's vocabulary (tests/conftest.py)


def word_tokenizer(words: list[str]) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over `words` (the first is the end-of-sequence token)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders

    vocab = {w: i for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=words[1]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=words[0], unk_token=words[1])


def bpe_tokenizer(corpus: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained here on `corpus`: another vocabulary than
    SmolLM2's, sharing only the tokens both happen to learn."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def merging_tokenizers() -> tuple[PreTrainedTokenizerFast, PreTrainedTokenizerFast]:
    """Two BPE tokenizers trained here over the micro pair's letters (their ids those of
    MICRO_WORDS): the target's, its alphabet alone; a draft's, which learnt "ab" and "c"
    followed by any letter, so that after the micro prompt "abc" a committed letter x
    merges with the "c" before it ("ab" "c" -> "ab" "cx"): the history in the draft's
    tokens grows by no token, as "Fib" + "onacci" in real ones."""
    from tokenizers import Tokenizer, decoders, models, trainers

    corpus = ["ab"] * 50 + ["c" + x for x in "abcdefg"] * 40 + ["dg", "ef"] * 30

    def trained(vocab_size: int) -> PreTrainedTokenizerFast:
        tok = Tokenizer(models.BPE())
        tok.decoder = decoders.Fuse()  # pieces joined as they are
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[MICRO_WORDS[0]],
                                      initial_alphabet=MICRO_WORDS[1:], show_progress=False)
        tok.train_from_iterator(corpus, trainer)
        return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=MICRO_WORDS[0])

    target, draft = trained(len(MICRO_WORDS)), trained(len(MICRO_WORDS) + 10)
    assert target.get_vocab() == {w: i for i, w in enumerate(MICRO_WORDS)}
    return target, draft


def unigram_pair(tokenizer, draft_tokenizer, root: Path, target_logits: dict[str, float],
                 draft_logits: dict[str, float], *, seed: int) -> LlamaForCausalLM:
    """A target and a draft (of another tokenizer) whose next-token distributions are the
    same after any history, set by their logits (a piece not named gets 0 from the
    target, -12 from the draft): every token has one embedding, so that every position's
    hidden state h is the same, and each output row is its logit times h / |h|^2. Saved
    under root/"target" and root/"draft"; returns the target."""
    target = build_llama(tokenizer, root / "target", seed=seed, hidden=32, init_range=0.2)
    config = LlamaConfig(**{**target.config.to_dict(), "vocab_size": len(draft_tokenizer),
                            "eos_token_id": draft_tokenizer.eos_token_id})
    draft = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        target.model.embed_tokens.weight[:] = target.model.embed_tokens.weight[0]
        draft.load_state_dict({n: p for n, p in target.state_dict().items() if n != "lm_head.weight"
                               and n != "model.embed_tokens.weight"}, strict=False)
        draft.model.embed_tokens.weight[:] = target.model.embed_tokens.weight[0]
        h = target.model(torch.tensor([[0]])).last_hidden_state[0, -1]  # after the final norm
        unit = h / h.dot(h)
        for model, tok, logits, default in ((target, tokenizer, target_logits, 0.0),
                                            (draft, draft_tokenizer, draft_logits, -12.0)):
            for piece, i in tok.get_vocab().items():
                model.lm_head.weight[i] = logits.get(piece, default) * unit
    save(target, tokenizer, root / "target")
    save(draft, draft_tokenizer, root / "draft")
    return target


def renumbered(tokenizer) -> PreTrainedTokenizerFast:
    """`tokenizer` with its ids in reverse order: the same tokens of any text, under other
    ids (another vocabulary, as far as ids go)."""
    import json

    from tokenizers import Tokenizer

    data = json.loads(tokenizer.backend_tokenizer.to_str())
    last = len(tokenizer) - 1
    data["model"]["vocab"] = {piece: last - i for piece, i in data["model"]["vocab"].items()}
    for added in data["added_tokens"]:
        added["id"] = last - added["id"]
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(data)),
                                   eos_token=tokenizer.eos_token)


def reindexed_copy(model, tokenizer, draft_tokenizer, path: Path, *, noise: float, seed: int):
    """A draft in another vocabulary: the target with noise on every weight (noisy_copy),
    each token's embedding and output rows the target's for the same string where the
    target has it, random elsewhere."""
    torch.manual_seed(seed)
    config = LlamaConfig(**{**model.config.to_dict(), "vocab_size": len(draft_tokenizer),
                            "eos_token_id": draft_tokenizer.eos_token_id})
    draft = LlamaForCausalLM(config).eval()
    target_rows = {piece: i for piece, i in tokenizer.get_vocab().items()}
    with torch.no_grad():
        for name, p in draft.named_parameters():
            source = dict(model.named_parameters())[name]
            if name in ("model.embed_tokens.weight", "lm_head.weight"):
                for piece, i in draft_tokenizer.get_vocab().items():
                    if piece in target_rows:
                        p[i] = source[target_rows[piece]]
            else:
                p.copy_(source)
            spread = p.std() if p.numel() > 1 else p.abs()
            p.add_(torch.randn_like(p) * spread * noise)
    save(draft, draft_tokenizer, path)
    return draft


def eagle_head_for(model: LlamaForCausalLM, tokenizer, path: Path, *, seed: int, spread: float = 0.3) -> Path:
    """An EAGLE-3 head for `model`, random (each weight N(0, spread)) but for the target's
    embedding, in the SpecForge format with the target's tokenizer: it reads the target's
    first, middle and last layers' inputs. Its drafts agree with the target by chance only."""
    from specdec.runtime import eagle

    torch.manual_seed(seed)
    config = model.config
    layer = {k: v for k, v in config.to_dict().items() if k in (
        "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
        "vocab_size", "max_position_embeddings", "hidden_act", "rope_parameters", "rope_theta")}
    layer["num_hidden_layers"] = 1
    layers = config.num_hidden_layers
    head = eagle.Eagle3Head(eagle.HeadConfig(layer=layer, draft_vocab=config.vocab_size,
                                             target_hidden=config.hidden_size,
                                             aux_layers=(0, layers // 2, layers)))
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" not in name:
                p.normal_(0, spread)
        head.embed_tokens.weight.copy_(model.model.embed_tokens.weight)
    eagle.save_head(head, path, dtype=torch.float32)
    tokenizer.save_pretrained(path)
    return path


GGUF_ARCHS = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
              "gemma2": "gemma2", "gemma3_text": "gemma3"}  # the architecture llama.cpp's converter names


def in_q8_0(model):
    """`model` with each matrix as Q8_0 blocks hold it: the model a Q8_0 file is."""
    import copy

    from gguf import GGMLQuantizationType, quants

    held = copy.deepcopy(model)
    with torch.no_grad():
        for p in held.parameters():
            if p.dim() == 2:
                kind = GGMLQuantizationType.Q8_0
                p.copy_(torch.from_numpy(quants.dequantize(quants.quantize(p.numpy(), kind), kind).copy()))
    return held


def k_blocks(weight, kind: int):
    """`weight` [rows, cols] (cols a multiple of 256) as Q4_K or Q6_K blocks, in the
    file's layout (gguf's Python has no K quantizer): a plain one, each block's scale from
    its range, enough for a model whose weights are what the blocks de-quantize to."""
    import numpy as np

    from specdec.runtime import ggml

    w = weight.reshape(-1, 256).astype(np.float32)
    n = w.shape[0]
    if kind == ggml.Q6_K:
        sub = w.reshape(n, 16, 16)
        step = np.abs(sub).max(-1) / 31
        d = (step.max(-1) / 127).astype(np.float16)
        with np.errstate(divide="ignore", invalid="ignore"):
            sc = np.clip(np.nan_to_num(np.rint(step / d.astype(np.float32)[:, None])), -128, 127).astype(np.int8)
            unit = (d.astype(np.float32)[:, None] * sc)[..., None]
            q = np.clip(np.nan_to_num(np.rint(sub / unit)) + 32, 0, 63).astype(np.uint8).reshape(n, 2, 4, 32)
        ql = np.zeros((n, 2, 64), np.uint8)
        ql[:, :, :32] = q[:, :, 0] & 15 | (q[:, :, 2] & 15) << 4
        ql[:, :, 32:] = q[:, :, 1] & 15 | (q[:, :, 3] & 15) << 4
        qh = (q[:, :, 0] >> 4) | (q[:, :, 1] >> 4) << 2 | (q[:, :, 2] >> 4) << 4 | (q[:, :, 3] >> 4) << 6
        parts = [ql.reshape(n, 128), qh.reshape(n, 64), sc.view(np.uint8), d.view(np.uint8).reshape(n, 2)]
    else:
        assert kind == ggml.Q4_K, kind
        sub = w.reshape(n, 8, 32)
        low = np.maximum(0, -sub.min(-1))
        step = (sub.max(-1) + low) / 15
        d, dmin = (step.max(-1) / 63).astype(np.float16), (low.max(-1) / 63).astype(np.float16)
        with np.errstate(divide="ignore", invalid="ignore"):
            sc = np.clip(np.nan_to_num(np.rint(step / d.astype(np.float32)[:, None])), 0, 63).astype(np.uint8)
            m = np.clip(np.nan_to_num(np.rint(low / dmin.astype(np.float32)[:, None])), 0, 63).astype(np.uint8)
            unit = (d.astype(np.float32)[:, None] * sc)[..., None]
            offset = (dmin.astype(np.float32)[:, None] * m)[..., None]
            q = np.clip(np.nan_to_num(np.rint((sub + offset) / unit)), 0, 15).astype(np.uint8)
        scales = np.zeros((n, 12), np.uint8)
        scales[:, :4] = sc[:, :4] | (sc[:, 4:] >> 4) << 6
        scales[:, 4:8] = m[:, :4] | (m[:, 4:] >> 4) << 6
        scales[:, 8:] = (sc[:, 4:] & 15) | (m[:, 4:] & 15) << 4
        qs = (q[:, 0::2] | q[:, 1::2] << 4).reshape(n, 128)
        parts = [d.view(np.uint8).reshape(n, 2), dmin.view(np.uint8).reshape(n, 2), scales, qs]
    return np.concatenate(parts, axis=1).reshape(weight.shape[0], -1)


def write_gguf(model, tokenizer, path: Path, kind) -> Path:
    """`model` as a GGUF file the way llama.cpp's converter writes one: its linear layers
    and embedding in blocks of `kind` (a type, or a function of the file's tensor name
    giving each its own, as llama.cpp's mixes do: Q4_K_M), norms and biases float32, Llama's q and k rows in
    the converter's rotary order, Gemma's norm weights as 1 + w; its hyperparameters under
    the architecture's keys; `tokenizer` (a byte-level BPE, as `bpe_tokenizer` trains) as
    llama.cpp writes a GPT-2-style vocabulary."""
    import gguf
    import numpy as np
    from gguf import GGMLQuantizationType, quants

    config, arch = model.config, GGUF_ARCHS[model.config.model_type]
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    rope = config.rope_parameters  # Gemma 3's: one for each kind of layer; the file holds the global layers'
    rope = rope.get("full_attention", rope)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(config.vocab_size)
    if getattr(config, "sliding_window", None):
        writer.add_sliding_window(config.sliding_window)
    if config.model_type == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if rope.get("rope_type") == "llama3":  # the converter's own loop (not model_files', which reads it back)
        freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        context = rope["original_max_position_embeddings"]
        low, high, factor = rope["low_freq_factor"], rope["high_freq_factor"], rope["factor"]
        divisors = []
        for freq in freqs:
            wavelength = 2 * math.pi / freq
            if wavelength < context / high:
                divisors.append(1)
            elif wavelength > context / low:
                divisors.append(factor)
            else:
                smooth = (context / wavelength - low) / (high - low)
                divisors.append(1 / ((1 - smooth) / factor + smooth))
        writer.add_tensor("rope_freqs.weight", torch.tensor(divisors, dtype=torch.float32).numpy())

    bpe = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    special = set(tokenizer.all_special_ids)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))))
    writer.add_token_types([3 if i in special else 1 for i in range(len(tokenizer))])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in bpe["merges"]])
    writer.add_eos_token_id(tokenizer.eos_token_id)
    # Phi-3's config defaults a pad id of 32000, past this vocabulary; Gemma's tokenizer wants an unknown token.
    writer.add_pad_token_id(tokenizer.eos_token_id)
    writer.add_unk_token_id(tokenizer.eos_token_id)
    writer.add_add_bos_token(False)

    names = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch),
                                     config.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        data = tensor.detach().float().numpy()
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            n = heads if name.endswith("q_proj.weight") else kv_heads
            data = data.reshape(n, 2, data.shape[0] // n // 2, -1).swapaxes(1, 2).reshape(data.shape)
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            data = data + 1
        file_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert file_name is not None, name
        if data.ndim == 2:
            its = kind(file_name) if callable(kind) else kind
            data = np.ascontiguousarray(data)
            blocks = k_blocks(data, its) if its in (12, 14) else quants.quantize(data, GGMLQuantizationType(its))
            writer.add_tensor(file_name, blocks, raw_dtype=GGMLQuantizationType(its))
        else:
            writer.add_tensor(file_name, np.ascontiguousarray(data, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
