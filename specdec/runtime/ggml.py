"""A GGUF model's weights as the file ships them: `--quantize gguf`.

The model is built the usual way (transformers de-quantizes the file once into a model
directory, `specdec.runtime.modeling`); then every linear layer and the embedding whose GGUF
tensor is in a block type we multiply (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, and the K types Q4_K,
Q5_K, Q6_K that llama.cpp's Q4_K_M and Q5_K_M files hold) give up their float32 weight
for the file's blocks, and run through `specdec/runtime/kernels/gguf_cpu.cpp`. Nothing is
re-quantized: the weights are the published model's to the bit (checked here, block by
block, against what transformers de-quantized), at the blocks' bytes (Q4_K: 4.5 bits a
weight, Q4_1 5, against 8 for our int8 and 32 for float32). The activations are rounded to
16-bit integers per block of 32 (at most 2^-16 of the block's largest value off; llama.cpp
rounds them to 8 bits), so a block's products are exact integer sums: that, and the order
of float sums, is all that differs from the published float32 model. The blocks are
rearranged once, 8 rows side by side (`pack`): the same bytes, in the order the kernel
reads them.

llama.cpp's converter stores the q and k projections of Llama-style models with their
rows permuted (its rotary layout); the rows are put back here, whole blocks at a time."""

import logging
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger(__name__)

Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K = 2, 3, 6, 7, 8, 12, 13, 14  # ggml's type ids
Q8_M = 100  # ours, in no file: Q4_1's form with 8-bit integers (`q8_m_blocks`)
TYPES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q5_0: "Q5_0", Q5_1: "Q5_1", Q8_0: "Q8_0", Q4_K: "Q4_K", Q5_K: "Q5_K",
         Q6_K: "Q6_K", Q8_M: "Q8_M"}


K_TYPES = (Q4_K, Q5_K, Q6_K)  # superblocks of 256 weights; the others' blocks hold 32


def block_weights(kind: int) -> int:
    """The weights of one of the type's blocks in a file: its rows are whole blocks."""
    return 256 if kind in K_TYPES else 32


def _kernels():
    from specdec.runtime.kernels import cpu

    return cpu()


class GGUFLinear(torch.nn.Module):
    """y = x Wᵀ (+ b) with W as GGUF blocks: the file's [out_features, in_features / 32
    blocks], or (`rows` given) already in the kernels' packed layout (`pack`)."""

    def __init__(self, blocks: torch.Tensor, kind: int, in_features: int, bias: torch.Tensor | None = None,
                 rows: int | None = None):
        super().__init__()
        self.register_buffer("packed", blocks if rows is not None else pack(blocks, kind))
        self.register_buffer("bias", None if bias is None else bias.detach().float())
        self.kind, self.in_features = kind, in_features
        self.out_features = rows if rows is not None else blocks.shape[0]
        self._matmul = _kernels().matmul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._matmul(x.reshape(-1, self.in_features).float(), self.packed, self.kind, self.out_features)
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{TYPES[self.kind]}, in_features={self.in_features}, out_features={self.out_features}"


class GGUFEmbedding(torch.nn.Module):
    """An embedding whose rows are GGUF blocks (packed, `pack`), de-quantized as they are
    looked up, times the scale of the embedding it replaces where that one has one
    (Gemma's `embed_scale`, sqrt(hidden): its embedding's forward multiplies by it, and a
    plain lookup in its place lost it)."""

    def __init__(self, packed: torch.Tensor, kind: int, dim: int, rows: int, scale: torch.Tensor | None = None):
        super().__init__()
        self.register_buffer("packed", packed)
        self.kind, self.embedding_dim, self.num_embeddings = kind, dim, rows
        self.register_buffer("embed_scale", None if scale is None else scale.detach().float(), persistent=False)
        self._dequantize = _kernels().dequantize

    @classmethod
    def replacing(cls, embedding: torch.nn.Module, packed: torch.Tensor, kind: int) -> "GGUFEmbedding":
        rows, dim = embedding.weight.shape
        return cls(packed, kind, dim, rows, getattr(embedding, "embed_scale", None))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self._dequantize(self.packed, self.kind, self.num_embeddings,
                                ids.reshape(-1)).reshape(*ids.shape, self.embedding_dim)
        return rows if self.embed_scale is None else rows * self.embed_scale


