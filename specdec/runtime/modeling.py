"""Loading causal LMs: a model from where specdec.model_files finds it, in eval mode on
its device, with what the services say of it (ModelInfo)."""

import json
import logging
import time
from pathlib import Path

import torch

from specdec.defaults import DEFAULT_DRAFT, DEFAULT_TARGET  # noqa: F401 (the services' defaults, by this name)
from specdec.model_files import gguf_file, load_tokenizer, resolve, vocab_fingerprint

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class _FewRowsHead(torch.nn.Module):
    """The output head, computed as W @ hᵀ for 2 to 16 rows. A verify pass's K+1
    rows through SmolLM2's 49k-row head cost less that way than as h @ Wᵀ (docs/benchmarks.md#figures-behind-the-code); one row (decoding) and many rows (prefill, training)
    keep the usual product."""

    def __init__(self, head: torch.nn.Linear):
        super().__init__()
        self.weight = head.weight  # shared: a tied embedding stays tied

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        rows = hidden.reshape(-1, hidden.shape[-1])
        if not 2 <= rows.shape[0] <= 16:
            return torch.nn.functional.linear(hidden, self.weight)
        return (self.weight @ rows.T).T.reshape(*hidden.shape[:-1], -1)


def load_model(spec: str, dtype: str = "float32", device: str = "cpu"):
    """Returns (model, tokenizer), the model in eval mode on `device`."""
    from transformers import AutoModelForCausalLM

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    started = time.monotonic()
    log.info("loading model %s (%s, %s)", spec, dtype, device)
    path = resolve(spec)
    tokenizer = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype]).to(device).eval()
    model.config.specdec_gguf = gguf_file(spec)  # its blocks can replace the de-quantized weights (--quantize)
    head = model.get_output_embeddings()
    if device == "cpu" and isinstance(head, torch.nn.Linear) and head.bias is None:
        model.set_output_embeddings(_FewRowsHead(head))
    log.info("loaded %s in %.1f s: %.1fM parameters", spec, time.monotonic() - started,
             sum(p.numel() for p in model.parameters()) / 1e6)
    return model, tokenizer


def restrict_output(model, spec: str) -> torch.Tensor | None:
    """If the model directory names a draft vocabulary (draft_vocab.json), cut the output
    head down to those rows and return their token ids: logits index into them. A draft
    emits only those tokens, and on a CPU the full head is much of a small model's step."""
    path = Path(resolve(spec)) / "draft_vocab.json"
    if not path.is_file():
        return None
    token_ids = torch.tensor(json.loads(path.read_text())["token_ids"], dtype=torch.long)
    full = model.get_output_embeddings()
    head = torch.nn.Linear(full.weight.shape[1], len(token_ids), bias=False, device=full.weight.device,
                           dtype=full.weight.dtype)
    with torch.no_grad():
        head.weight.copy_(full.weight[token_ids.to(full.weight.device)])
    model.lm_head = head  # untied: the input embedding keeps every row
    log.info("output restricted to the %d tokens of the draft vocabulary", len(token_ids))
    return token_ids.to(full.weight.device)


def eos_token_ids(model, tokenizer) -> list[int]:
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return []
    return sorted({eos} if isinstance(eos, int) else set(eos))


def max_positions(model) -> int:
    """The longest history a session may hold: the model's positions. (Its sliding-window
    layers, if any, attend within their window: specdec.runtime.engine.attention.)"""
    return int(getattr(model.config, "max_position_embeddings", 0) or 1 << 20)


def sliding_window(config) -> int | None:
    """The window of a model's sliding-window layers, if it has any."""
    window = getattr(config, "sliding_window", None)
    kinds = set(getattr(config, "layer_types", None) or [])
    sliding = config.model_type in ("mistral", "phi3") or "sliding_attention" in kinds or \
        getattr(config, "use_sliding_window", False)
    return int(window) if sliding and window else None


def model_info(model, tokenizer, name: str, kind: str):
    from specdec.api.common.v1 import common_pb2

    return common_pb2.ModelInfo(
        model_name=name,
        vocab_size=model.config.vocab_size,
        vocab_fingerprint=vocab_fingerprint(tokenizer),
        eos_token_ids=eos_token_ids(model, tokenizer),
        max_positions=max_positions(model),
        kind=kind,
    )
