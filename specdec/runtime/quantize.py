"""int8 weights and activations for the CPU: `--quantize int8`.

Every Linear layer (the output head too) keeps its weight in int8 with one scale per
output row; at run time each input row is quantized with a scale of its own, multiplied
in integers (int32 accumulation: exact) and scaled back to float.

The integer product runs in fbgemm where it is exact (x86: checked once, on the inputs
that would overflow a 16-bit pair sum) and in `torch._int_mm` elsewhere. fbgemm's
kernel grows far less with the rows of a pass: a 5-token verify pass of the default
target cost 1.19-1.29x a one-token step with it, 1.63-1.67x with `_int_mm`, at the same
one-token cost (`specdec bench engine --quantize int8`).

Per-row activation scales are the point: a row's result does not depend on the other
rows of the pass, so a verify pass of K+1 tokens among other sessions' rows gives each
token exactly what a one-token step gives it. Dynamic quantization with one scale per
input tensor (`torch.ao.quantization.quantize_dynamic`) was faster still per call but
couples the rows of a pass: a token's logits would change with the batch.

Linear layers that read the same input (a Llama-style layer's q, k and v projections; its
gate and up projections) are quantized as one: their input is quantized and multiplied
once, and each takes its own columns of the product, which are the same numbers the
layers give apart (per-column integer sums and scales). On the default target that cuts
a one-token step's 211 products to 121 and its time by about a tenth.

Rounding activations to int8 also magnifies any float difference: a last-bit change in
an attention output can move a value across a rounding step, and greedy outputs part
within a few dozen tokens (the default pair, greedy). Float32 attention is not
batch-invariant (its reductions follow the shapes of the pass), so an int8 model
attends in float64 and casts back: the float32 result no longer depends on the pass.
Norms, rotary embeddings and activations already work row by row, element by element."""

import functools
import logging
import warnings

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from specdec import flags
from specdec.runtime import ggml

log = logging.getLogger(__name__)

# q8_m, q8_0, q4_0: any other model's weights quantized at load into blocks (q8_m: ours,
# ggml.q8_m_blocks; the others GGUF's types), multiplied by the same kernels (and a
# Llama-family model run by the same layer stack) as a GGUF file's. auto: on a CPU, a GGUF
# file's own blocks where it holds its layers in types we multiply (specdec.runtime.ggml), q8_m for
# any other model whose layers take whole blocks (as fast as q8_0 within a few percent, and
# far closer to a model de-quantized from a GGUF file: docs/benchmarks.md), int8 where the
# kernels cannot be built; none elsewhere
BLOCKS = {"q8_m": ggml.Q8_M, "q8_0": ggml.Q8_0, "q4_0": ggml.Q4_0}
METHODS = flags.QUANTIZE
# Not named "...sdpa...": transformers would then require the model to take sdpa (Gemma 2 does not).
FLOAT64_ATTENTION = "specdec_float64"


def float64_attention(module, query, key, value, attention_mask, **kwargs):
    """Transformers' sdpa in float64, cast back to the query's dtype; with Gemma 2's
    soft-capped scores, which sdpa cannot take, the engine's written-out attention."""
    if kwargs.get("softcap"):
        return _float64_capped(module, query, key, value, attention_mask, **kwargs), None
    if attention_mask is not None and attention_mask.is_floating_point():
        attention_mask = attention_mask.double()
    out, weights = sdpa_attention_forward(module, query.double(), key.double(), value.double(), attention_mask,
                                          **kwargs)
    return out.to(query.dtype), weights


def _float64_capped(module, query, key, value, mask, scaling=None, softcap=None, **_) -> torch.Tensor:
    """query [b, heads, Q, d], key, value [b, kv_heads, L, d], mask as sdpa takes it (None:
    causal, the last Q keys the queries' own) -> [b, Q, heads, d], as sdpa's forward."""
    from specdec.runtime.engine.attention import attend

    q, k, v = query.double(), key.double(), value.double()
    if mask is None and q.shape[2] > 1:
        width, length = q.shape[2], k.shape[2]
        mask = torch.ones(width, length, dtype=torch.bool, device=q.device).tril(length - width)[None, None]
    elif mask is not None and mask.is_floating_point():
        mask = mask == 0  # an additive mask: 0 where the query attends
    scale = module.head_dim ** -0.5 if scaling is None else scaling
    return attend(q, k, v, mask, scale, softcap).transpose(1, 2).contiguous().to(query.dtype)