HUGE_PAGE = 2 << 20


def arrange(model) -> int:
    """Moves the packed blocks of every GGUF module of the model into one buffer on huge
    pages (Linux's transparent huge pages, which it gives where asked: `madvise`, the
    default of most distributions); -> its bytes. A one-token pass streams every weight
    once: on 4 KiB pages it walked the page tables for each 4 KiB it read (the default
    target's 96 MB: some 24,000 pages a pass, far past what the TLB holds). Measured:
    docs/benchmarks.md#figures-behind-the-code."""
    modules = [m for m in model.modules() if isinstance(m, (GGUFLinear, GGUFEmbedding))]
    held = {}  # a tied head shares its embedding's blocks: moved once
    for m in modules:
        held.setdefault(m.packed.data_ptr(), m.packed)
    if not held:
        return 0
    sizes = [-(-t.numel() // 64) * 64 for t in held.values()]  # each tensor on a cache line of its own
    buffer, offset, moved = _huge_page_buffer(sum(sizes)), 0, {}
    for (ptr, tensor), size in zip(held.items(), sizes):
        moved[ptr] = buffer[offset:offset + tensor.numel()].view(tensor.shape).copy_(tensor)
        offset += size
    for m in modules:
        m.packed = moved[m.packed.data_ptr()]
    return buffer.numel()


def _huge_page_buffer(size: int) -> torch.Tensor:
    """size bytes, starting on a 2 MiB boundary of a private anonymous map marked for huge
    pages; plain memory where the system has no such map."""
    import mmap

    try:
        area = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        area.madvise(mmap.MADV_HUGEPAGE)  # before the first write: the pages are made then
    except (AttributeError, OSError, ValueError) as err:  # not Linux, or no transparent huge pages
        log.info("GGUF blocks on ordinary pages (%s)", err)
        return torch.empty(size, dtype=torch.uint8)
    whole = torch.frombuffer(area, dtype=torch.uint8)  # keeps the map alive as long as a view of it
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start:start + size]


def pack(blocks: torch.Tensor, kind: int) -> torch.Tensor:
    """The file's blocks [rows, bytes] in the kernels' layout: rows in groups of 8, their
    integers interleaved (specdec/runtime/kernels/gguf_cpu.cpp). The same bytes, rearranged."""
    return _kernels().pack(blocks, kind)


class RMSNorm(torch.nn.Module):
    """Llama's RMSNorm in one kernel call (specdec/runtime/kernels/norm_cpu.cpp) where torch takes
    seven small operations: the same formula, the sum of squares in float64."""

    NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "Phi3RMSNorm")  # y = w * (x * rsqrt(mean(x^2) + eps)) all
    # y = (x * rsqrt(mean(x^2) + eps)) * (1 + w), in float32: the same product with w's
    # offset rounded once, as Gemma's own norm rounds it at each call
    OFFSET_NORMS = ("Gemma2RMSNorm", "Gemma3RMSNorm")

    def __init__(self, norm: torch.nn.Module):
        super().__init__()
        self.weight, self.variance_epsilon = self.weight_and_eps(norm)
        self._norm = _kernels().rms_norm

    @classmethod
    def weight_and_eps(cls, norm: torch.nn.Module) -> tuple[torch.Tensor, float]:
        """A norm of NORMS or OFFSET_NORMS as y = w * (x * rsqrt(mean(x^2) + eps)) takes it:
        (w, eps), Gemma's w being its 1 + w rounded once to float32."""
        if type(norm).__name__ in cls.OFFSET_NORMS:
            return torch.nn.Parameter(1.0 + norm.weight.detach().float(), requires_grad=False), norm.eps
        return norm.weight, norm.variance_epsilon

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._norm(x.float(), self.weight.float(), self.variance_epsilon).to(x.dtype)


def replace_norms(model, norm=RMSNorm) -> int:
    """Puts `norm(module)` (RMSNorm: this file's kernel) in place of the model's Llama-style
    norms and Gemma's (OFFSET_NORMS, which `norm` takes as 1 + w); -> how many."""
    replaced, kinds = 0, RMSNorm.NORMS + RMSNorm.OFFSET_NORMS
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child).__name__ in kinds:
                setattr(parent, name, norm(child))
                replaced += 1
    return replaced


