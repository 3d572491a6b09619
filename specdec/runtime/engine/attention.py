"""The attention backend: each row of a pass attends to its own keys and values in the
pool. The model's attention layers call `paged_attention` (registered with transformers'
AttentionInterface) with the pass's `Plan`: the tokens of all rows are packed into one
sequence, so the linear layers see one [1, tokens] input, and only attention needs to
know where each row's history lives."""

from dataclasses import dataclass, field
from typing import Callable

import torch
from transformers import AttentionInterface

from specdec.runtime.engine.block_manager import KVPool

ATTENTION = "specdec_paged"


@dataclass
class Group:
    """Rows that attend together, padded to the group's widest row (Q new tokens) and
    longest history (L positions). A long prefill chunk is a group of its own, so the
    rounds beside it are not padded to its size."""
    read_slots: torch.Tensor  # [b, L] slots each row reads; padding reads slot 0 (zeros)
    q_index: torch.Tensor     # [b, Q] packed index of each row's j-th new token (padding: 0)
    mask: torch.Tensor | None  # [b, 1, Q, L] query may attend key (None: every query attends every key)
    packed: torch.Tensor      # [t] packed indices of the group's new tokens
    flat: torch.Tensor        # [t] where each of them sits in the group's [b * Q] output
    q_pos: torch.Tensor       # [b, Q] each query's position (padding: 0)
    windowed: dict = field(default_factory=dict)  # window -> its mask, built at its first layer

    def mask_for(self, window: int | None) -> torch.Tensor | None:
        """The mask of a layer that attends within `window` positions (its own included, as
        transformers' sliding-window layers do), or the group's own where every query's
        history fits."""
        length = self.read_slots.shape[1]
        if not window or length <= window:
            return self.mask
        if window not in self.windowed:
            keys, q_pos = torch.arange(length, device=self.q_pos.device), self.q_pos[:, :, None]
            self.windowed[window] = ((keys <= q_pos) & (keys > q_pos - window)).unsqueeze(1)
        return self.windowed[window]


