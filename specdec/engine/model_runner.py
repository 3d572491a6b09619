"""The one place that turns a pass's rows into batched tensors and runs the model."""

import functools
import logging

import torch

from specdec.engine.attention import ATTENTION, Abandoned, Group, Plan, paged_attention
from specdec.engine.block_manager import KVPool
from specdec.engine.scheduler import Row
from specdec.quantize import attention_dtype

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, model, pool: KVPool, short: int):
        """short: rows of at most this many tokens attend together (a pass's rounds and
        steps); longer ones (prefill chunks) attend in a group of their own."""
        model.set_attn_implementation(ATTENTION)
        self.model, self.device, self.pool, self.short = model, model.device, pool, short
        self.plan: Plan | None = None  # the pass running or last run
        self.attention_dtype = attention_dtype(model, model.dtype)
        self.kernel = _cpu_attention(model, self.attention_dtype)
        self.forward = _llama_forward if _is_llama(model) else _transformers_forward
        if self.forward is _llama_forward and self.kernel is not None and (stack := _layer_stack(model)):
            self.forward = functools.partial(_layer_kernel_forward, stack)

    def run(self, batch: list[Row]) -> torch.Tensor:
        """One forward over every row's next tokens; -> logits of the wanted positions
        [sum of the rows' wanted, vocab]."""
        device, block_size = self.device, self.pool.block_size
        ids, positions, keep, placed = [], [], [], []
        for row in batch:
            seq, start, end = row.work.seq, row.start, row.start + row.n
            placed.append((row, len(ids), seq.slots(end, block_size, device)))  # the slots it reads, its own last
            keep += range(len(ids) + row.n - row.wanted, len(ids) + row.n)
            ids += seq.tokens[start:end]
            positions += range(start, end)
        writes = [slots[row.start:] for row, _, slots in placed]
        plan = Plan(self.pool, writes[0] if len(writes) == 1 else torch.cat(writes), [], self.attention_dtype,
                    [row.work for row in batch])
        if self.kernel is not None:
            plan.kernel = self.kernel
            plan.table = (torch.nn.utils.rnn.pad_sequence([slots for _, _, slots in placed], batch_first=True),
                          torch.tensor([b for b, row in enumerate(batch) for _ in range(row.n)]),
                          torch.tensor(positions) + 1)
        else:
            short = [p for p in placed if p[0].n <= self.short]
            plan.groups = [self._group(g) for g in ([short] if short else [])
                           + [[p] for p in placed if p[0].n > self.short]]
        self.plan = plan
        with torch.inference_mode():
            logits = self.forward(self.model, torch.tensor([ids], device=device),
                                  torch.tensor([positions], device=device),
                                  torch.tensor(keep, dtype=torch.long, device=device), plan)[0].float()
        if device.type == "cuda":  # the pass's time is read right after: let it end first
            torch.cuda.synchronize(device)
        return logits

    def stop_if_abandoned(self) -> None:
        """Called after a work of the running pass is cancelled: where every row's caller has
        gone, a pass whose layers run in one kernel call stops before its next layer (the
        Python pass asks between layers itself)."""
        if (plan := self.plan) is not None and plan.abandoned():
            plan.stop.fill_(1)

    def _group(self, placed: list[tuple[Row, int, torch.Tensor]]) -> Group:
        """The attention layout of rows (each with its offset in the packed tokens and the
        slots it reads)."""
        device = self.device
        width = max(row.n for row, _, _ in placed)
        length = max(row.start + row.n for row, _, _ in placed)
        # Each row's slots, padded to the longest with slot 0 (zeros, never attended).
        read_slots = torch.nn.utils.rnn.pad_sequence([slots for _, _, slots in placed], batch_first=True)
        q_index, q_pos, packed, flat = [], [], [], []
        for b, (row, offset, _) in enumerate(placed):
            end = row.start + row.n
            pad = width - row.n
            q_index.append(list(range(offset, offset + row.n)) + [0] * pad)
            q_pos.append(list(range(row.start, end)) + [0] * pad)  # padding attends slot 0 only
            packed += range(offset, offset + row.n)
            flat += range(b * width, b * width + row.n)
        mask = None
        if len(placed) > 1 or width > 1:  # one row of one token attends all it reads: no mask to build or apply
            mask = (torch.arange(length, device=device)[None, None, :]
                    <= torch.tensor(q_pos, device=device)[:, :, None]).unsqueeze(1)
        return Group(read_slots, torch.tensor(q_index, device=device), mask,
                     torch.tensor(packed, device=device), torch.tensor(flat, device=device))


def _cpu_attention(model, dtype: torch.dtype):
    """The float64 attention kernel, for a model on a CPU that attends in float64 (a
    quantized one) and keeps float32 keys and values; None elsewhere, or where the
    kernels do not build (torch's attention then)."""
    if model.device.type != "cpu" or dtype != torch.float64 or model.dtype != torch.float32:
        return None
    try:
        from specdec.kernels import cpu

        return cpu().attention
    except Exception as err:  # no compiler here
        log.warning("torch's attention, not specdec's kernel: %s", str(err).splitlines()[0] if str(err) else err)
        return None


def _transformers_forward(model, ids, positions, keep, plan: Plan) -> torch.Tensor:
    """ids, positions: [1, T]; keep: [k] -> logits [1, k, vocab]."""
    return model(input_ids=ids, position_ids=positions, logits_to_keep=keep, use_cache=False,
                 specdec_plan=plan).logits