class SiLU(torch.nn.Module):
    """silu in one kernel call (specdec/runtime/kernels/activation_cpu.cpp): each value the same
    bits wherever it lies in a pass, at any thread count, where torch's silu rounds the
    values its SIMD lanes take and the ones left over differently."""

    def __init__(self):
        super().__init__()
        self._silu = _kernels().silu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._silu(x.float()).to(x.dtype)


class GELUTanh(torch.nn.Module):
    """GELU's tanh approximation (Gemma's gelu_pytorch_tanh) in one kernel call, row-invariant
    as SiLU is."""

    def __init__(self):
        super().__init__()
        self._gelu = _kernels().gelu_tanh

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._gelu(x.float()).to(x.dtype)


# the config's activation -> (the class names transformers gives it, ours)
ACTIVATIONS = {"silu": (("SiLU", "SiLUActivation"), SiLU), "gelu_pytorch_tanh": (("GELUTanh",), GELUTanh)}


def activation_name(config) -> str | None:
    """The MLP's activation as the config names it (Gemma's `hidden_activation`, the others'
    `hidden_act`)."""
    return getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)


def replace_activations(model) -> int:
    """Puts ours (ACTIVATIONS) in place of the activation of the model's MLPs (their
    `act_fn`, Phi-3's `activation_fn`: the same module where quantize.share_fused named it
    both); -> how many."""
    replaced = 0
    if (entry := ACTIVATIONS.get(activation_name(model.config))) is not None:
        names, ours = entry
        for module in model.modules():
            made = None
            for name in ("act_fn", "activation_fn"):
                if type(getattr(module, name, None)).__name__ in names:
                    made = made or ours()
                    setattr(module, name, made)
            replaced += made is not None
    return replaced


def fuse(linears: list[GGUFLinear]) -> GGUFLinear | None:
    """Layers that read the same input as one: their block rows stacked (one kernel call).
    The packed groups of 8 rows stack where every layer but the last fills its groups."""
    if not all(isinstance(m, GGUFLinear) for m in linears) or len({m.kind for m in linears}) > 1 \
            or len({m.bias is None for m in linears}) > 1 or any(m.out_features % 8 for m in linears[:-1]):
        return None
    bias = None if linears[0].bias is None else torch.cat([m.bias for m in linears])
    return GGUFLinear(torch.cat([m.packed for m in linears]), linears[0].kind, linears[0].in_features, bias,
                      rows=sum(m.out_features for m in linears))