@dataclass
class Plan:
    """Where a pass reads and writes keys and values: T packed new tokens, each row's at
    positions [start, end) of its session, reading positions [0, end)."""
    pool: KVPool
    write_slots: torch.Tensor  # [T] pool slot of each new token
    groups: list[Group]
    dtype: torch.dtype  # attention computes in it (float64 for a quantized model: see specdec.runtime.quantize)
    works: list  # the pass's (specdec.runtime.engine.scheduler.Work)
    # On a CPU in float64, the kernel (specdec/runtime/kernels/attention_cpu.cpp) attends every row
    # in one call, from (slots [B, L] each row reads, row of each token [T], positions each
    # token attends [T]); `groups` is then empty.
    kernel: Callable | None = None
    table: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    windowed: dict = field(default_factory=dict)  # window -> its table (table_for), built at its first layer
    # A pass of static shapes (model_runner.StaticPasses): each packed token attends on its
    # own, from (slots [T, L] its row reads, padded; positions each token attends [T]);
    # `groups` is then empty, and the pass is never abandoned (a CUDA graph runs whole).
    by_token: tuple[torch.Tensor, torch.Tensor] | None = None
    # One past the pass's last position (known on the host: the rotary table reads no device).
    end: int | None = None
    # Layers whose input (the residual stream entering it; the number of layers: the last
    # one's output) the pass keeps, for a feature drafter, at the packed tokens
    # `feature_rows` (those it keeps logits of, and the earlier positions of a row whose
    # features are wanted without logits: a prompt's); the forward fills `features`
    # {layer: [len(feature_rows), hidden]}.
    feature_layers: tuple[int, ...] = ()
    feature_rows: torch.Tensor | None = None
    features: dict | None = None
    # Set once every row's caller has gone, for a pass that runs its layers in one kernel
    # call (specdec/runtime/kernels/layer_cpu.cpp): it reads it before each layer.
    stop: torch.Tensor = field(default_factory=lambda: torch.zeros(1, dtype=torch.uint8))

    def table_for(self, window: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The kernel's table for a layer that attends within `window` positions: where a
        token's history is longer, a row of its own holding its last `window` slots. The
        pass's own table where every token's history fits."""
        if not window:
            return self.table
        if window not in self.windowed:
            slots, rows, lengths = self.table
            if int(lengths.max()) <= window:
                self.windowed[window] = self.table
            else:
                starts = (lengths - window).clamp(min=0)  # a token's last `window` positions end at its own
                own = slots[rows[:, None], starts[:, None] + torch.arange(window)]
                self.windowed[window] = (own, torch.arange(len(rows)), lengths - starts)
        return self.windowed[window]

    def abandoned(self) -> bool:
        """Every row's caller has gone (a decode whose reader moved on to another call on
        the session): the rest of the pass would compute what nobody reads, and hold
        the session meanwhile."""
        return all(work.cancelled for work in self.works)


class Abandoned(Exception):
    """Raised between layers of a pass that nobody reads any more."""


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, specdec_plan=None,
                    sliding_window=None, softcap=None, **kwargs):
    """query: [1, heads, T, d], key/value: [1, kv_heads, T, d] for the packed new tokens.
    Writes the new keys and values to the pool, then attends each row to its own: in a
    sliding-window layer (transformers passes its `sliding_window`), to its last that many
    positions; with Gemma 2's `softcap`, each score capped (`attend`). The pool keeps
    every position of every layer."""
    plan = specdec_plan
    if plan is None:
        raise RuntimeError("this model runs through specdec's Engine now: load another copy for other uses")
    if plan.by_token is None and plan.abandoned():
        raise Abandoned  # before this layer writes: the rows' caches stay as they were before the pass
    layer = module.layer_idx
    k_pool, v_pool = plan.pool.k[layer], plan.pool.v[layer]
    k_pool.index_copy_(0, plan.write_slots, key[0].transpose(0, 1).to(k_pool.dtype))
    v_pool.index_copy_(0, plan.write_slots, value[0].transpose(0, 1).to(v_pool.dtype))
    if plan.kernel is not None:
        table = plan.table_for(sliding_window)
        out = plan.kernel(query[0].transpose(0, 1), k_pool, v_pool, *table, scaling, softcap or 0.0)
        return out.unsqueeze(0), None
    if plan.by_token is not None:
        return _attend_by_token(plan, query, k_pool, v_pool, scaling, sliding_window, softcap), None
    if len(plan.groups) == 1 and plan.groups[0].read_slots.shape[0] == 1:
        # The pass's one row (a decode step, one session's round): its tokens in order,
        # nothing to pick out or place back.
        o = _attend(plan.groups[0], query.to(plan.dtype), k_pool, v_pool, plan.dtype, scaling, sliding_window, softcap)
        return o.transpose(1, 2).to(query.dtype), None
    queries = query[0].transpose(0, 1).to(plan.dtype)  # [T, heads, d]
    out = torch.empty_like(queries)
    for g in plan.groups:
        b = g.read_slots.shape[0]
        q = queries.index_select(0, g.q_index.view(-1)).view(b, -1, *queries.shape[1:]).transpose(1, 2)
        o = _attend(g, q, k_pool, v_pool, plan.dtype, scaling, sliding_window, softcap)
        b, heads, width, d = o.shape
        out.index_copy_(0, g.packed, o.transpose(1, 2).reshape(b * width, heads, d)[g.flat])
    return out.unsqueeze(0).to(query.dtype), None


def window_of(attn) -> int | None:
    """The window an attention layer of a Llama-family model attends within, as its own
    forward passes it to the attention interface (Qwen's per layer; Mistral's and Phi-3's
    the config's); None: every position."""
    from specdec.runtime.modeling import sliding_window

    return attn.sliding_window if hasattr(attn, "sliding_window") else sliding_window(attn.config)


def attend(q, k, v, mask, scale: float, softcap: float | None = None) -> torch.Tensor:
    """softmax(q kᵀ · scale) v, q: [b, heads, Q, d], k, v: [b, kv_heads, L, d], mask: None
    or [b, 1, Q, L] (True: the query attends the key). With a softcap (Gemma 2's), each
    score s is taken as softcap · tanh(s / softcap) first, as Gemma's eager attention
    does; sdpa cannot, so that one is written out."""
    if not softcap:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.tanh(torch.matmul(q, k.transpose(-1, -2)) * scale / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32))  # as Gemma's
    return torch.matmul(weights.to(v.dtype), v)