AttentionInterface.register(FLOAT64_ATTENTION, float64_attention)
# The masks sdpa takes (a sliding window's, a padded batch's): transformers builds none for
# an attention function it does not know, and sdpa then attends causally to every position.
AttentionMaskInterface.register(FLOAT64_ATTENTION, sdpa_mask)


def method_of(model) -> str:
    """What `quantize` did to the model: none, int8, gguf, q8_m, q8_0 or q4_0."""
    return getattr(model.config, "specdec_quantize", "none")


def is_int8(model) -> bool:
    return method_of(model) == "int8"


def attention_dtype(model, dtype: torch.dtype) -> torch.dtype:
    """What attention computes in for `model`: its activations' dtype, float64 for a
    quantized model (batch invariance; see the module docstring)."""
    return torch.float64 if method_of(model) != "none" else dtype


def _fbgemm_pack(weight_int8: torch.Tensor, scale: torch.Tensor):
    with warnings.catch_warnings():  # quantized tensors are deprecated as a user API, not the kernels
        warnings.simplefilter("ignore")
        weight = torch._make_per_channel_quantized_tensor(weight_int8, scale.double(),
                                                          torch.zeros(len(scale), dtype=torch.long), 0)
        return torch.ops.quantized.linear_prepack(weight, None)


def _fbgemm_product(packed, rows_int: torch.Tensor) -> torch.Tensor:
    """scale_w * (rows_int @ weight_int8.T) for float rows holding integers in [-127, 127]:
    fbgemm takes them as uint8 with zero point 128 and scale 1 (exact)."""
    return torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(rows_int, 1.0, 128, packed)


@functools.cache
def kernel() -> str:
    """"fbgemm" where it gives the exact integer product on this CPU, row by row, else
    "int_mm". Without VNNI, fbgemm sums pairs of uint8 x int8 products in 16 bits, which
    overflow on large values: those are the values checked."""
    try:
        draw = torch.Generator().manual_seed(0)
        w = torch.randint(-127, 128, (64, 256), dtype=torch.int8, generator=draw)
        w[0], w[1] = 127, -127
        x = torch.randint(-127, 128, (5, 256), generator=draw).float()
        x[0], x[1] = 127, -127
        scale = torch.rand(64, generator=draw) + 0.5
        got = _fbgemm_product(_fbgemm_pack(w, scale), x)
        exact = (x.double() @ w.double().T) * scale.double()
        alone = torch.cat([_fbgemm_product(_fbgemm_pack(w, scale), x[i:i + 1]) for i in range(5)])
        if torch.equal(got, exact.float()) and torch.equal(got, alone):
            return "fbgemm"
        log.info("fbgemm's int8 product is not exact on this CPU: using torch._int_mm")
    except (RuntimeError, AttributeError) as err:  # no fbgemm (ARM builds use qnnpack)
        log.info("fbgemm unavailable (%s): using torch._int_mm", err)
    return "int_mm"


class Int8Linear(torch.nn.Module):
    def __init__(self, linear: torch.nn.Module, product: str | None = None):
        """product: "fbgemm" or "int_mm" (default: `kernel()`)."""
        super().__init__()
        weight = linear.weight.detach().float()
        scale = weight.abs().amax(dim=1).clamp(min=1e-12) / 127
        weight_int8 = torch.round(weight / scale[:, None]).to(torch.int8)  # [out, in]
        self.out_features = weight_int8.shape[0]
        self.packed = _fbgemm_pack(weight_int8, scale) if (product or kernel()) == "fbgemm" else None
        self.register_buffer("weight_int8", None if self.packed is not None else weight_int8)
        self.register_buffer("weight_scale", scale)  # [out]
        bias = getattr(linear, "bias", None)
        self.register_buffer("bias", None if bias is None else bias.detach().float())
        self.out_dtype = linear.weight.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).float()
        scale = rows.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
        rows_int = torch.round(rows / scale)
        if self.packed is not None:
            y = _fbgemm_product(self.packed, rows_int) * scale
        else:
            # The transposed view, not a transposed copy: as fast or faster for every shape of
            # SmolLM2 but the output head at 2+ rows (docs/benchmarks.md#figures-behind-the-code).
            y = torch._int_mm(rows_int.to(torch.int8), self.weight_int8.t())
            y = y.float() * scale * self.weight_scale
        if self.bias is not None:
            y = y + self.bias
        return y.to(self.out_dtype).reshape(*x.shape[:-1], self.out_features)