def _rotary_permutation(rows: int, heads: int) -> torch.Tensor:
    """Where llama.cpp's converter put each row of a q or k projection: row j of the
    file is row order[j] of the model."""
    return torch.arange(rows).reshape(heads, 2, rows // heads // 2).transpose(1, 2).reshape(rows)


def _tensors(path: Path) -> tuple[str, dict]:
    from gguf import GGUFReader

    reader = GGUFReader(path)
    field = reader.fields["general.architecture"]
    arch = bytes(field.parts[field.data[0]]).decode()
    return arch, {t.name: t for t in reader.tensors}


def _blocks_of(weight: torch.Tensor, tensor, config, name: str) -> torch.Tensor | None:
    """The file's blocks for `weight` [out, in], rows in the model's order, packed (`pack`);
    None when the tensor is in another type or does not hold these weights exactly."""
    kind = int(tensor.tensor_type)
    if kind not in TYPES or tuple(tensor.data.shape)[0] != weight.shape[0] or weight.shape[1] % block_weights(kind):
        return None
    blocks = torch.from_numpy(np.array(tensor.data))  # a copy: the file's map is read-only
    rows, packed = blocks.shape[0], pack(blocks, kind)
    held = _kernels().dequantize(packed, kind, rows, torch.arange(rows))  # checks `pack` too
    heads = {config.num_attention_heads, getattr(config, "num_key_value_heads", None) or config.num_attention_heads}
    candidates = [None] + [_rotary_permutation(weight.shape[0], h) for h in sorted(heads)
                           if weight.shape[0] % (2 * h) == 0]
    for order in candidates:
        if order is None and torch.equal(held, weight):
            return packed
        if order is not None and torch.equal(held[order.argsort()], weight):
            return pack(blocks[order.argsort()], kind)
    log.warning("%s: the GGUF tensor %s does not hold the model's weights; it stays float32", name, tensor.name)
    return None


def available() -> bool:
    """Do the kernels build and load here (a C++ compiler is needed the first time)?"""
    try:
        _kernels()
        return True
    except Exception as err:  # no compiler, no writable directory: the caller picks other numerics
        log.warning("the GGUF kernels are not available here (%s)", str(err).splitlines()[0] if str(err) else err)
        return False


def supported(path: str | None) -> bool:
    """Does the file hold its linear layers in block types we multiply, and do the
    kernels run here?"""
    if not path:
        return False
    _, tensors = _tensors(Path(path))
    # The layers' products, and the output head's (the embedding's, where tied): llama.cpp
    # writes a Q4 file's head in Q6_K where hidden % 256 == 0 (TinyLlama, Llama-3.2-1B).
    head = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    kinds = {int(t.tensor_type) for name, t in tensors.items()
             if (name.startswith("blk.") and len(t.shape) == 2) or name == head}
    return bool(kinds) and kinds <= set(TYPES) and available()


def q8_m_blocks(weight: np.ndarray) -> np.ndarray:
    """`weight` [rows, cols] float32 as Q8_M blocks [rows, cols / 32 * 36] uint8: per block
    of 32, a scale d and a minimum m (float16 each), then 32 bytes q, weight = q * d + m:
    Q4_1's form with 256 levels. Each block takes whichever of two grids holds its weights
    the closer (least squares): its range in 255 steps from its least value (as gguf's
    reference quantizer takes Q4_1's d and m), or Q8_0's steps (its largest magnitude /
    127) from a whole number of them below its least value. The first is as fine as Q8_0
    for a block centred on 0 and up to twice as fine for one that leans to a side, and a
    block de-quantized from Q4_1 (a GGUF file's) keeps its 16 levels on it but for d's
    rounding to float16; the second keeps a block de-quantized from Q8_0 (a GGUF file's
    embedding) on its levels but for m's rounding
    (docs/benchmarks.md#checkpoints-on-the-fast-path)."""
    blocks = weight.reshape(-1, 32).astype(np.float32)
    lo, hi = blocks.min(axis=1, keepdims=True), blocks.max(axis=1, keepdims=True)
    spans = lo.astype(np.float16), ((hi - lo.astype(np.float16).astype(np.float32)) / 255).astype(np.float16)
    step = (np.maximum(-lo, hi) / 127).astype(np.float16)
    with np.errstate(divide="ignore", invalid="ignore"):
        below = np.where(step > 0, np.rint(lo / step.astype(np.float32)), 0)
        grids = [spans, ((below * step.astype(np.float32)).astype(np.float16), step)]
        made = []
        for m, d in grids:
            m32, d32 = m.astype(np.float32), d.astype(np.float32)
            q = np.clip(np.where(d32 > 0, np.rint((blocks - m32) / d32), 0), 0, 255)
            error = (((q * d32 + m32) - blocks).astype(np.float64) ** 2).sum(axis=1, keepdims=True)
            made.append((error, m, d, q.astype(np.uint8)))
    (error_a, m, d, q), (error_b, m_b, d_b, q_b) = made
    second = error_b < error_a
    m, d, q = np.where(second, m_b, m), np.where(second, d_b, d), np.where(second, q_b, q)
    out = np.concatenate([d.view(np.uint8), m.view(np.uint8), q], axis=1)
    return out.reshape(weight.shape[0], -1)


def blocks_of_weight(weight: torch.Tensor, kind: int) -> torch.Tensor:
    """`weight` [rows, cols] (cols a multiple of 32) as `kind` blocks: Q8_M by
    `q8_m_blocks`, a GGUF type by gguf's reference code (llama.cpp's), what its converter
    writes for that type."""
    from gguf import GGMLQuantizationType, quants

    w = weight.detach().float().cpu().numpy()
    return torch.from_numpy(q8_m_blocks(w) if kind == Q8_M else quants.quantize(w, GGMLQuantizationType(kind)))


def quantizable(model) -> list[str]:
    """The linear layers (output head included) whose inputs are not whole blocks of 32:
    they cannot be put in blocks (`quantize_blocks`)."""
    head = model.get_output_embeddings()
    return [name for name, m in model.named_modules()
            if (isinstance(m, torch.nn.Linear) or m is head) and m.weight.shape[1] % 32]


def quantize_blocks(model, kind: int) -> int:
    """Puts every linear layer, the output head and the embedding of a float model in
    `kind` blocks of its own weights (a tied head shares its embedding's); -> how many
    modules were replaced. ValueError where a layer's inputs are not whole blocks."""
    if left := quantizable(model):
        raise ValueError(f"{', '.join(left[:4])}: {TYPES[kind]} blocks take inputs in whole blocks of 32")
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    made, replaced = {}, 0  # made: packed blocks by the weight's storage (tied weights are quantized once)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not (isinstance(child, (torch.nn.Linear, torch.nn.Embedding)) or child is head):
                continue
            if isinstance(child, torch.nn.Embedding) and child is not embedding:
                continue  # an embedding the model reads otherwise (positions, types): left as it is
            weight = child.weight
            if (packed := made.get(weight.data_ptr())) is None:
                packed = made[weight.data_ptr()] = pack(blocks_of_weight(weight, kind), kind)
            rows, cols = weight.shape
            if isinstance(child, torch.nn.Embedding):
                module = GGUFEmbedding.replacing(child, packed, kind)
            else:
                module = GGUFLinear(packed, kind, cols, getattr(child, "bias", None), rows=rows)
            setattr(parent, name, module)
            replaced += 1
    return replaced


def load_blocks(model, path: str) -> int:
    """Replaces the model's linear layers and embedding by the GGUF file's blocks where
    they hold exactly its weights; -> how many were replaced. ValueError where a linear
    layer or the output head is left (a block type the kernels do not multiply)."""
    import gguf
    from gguf import GGMLQuantizationType

    arch, tensors = _tensors(Path(path))
    names = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch),
                                     model.config.num_hidden_layers)
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and head.weight is embedding.weight
    replaced, made = 0, {}  # made: the packed blocks of each file tensor (a tied head shares the embedding's)
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            is_head = child is head
            if not (isinstance(child, (torch.nn.Linear, torch.nn.Embedding)) or is_head):
                continue
            full = next(n for n, m in model.named_modules() if m is child)
            file_name = names.get_name(full + ".weight", try_suffixes=(".weight",))
            if is_head and (tied or file_name not in tensors):
                file_name = names.get_name(next(n for n, m in model.named_modules() if m is embedding) + ".weight",
                                           try_suffixes=(".weight",))
            if file_name not in tensors:
                continue
            weight = child.weight.detach().float()
            if file_name not in made:
                made[file_name] = _blocks_of(weight, tensors[file_name], model.config, full)
            packed = made[file_name]
            if packed is None:
                continue
            kind, rows = int(tensors[file_name].tensor_type), weight.shape[0]
            if isinstance(child, torch.nn.Embedding):
                module = GGUFEmbedding.replacing(child, packed, kind)
            else:
                module = GGUFLinear(packed, kind, weight.shape[1], getattr(child, "bias", None), rows=rows)
            setattr(parent, child_name, module)
            replaced += 1
    left = [name for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) or (m is head and not isinstance(m, GGUFLinear))]
    if left:
        # A float32 product there would round one row (a step) and several (a verify
        # pass) differently: the output would not be the target alone's.
        kinds = {n: GGMLQuantizationType(int(t.tensor_type)).name for n, t in tensors.items()}
        raise ValueError(f"--quantize gguf: {', '.join(left[:4])}{' ...' if len(left) > 4 else ''} of {path} "
                         f"cannot run on the file's blocks (the head's tensor is "
                         f"{kinds.get('output.weight', kinds.get('token_embd.weight'))}; the kernels multiply "
                         f"{', '.join(TYPES.values())}): use --quantize int8")
    return replaced
