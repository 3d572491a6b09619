"""int8 weights and activations for the CPU: `--quantize int8`.

Every Linear layer (the output head too) keeps its weight in int8 with one scale per
output row; at run time each input row is quantized with a scale of its own, multiplied
in integers (`torch._int_mm`, int32 accumulation: exact) and scaled back to float.

Per-row activation scales are the point: a row's result does not depend on the other
rows of the pass, so a verify pass of K+1 tokens among other sessions' rows gives each
token exactly what a one-token step gives it. Dynamic quantization with one scale per
input tensor (`torch.ao.quantization.quantize_dynamic`) was faster still per call but
couples the rows of a pass: a token's logits would change with the batch.

Rounding activations to int8 also magnifies any float difference: a last-bit change in
an attention output can move a value across a rounding step, and greedy outputs part
within a few dozen tokens (measured on the default pair). Float32 attention is not
batch-invariant (its reductions follow the shapes of the pass), so an int8 model
attends in float64 and casts back: the float32 result no longer depends on the pass.
Norms, rotary embeddings and activations already work row by row, element by element."""

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

METHODS = ("none", "int8", "auto")  # auto: int8 on a CPU, none elsewhere
FLOAT64_ATTENTION = "specdec_float64_sdpa"


def float64_attention(module, query, key, value, attention_mask, **kwargs):
    """Transformers' sdpa in float64, cast back to the query's dtype."""
    if attention_mask is not None and attention_mask.is_floating_point():
        attention_mask = attention_mask.double()
    out, weights = sdpa_attention_forward(module, query.double(), key.double(), value.double(), attention_mask,
                                          **kwargs)
    return out.to(query.dtype), weights


AttentionInterface.register(FLOAT64_ATTENTION, float64_attention)


def attention_dtype(model, dtype: torch.dtype) -> torch.dtype:
    """What attention computes in for `model` (its activations' dtype unless int8)."""
    return torch.float64 if getattr(model.config, "specdec_quantize", "none") == "int8" else dtype


class Int8Linear(torch.nn.Module):
    def __init__(self, linear: torch.nn.Module):
        super().__init__()
        weight = linear.weight.detach().float()
        scale = weight.abs().amax(dim=1).clamp(min=1e-12) / 127
        self.register_buffer("weight_int8", torch.round(weight / scale[:, None]).to(torch.int8))  # [out, in]
        self.register_buffer("weight_scale", scale)  # [out]
        bias = getattr(linear, "bias", None)
        self.register_buffer("bias", None if bias is None else bias.detach().float())
        self.out_dtype = linear.weight.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).float()
        scale = rows.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
        # The transposed view, not a transposed copy: measured as fast or faster for every
        # shape of SmolLM2 but the output head at 2+ rows, where it costs 0.3 ms more.
        y = torch._int_mm(torch.round(rows / scale).to(torch.int8), self.weight_int8.t())
        y = y.float() * scale * self.weight_scale
        if self.bias is not None:
            y = y + self.bias
        return y.to(self.out_dtype).reshape(*x.shape[:-1], self.weight_int8.shape[0])


def quantize(model, method: str):
    """Quantizes `model` in place (method "none" leaves it); returns it. Call it after any
    change to the output head (the drafter's cut to its vocabulary): the head is
    quantized as it is then."""
    if method not in METHODS:
        raise ValueError(f"quantize must be one of {', '.join(METHODS)}, got {method!r}")
    if method == "auto":
        method = "int8" if model.device.type == "cpu" else "none"
    if method == "none":
        return model
    if model.device.type != "cpu":
        raise ValueError(f"--quantize int8 is the CPU path; the model is on {model.device} "
                         "(use --dtype bfloat16 there)")
    head = model.get_output_embeddings()
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear) or child is head:
                setattr(parent, name, Int8Linear(child))
    model.config.specdec_quantize = method
    if model._can_set_attn_implementation():
        model.set_attn_implementation(FLOAT64_ATTENTION)  # the engine sets its own, in float64 too
    return model