class _Shared(torch.nn.Module):
    """Linear layers that read the same input, as one product over their stacked rows
    (`fused`), each taking its own columns."""

    def __init__(self, fused: torch.nn.Module, sizes: list[int]):
        super().__init__()
        self.linear = fused
        ends = torch.tensor(sizes).cumsum(0).tolist()
        self.columns = list(zip([0] + ends[:-1], ends))
        self.input, self.output, self.waiting = None, None, set()

    def part(self, i: int, x: torch.Tensor) -> torch.Tensor:
        # The product is made for the first part to see an input, and kept only until each
        # part has taken its columns: the parts of a layer are called one after the other
        # with the same tensor (held here, so no other tensor can take its identity).
        if x is not self.input or i not in self.waiting:
            self.input, self.output = x, self.linear(x)
            self.waiting = set(range(len(self.columns)))
        output = self.output
        self.waiting.discard(i)
        if not self.waiting:
            self.input = self.output = None
        start, end = self.columns[i]
        return output[..., start:end]


class _Part(torch.nn.Module):
    """One of the layers of a _Shared: its columns of the shared product."""

    def __init__(self, shared: _Shared, i: int):
        super().__init__()
        object.__setattr__(self, "shared", shared)  # a module of the parent's, not of each part
        self.i = i
        self.out_features = shared.columns[i][1] - shared.columns[i][0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared.part(self.i, x)


# Sibling layers that read the same input, by their names in Llama-style models.
SHARED_INPUT = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _stacked(linears: list[torch.nn.Module]) -> "torch.nn.Linear | None":
    """One Linear over the layers' stacked rows, in their dtype and on their device."""
    if not all(isinstance(m, torch.nn.Linear) for m in linears) or len({m.bias is None for m in linears}) > 1:
        return None
    weight = linears[0].weight
    stacked = torch.nn.Linear(linears[0].in_features, sum(m.out_features for m in linears),
                              bias=linears[0].bias is not None, dtype=weight.dtype, device=weight.device)
    with torch.no_grad():
        stacked.weight.copy_(torch.cat([m.weight for m in linears]))
        if stacked.bias is not None:
            stacked.bias.copy_(torch.cat([m.bias for m in linears]))
    return stacked.requires_grad_(False)


def _int8_fused(linears: list[torch.nn.Module]) -> "Int8Linear | None":
    return None if (stacked := _stacked(linears)) is None else Int8Linear(stacked)


def share_products(model) -> int:
    """Linear layers that read the same input as one product in the model's own dtype (a
    GPU's path: each product is a kernel launch, and a small model's step is launches);
    -> how many products now serve two or more layers. Leaves layers already shared."""
    before = sum(isinstance(m, _Shared) for m in model.modules())
    for parent in list(model.modules()):
        _share_inputs(parent, _stacked)
    return sum(isinstance(m, _Shared) for m in model.modules()) - before


def share_fused(model) -> None:
    """A model whose layers compute q|k|v and gate|up as one product each already (Phi-3's
    qkv_proj and gate_up_proj) gets the parts that _Shared gives the others (shared_q_k_v,
    shared_gate_up, each over its own product), and its MLP's activation by the others'
    name (act_fn), so that the engine's passes take it as they take them. Its own forward
    is unchanged; a second call changes nothing."""
    for module in model.modules():
        qkv, gate_up = getattr(module, "qkv_proj", None), getattr(module, "gate_up_proj", None)
        if qkv is not None and not hasattr(module, "shared_q_k_v"):
            q, kv = module.config.num_attention_heads * module.head_dim, module.num_key_value_heads * module.head_dim
            if qkv.out_features == q + 2 * kv:
                module.add_module("shared_q_k_v", _Shared(qkv, [q, kv, kv]))
        if gate_up is not None and not hasattr(module, "shared_gate_up") and gate_up.out_features % 2 == 0:
            module.add_module("shared_gate_up", _Shared(gate_up, [gate_up.out_features // 2] * 2))
            module.act_fn = module.activation_fn


def _share_inputs(parent: torch.nn.Module, fuse) -> None:
    """fuse(layers) -> one module computing their stacked rows, or None (leave them)."""
    for names in SHARED_INPUT:
        linears = [getattr(parent, name, None) for name in names]
        if any(m is None or not hasattr(m, "in_features") for m in linears):
            continue
        if len({m.in_features for m in linears}) > 1 or (fused := fuse(linears)) is None:
            continue
        shared = _Shared(fused, [m.out_features for m in linears])
        parent.add_module("shared_" + "_".join(n.split("_")[0] for n in names), shared)
        for i, name in enumerate(names):
            setattr(parent, name, _Part(shared, i))


def _auto(model, source: str | None) -> str:
    if ggml.supported(source):
        return "gguf"
    if ggml.quantizable(model):
        log.info("int8: %s take inputs that are not whole blocks of 32", ", ".join(ggml.quantizable(model)[:3]))
        return "int8"
    return "q8_m" if ggml.available() else "int8"


def quantize(model, method: str):
    """Quantizes `model` in place (method "none" leaves it); returns it. Call it after any
    change to the output head (the drafter's cut to its vocabulary): the head is
    quantized as it is then."""
    if method not in METHODS:
        raise ValueError(f"quantize must be one of {', '.join(METHODS)}, got {method!r}")
    source = getattr(model.config, "specdec_gguf", None)  # the .gguf file it was loaded from (specdec.runtime.modeling)
    if method == "auto":
        method = "none" if model.device.type != "cpu" else _auto(model, source)
    if method == "none":
        return model
    if model.device.type != "cpu":
        raise ValueError(f"--quantize {method} is the CPU path; the model is on {model.device} "
                         "(use --dtype bfloat16 there)")
    if method == "gguf" or method in BLOCKS:
        _to_blocks(model, method, source)
    else:
        _to_int8(model)
    _let_go_of_the_checkpoint(model)
    model.config.specdec_quantize = method
    if model._can_set_attn_implementation():
        model.set_attn_implementation(FLOAT64_ATTENTION)  # the engine sets its own, in float64 too
    return model


def _let_go_of_the_checkpoint(model) -> None:
    """The float tensors the quantized model keeps (norms, biases) copied into memory of
    their own. transformers maps the checkpoint's file and makes every tensor a view of
    that one map: while a norm's weight held it, the map stayed, and with it every page
    of the float weights the quantization had read (the real pair's 1.5B: 9.1 GiB
    resident for 1.1 GB of blocks, 2.6 after)."""
    with torch.no_grad():
        for module in model.modules():
            for p in module.parameters(recurse=False):
                p.data = p.data.clone()
            for name, b in list(module.named_buffers(recurse=False)):
                if b is not None and name != "packed":  # the blocks: already ours, on huge pages (ggml.arrange)
                    setattr(module, name, b.clone())


def _to_blocks(model, method: str, source: str | None) -> None:
    """The linears in GGUF blocks for the C++ kernels: a .gguf file's own ("gguf") or
    blocks quantized at load (BLOCKS)."""
    if method == "gguf" and not source:
        raise ValueError("--quantize gguf keeps a GGUF file's blocks: the model was not loaded from a .gguf file")
    replaced = ggml.load_blocks(model, source) if method == "gguf" else ggml.quantize_blocks(model, BLOCKS[method])
    for parent in list(model.modules()):
        _share_inputs(parent, ggml.fuse)
    norms = ggml.replace_norms(model)
    ggml.replace_activations(model)
    held = ggml.arrange(model)
    log.info("%d layers run on %s (%.0f MB, on huge pages where the system gives them), %d norms in one "
             "kernel each", replaced, "the GGUF file's own blocks" if method == "gguf" else
             f"{method.upper()} blocks quantized at load", held / 1e6, norms)


def _to_int8(model) -> None:
    """Every linear and the head in int8 products through torch."""
    head = model.get_output_embeddings()
    for parent in list(model.modules()):
        _share_inputs(parent, _int8_fused)
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear) or child is head:
                setattr(parent, name, Int8Linear(child))
    if ggml.available():  # a row's activations the same bits whatever the pass's split
        ggml.replace_activations(model)