def _is_llama(model) -> bool:
    from transformers.models.llama import modeling_llama

    return (type(model) is modeling_llama.LlamaForCausalLM
            and all(type(layer) is modeling_llama.LlamaDecoderLayer for layer in model.model.layers))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _llama_forward(model, ids, positions, keep, plan: Plan) -> torch.Tensor:
    """LlamaForCausalLM's forward: its modules, and its operations on each element in its
    order (the same logits to the bit), without the plumbing around them (output
    capture, masks, cache, attention dispatch): on a CPU, a one-token step of the default
    target spent more time in that than in its arithmetic. Where q, k and v (gate and
    up) are one product (specdec.quantize), it is taken once, and q and k turn in one
    rotary operation."""
    inner = model.model
    h = inner.embed_tokens(ids)  # [1, T, hidden]
    cos, sin = inner.rotary_emb(h, positions)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [1, 1, T, head_dim]
    for layer in inner.layers:
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        shape = (*x.shape[:-1], -1, attn.head_dim)
        shared = getattr(attn, "shared_q_k_v", None)
        if shared is not None:
            qkv = shared.linear(x)
            (_, q_end), (_, k_end), _ = shared.columns
            qk = qkv[..., :k_end].view(shape).transpose(1, 2)  # [1, heads + kv_heads, T, head_dim]
            qk = (qk * cos) + (_rotate_half(qk) * sin)
            q, k = qk[:, :q_end // attn.head_dim], qk[:, q_end // attn.head_dim:]
            v = qkv[..., k_end:].view(shape).transpose(1, 2)
        else:
            q = attn.q_proj(x).view(shape).transpose(1, 2)  # [1, heads, T, head_dim]
            k = attn.k_proj(x).view(shape).transpose(1, 2)
            v = attn.v_proj(x).view(shape).transpose(1, 2)
            q = (q * cos) + (_rotate_half(q) * sin)
            k = (k * cos) + (_rotate_half(k) * sin)
        o, _ = paged_attention(attn, q, k, v, None, scaling=attn.scaling, specdec_plan=plan)
        h = h + attn.o_proj(o.reshape(*x.shape[:-1], -1).contiguous())
        x = layer.post_attention_layernorm(h)
        mlp = layer.mlp
        shared = getattr(mlp, "shared_gate_up", None)
        if shared is not None:
            gate_up = shared.linear(x)
            (_, gate_end), _ = shared.columns
            h = h + mlp.down_proj(mlp.act_fn(gate_up[..., :gate_end]) * gate_up[..., gate_end:])
        else:
            h = h + mlp(x)
    return model.lm_head(inner.norm(h)[:, keep])


def _layer_stack(model):
    """specdec/kernels/layer_cpu.cpp's `LlamaStack` over the decoder layers of a Llama
    model on GGUF blocks (q, k and v as one product; gate and up as one; the norms in
    their kernel; silu), or None where a layer is otherwise: _llama_forward runs it."""
    from specdec import ggml
    from specdec.kernels import cpu

    config, layers, norms, weights, kinds = model.config, model.model.layers, [], [], []
    if getattr(config, "hidden_act", None) != "silu":
        return None
    first = layers[0]
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        qkv, gate_up = getattr(attn, "shared_q_k_v", None), getattr(mlp, "shared_gate_up", None)
        linears = [qkv and qkv.linear, attn.o_proj, gate_up and gate_up.linear, mlp.down_proj]
        pair = [layer.input_layernorm, layer.post_attention_layernorm]
        if not all(isinstance(m, ggml.GGUFLinear) and m.bias is None for m in linears) \
                or not all(isinstance(n, ggml.RMSNorm) and n.weight.dtype == torch.float32 for n in pair) \
                or {n.variance_epsilon for n in pair} != {first.input_layernorm.variance_epsilon} \
                or attn.scaling != first.self_attn.scaling or qkv.columns != first.self_attn.shared_q_k_v.columns:
            return None
        norms += [n.weight for n in pair]
        weights += [m.packed for m in linears]
        kinds += [m.kind for m in linears]
    *_, (v_start, v_end) = first.self_attn.shared_q_k_v.columns
    head_dim = first.self_attn.head_dim
    sizes = [config.hidden_size, config.num_attention_heads, (v_end - v_start) // head_dim, head_dim,
             first.mlp.down_proj.in_features]
    return cpu().LlamaStack(norms, weights, kinds, sizes, first.input_layernorm.variance_epsilon,
                            first.self_attn.scaling)


def _layer_kernel_forward(stack, model, ids, positions, keep, plan: Plan) -> torch.Tensor:
    """_llama_forward with every decoder layer in one kernel call (`LlamaStack.forward`,
    whose file says why): the same operations on each element, so the same bits."""
    inner = model.model
    h = inner.embed_tokens(ids)  # [1, T, hidden]
    cos, sin = inner.rotary_emb(h, positions)
    if plan.abandoned():
        raise Abandoned  # before the first layer writes
    h = stack.forward(h[0], cos[0], sin[0], plan.pool.k, plan.pool.v, plan.write_slots, *plan.table, plan.stop)
    if h is None:
        raise Abandoned  # what the layers before it wrote lies past the rows' cached positions: not counted
    return model.lm_head(inner.norm(h[None])[:, keep])