def _attend(g: Group, q, k_pool, v_pool, dtype, scaling, window: int | None = None,
            softcap: float | None = None) -> torch.Tensor:
    """q: [b, heads, Q, d] -> [b, heads, Q, d], each row attending the slots it reads (the
    last `window` of them, in a sliding-window layer)."""
    b, length = g.read_slots.shape
    # index_select, not indexing with the [b, L] tensor: a third less time at a step's sizes
    k = k_pool.index_select(0, g.read_slots.view(-1)).view(b, length, *k_pool.shape[1:])
    v = v_pool.index_select(0, g.read_slots.view(-1)).view(b, length, *v_pool.shape[1:])
    k, v = k.transpose(1, 2).to(dtype), v.transpose(1, 2).to(dtype)  # [b, kv_heads, L, d]
    return attend(q, k, v, g.mask_for(window), scaling, softcap)


def _attend_by_token(plan: Plan, query, k_pool, v_pool, scaling, window: int | None = None,
                     softcap: float | None = None) -> torch.Tensor:
    """query: [1, heads, T, d] -> [1, T, heads, d], each token attending the first
    `lengths[t]` slots of its table row (the table's j-th slot holds position j), in a
    sliding-window layer the last `window` of them: shapes that depend on the pass's
    bucket alone."""
    read, lengths = plan.by_token  # [T, L], [T]
    t, length = read.shape
    k = k_pool.index_select(0, read.reshape(-1)).view(t, length, *k_pool.shape[1:]).transpose(1, 2).to(plan.dtype)
    v = v_pool.index_select(0, read.reshape(-1)).view(t, length, *v_pool.shape[1:]).transpose(1, 2).to(plan.dtype)
    q = query[0].transpose(0, 1).unsqueeze(2).to(plan.dtype)  # [T, heads, 1, d]
    keys = torch.arange(length, device=read.device)
    mask = keys < lengths[:, None]
    if window:
        mask &= keys >= lengths[:, None] - window
    mask = mask[:, None, None, :]  # [T, 1, 1, L]
    o = attend(q, k, v, mask, scaling, softcap)
    return o[:, :, 0].unsqueeze(0).to(query.dtype)


AttentionInterface.register(ATTENTION, paged_attention)


def check_supported(model) -> None:
    """The pool holds every position of every layer, and attention here is causal
    softmax(q kᵀ)v (its scores soft-capped where the model caps them) over every earlier
    position or, in a sliding-window layer, over the last `sliding_window` of them:
    refuse models that attend otherwise."""
    from specdec.runtime.modeling import sliding_window

    config = model.config
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    if kinds - {"full_attention", "sliding_attention"} or \
            (kinds != {"full_attention"} or getattr(config, "use_sliding_window", False)) and not sliding_window(config):
        raise ValueError(f"{config.model_type}: only models whose every layer attends to every position, or "
                         f"within one window, are supported (layer types {sorted(kinds)})")
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError(f"{config.model_type}: bidirectional attention is not supported")
    if not model._can_set_attn_implementation():
        raise ValueError(f"{config.model_type}: the model does not use transformers' attention interface")
