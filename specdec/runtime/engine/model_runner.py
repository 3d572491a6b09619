"""The one place that turns a pass's rows into batched tensors and runs the model."""

import functools
import logging
import time
import weakref

import numpy as np
import torch

from specdec.runtime.engine.attention import ATTENTION, Abandoned, Group, Plan, paged_attention, window_of
from specdec.runtime.engine.block_manager import KVPool
from specdec.runtime.engine.scheduler import Row
from specdec.runtime.quantize import attention_dtype, share_fused

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, model, pool: KVPool, short: int, static: bool | str = False, invariant: int = 0):
        """short: rows of at most this many tokens attend together (a pass's rounds and
        steps); longer ones (prefill chunks) attend in a group of their own. static: passes
        that fit StaticPasses' buckets run through it (CUDA graphs on a GPU); "compiled":
        through torch.compile too; False or "off": never. invariant: N > 0, every pass runs
        as static passes of N tokens (StaticPasses), captured where `static` says."""
        model.set_attn_implementation(ATTENTION)
        share_fused(model)
        llama = _llama_like(model)
        if model.device.type == "cuda" and llama:
            fuse_launches(model)
        self.model, self.device, self.pool, self.short = model, model.device, pool, short
        self.plan: Plan | None = None  # the pass running or last run
        self.attention_dtype = attention_dtype(model, model.dtype)
        self.static = None
        graphs = bool(static) and static != "off"
        if graphs or invariant:
            if not llama:
                raise ValueError(f"static passes (--cuda-graphs, --batch-invariant) run Llama-family models only "
                                 f"(Llama, Mistral, Qwen2/3, Phi-3, Gemma 2/3), not {type(model).__name__}")
            from specdec.runtime.modeling import max_positions

            self.static = StaticPasses(model, pool, self.attention_dtype, graphs and model.device.type == "cuda",
                                       max_positions(model), invariant)
            if static == "compiled":
                self.static.compile()  # each bucket's first pass compiles (about a minute): captured then
            elif self.static.capture:
                self.static.capture_all()
        self.kernel = _cpu_attention(model, self.attention_dtype)
        self.forward = _llama_forward if llama else _transformers_forward
        if self.forward is _llama_forward and self.kernel is not None and (stacks := _LayerStacks.of(model)):
            self.forward = functools.partial(_layer_kernel_forward, stacks)

    def run(self, batch: list[Row]) -> tuple[torch.Tensor, dict[int, torch.Tensor] | None]:
        """One forward over every row's next tokens; -> logits of the positions that want
        them [sum of the rows' logit_rows, vocab], and where a row asked for them, the
        features of its wanted positions {layer: [sum of the rows' wanted, hidden]}."""
        device, block_size = self.device, self.pool.block_size
        ids, positions, keep, logit_keep, offsets = [], [], [], [], []
        for row in batch:
            seq, start, end = row.work.seq, row.start, row.start + row.n
            offsets.append(len(ids))
            keep += range(len(ids) + row.n - row.wanted, len(ids) + row.n)
            logit_keep += range(len(ids) + row.n - row.logit_rows, len(ids) + row.n)
            ids += seq.tokens[start:end]
            positions += range(start, end)
        layers = tuple(sorted({layer for row in batch for layer in row.work.layers}))
        if self.static is not None and (out := self.static.run(batch, ids, positions, keep, layers)) is not None:
            logits, features = out
            if len(logit_keep) < len(keep):  # each row's logit rows end its wanted ones
                logits = logits[torch.from_numpy(np.searchsorted(keep, logit_keep)).to(logits.device)]
            return logits, features
        # Each row with its offset in the packed tokens and the slots it reads, its own last.
        placed = [(row, offset, row.work.seq.slots(row.start + row.n, block_size, device))
                  for row, offset in zip(batch, offsets)]
        writes = [slots[row.start:] for row, _, slots in placed]
        plan = Plan(self.pool, writes[0] if len(writes) == 1 else torch.cat(writes), [], self.attention_dtype,
                    [row.work for row in batch], end=max(positions) + 1, feature_layers=layers,
                    feature_rows=torch.tensor(keep, dtype=torch.long, device=device) if layers else None)
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
                                  torch.tensor(logit_keep, dtype=torch.long, device=device), plan)[0].float()
        if device.type == "cuda":  # the pass's time is read right after: let it end first
            torch.cuda.synchronize(device)
        return logits, plan.features

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
                     torch.tensor(packed, device=device), torch.tensor(flat, device=device),
                     torch.tensor(q_pos, device=device))


class StaticPasses:
    """Passes of static shapes, replayed from CUDA graphs on a GPU: no host in the step.

    A pass of T tokens whose tokens read at most L positions runs in the smallest bucket
    (T', L') that holds it, T' from `tokens` and L' a power of two from 128 up to the
    model's positions: the pass's ids, positions, write slots and each token's read
    table are copied into buffers of the largest bucket (one copy from the host), the
    padding tokens write to a slot no session owns (block 0's second: block 0 is never
    handed out) and read it alone, and the bucket's graph replays. Its logits (and the
    features a feature drafter asks for) come back for every token; the wanted ones are
    picked after. Every bucket is captured when the engine starts (`capture_all`; a
    feature drafter's layers, and torch.compile's kernels, at their bucket's first pass;
    `capture` False: the same padded pass runs eagerly, as on a CPU, where the tests check
    it against the engine's own). A longer pass runs the usual way.

    Batch-invariant (`invariant` = N): every pass is N tokens, a longer one runs as
    passes of N tokens in turn (each token attends to the keys of the ones before it,
    written by the passes before). A token's row then meets the same matrix products,
    norms and reductions, of the same shapes, whether it is a one-token step or one of
    a verify pass or a batch of many sessions: its bits do not depend on the pass
    around it, so greedy speculation in 16 bits gives the target alone's tokens."""

    TOKENS = (1, 2, 4, 8, 16, 32, 64)
    PAD_SLOT = 1

    def __init__(self, model, pool: KVPool, dtype: torch.dtype, capture: bool, max_positions: int,
                 invariant: int = 0):
        if pool.block_size < 2:
            raise ValueError("static passes need blocks of at least 2 slots (the padding writes to block 0's second)")
        self.model, self.pool, self.dtype, self.capture = model, pool, dtype, capture
        self.invariant = invariant
        self.tokens = (invariant,) if invariant else self.TOKENS
        self.lengths = [128]
        while self.lengths[-1] < max_positions:
            self.lengths.append(2 * self.lengths[-1])
        device, tokens, length = model.device, self.tokens[-1], self.lengths[-1]
        # ids, positions, writes, lengths: one buffer each (a compiled pass takes them as
        # its arguments: views of one storage tripped inductor)
        self.inputs = [torch.zeros(tokens, dtype=torch.long, device=device) for _ in range(4)]
        self.read = torch.zeros(tokens, length, dtype=torch.long, device=device)
        self.compiled = None  # torch.compile of the pass (`compile`), where asked
        pinned = device.type == "cuda"
        self.host_inputs = torch.zeros(4, tokens, dtype=torch.long, pin_memory=pinned)
        self.host_read = torch.zeros(tokens, length, dtype=torch.long, pin_memory=pinned)
        # The host buffers are copied to the device asynchronously: a pass run in turn
        # waits for the last copy before it writes them again.
        self.copied = torch.cuda.Event() if pinned else None
        # (tokens, length, feature layers) -> (graph, its outputs)
        self.graphs: dict[tuple[int, int, tuple[int, ...]], tuple[object, tuple]] = {}
        self.mempool = torch.cuda.graph_pool_handle() if capture else None
        self.passes = 0  # passes run here

    def bucket(self, tokens: int, length: int) -> tuple[int, int] | None:
        t = next((b for b in self.tokens if b >= tokens), None)
        l_ = next((b for b in self.lengths if b >= length), None)
        return None if t is None or l_ is None else (t, l_)

    def run(self, batch: list[Row], ids: list[int], positions: list[int], keep: list[int],
            layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, dict[int, torch.Tensor] | None] | None:
        """The pass's logits of the wanted positions ([len(keep), vocab]) and the features
        at them ({layer: [len(keep), hidden]}, where `layers` asks), or None where it fits
        no bucket."""
        n, size = len(ids), self.tokens[-1]
        if (n > size and not self.invariant) or max(positions) + 1 > self.lengths[-1]:
            return None
        # Each token's write slot, and its row's slots (the token reads up to its own position).
        writes = np.empty(n, dtype=np.int64)
        row_of, slots_of, at = np.empty(n, dtype=np.int64), [], 0
        for index, row in enumerate(batch):
            slots = row.work.seq.slot_array(row.start + row.n, self.pool.block_size)
            writes[at:at + row.n] = slots[row.start:]
            row_of[at:at + row.n] = index
            slots_of.append(slots)
            at += row.n
        positions = np.asarray(positions, dtype=np.int64)
        keep = np.asarray(keep, dtype=np.int64)
        outs = []
        for begin in range(0, n, size):
            end = min(begin + size, n)
            wanted = keep[(keep >= begin) & (keep < end)] - begin  # none in a prefill's first chunks
            out = self._chunk(ids[begin:end], positions[begin:end], writes[begin:end], row_of[begin:end], slots_of,
                              wanted, layers)
            if out is not None:
                outs.append(out)
        logits = outs[0][0] if len(outs) == 1 else torch.cat([o[0] for o in outs])
        features = None
        if layers:
            features = {layer: torch.cat([o[1][i] for o in outs]) for i, layer in enumerate(layers)}
        if logits.device.type == "cuda":  # the pass's time is read right after: let it end first
            torch.cuda.synchronize(logits.device)
        return logits, features

    def _chunk(self, ids, positions, writes, row_of, slots_of, wanted, layers):
        """One static pass over up to `size` tokens -> (logits [wanted, vocab] float32,
        features [layers, wanted, hidden] or None), copies: the next replay overwrites the
        graph's outputs."""
        n = len(ids)
        t, l_ = self.bucket(n, int(positions.max()) + 1)
        # The bucket's inputs built on the host in pinned memory, and copied in two copies.
        if self.copied is not None:
            self.copied.synchronize()
        inputs, read = self.host_inputs[:, :t].numpy(), self.host_read[:t, :l_].numpy()
        inputs[0, :n], inputs[1, :n], inputs[2, :n] = ids, positions, writes
        inputs[0, n:], inputs[1, n:], inputs[2, n:] = 0, 0, self.PAD_SLOT
        inputs[3] = inputs[1] + 1  # a token reads up to its own position; padding its own slot alone
        read[n:] = self.PAD_SLOT
        at = 0
        while at < n:  # a row's run of tokens: one table up to its last one's position
            row, until = row_of[at], at + 1
            while until < n and row_of[until] == row:
                until += 1
            end = positions[until - 1] + 1
            read[at:until, :end] = slots_of[row][:end]
            at = until
        for i, buffer in enumerate(self.inputs):
            buffer[:t].copy_(self.host_inputs[i, :t], non_blocking=True)
        self.read[:t, :l_].copy_(self.host_read[:t, :l_], non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        logits, features = self._replay(t, l_, layers) if self.capture else self._forward(t, l_, layers)
        self.passes += 1
        if len(wanted) == 0:
            return None
        if np.array_equal(wanted, np.arange(wanted[0], wanted[0] + len(wanted))):
            pick = slice(int(wanted[0]), int(wanted[0]) + len(wanted))
        else:
            pick = torch.from_numpy(wanted).to(logits.device, non_blocking=True)
        logits = logits[pick].to(torch.float32, copy=True)
        return logits, None if features is None else features[:, pick].clone()

    def capture_all(self, layers: tuple[int, ...] = ()) -> None:
        """Every bucket's graph, before the first pass. Captured at its first pass, a
        bucket stalled that pass 0.2-0.7 s (an H200, the default target), and the stall
        went into what the orchestrator's warm-up and K policy learnt a pass costs.
        Lengths a session cannot reach in this pool are left out."""
        started = time.perf_counter()
        reach = self.pool.capacity * self.pool.block_size
        lengths = [length for i, length in enumerate(self.lengths) if i == 0 or self.lengths[i - 1] < reach]
        for length in lengths:
            for tokens in self.tokens:
                if (tokens, length, layers) not in self.graphs:
                    self.graphs[(tokens, length, layers)] = self._captured(tokens, length, layers)
        log.info("captured %d CUDA graphs (tokens %s x positions read %s) in %.1f s", len(self.graphs),
                 list(self.tokens), lengths, time.perf_counter() - started)

    def compile(self) -> None:
        """Runs each bucket's pass through torch.compile (its elementwise operations fused:
        fewer kernels a graph), captured as before."""
        import torch._dynamo

        torch._dynamo.config.cache_size_limit = 64  # a compile per bucket
        self.compiled = torch.compile(_static_pass, dynamic=False)

    def _forward(self, t: int, l_: int, layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The bucket's pass over the buffers -> logits of its t tokens [t, vocab], and
        their features [layers, t, hidden] where asked."""
        ids, positions, writes, lengths = (buffer[:t] for buffer in self.inputs)
        with torch.inference_mode():
            return (self.compiled or _static_pass)(self.model, self.pool, self.dtype, ids, positions, writes,
                                                   self.read[:t, :l_], lengths, l_, layers)

    def _replay(self, t: int, l_: int, layers: tuple[int, ...]):
        if (held := self.graphs.get((t, l_, layers))) is None:  # compiled, or a feature drafter's layers
            held = self.graphs[(t, l_, layers)] = self._captured(t, l_, layers)
            log.info("captured a CUDA graph of %d tokens reading up to %d positions%s at its first pass", t, l_,
                     f", keeping features of layers {list(layers)}" if layers else "")
        graph, outputs = held
        graph.replay()
        return outputs

    def _captured(self, t: int, l_: int, layers: tuple[int, ...]):
        """The bucket's graph, captured over buffers that hold a pass of padding alone (its
        warm-up passes write only the padding slot)."""
        saved = [buffer[:t].clone() for buffer in self.inputs], self.read[:t, :l_].clone()
        for buffer, value in zip(self.inputs, (0, 0, self.PAD_SLOT, 1)):
            buffer[:t] = value
        self.read[:t, :l_] = self.PAD_SLOT
        for kind in {rotary_kind(self.model, layer) for layer in self.model.model.layers}:
            rotary(self.model, self.inputs[1][None, :t], self.lengths[-1], kind)  # each table whole, before capture
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # kernels chosen and loaded outside the capture
                self._forward(t, l_, layers)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.mempool):
            outputs = self._forward(t, l_, layers)
        for buffer, value in zip(self.inputs, saved[0]):
            buffer[:t] = value
        self.read[:t, :l_] = saved[1]
        return graph, outputs


def _static_pass(model, pool: KVPool, dtype: torch.dtype, ids, positions, writes, read, lengths, end: int,
                 layers: tuple[int, ...] = ()):
    """A static pass: ids, positions, writes, lengths [t]; read [t, L] -> (logits [t, vocab],
    features [layers, t, hidden] or None)."""
    every = torch.arange(len(ids), device=ids.device)
    plan = Plan(pool, writes, [], dtype, [], by_token=(read, lengths), end=end, feature_layers=layers,
                feature_rows=every)
    logits = _llama_forward(model, ids[None], positions[None], every, plan)[0]
    return logits, torch.stack([plan.features[layer] for layer in layers]) if layers else None


class FusedRMSNorm(torch.nn.Module):
    """Llama's RMSNorm as torch.rms_norm: one kernel on a GPU where the module's formula
    launches seven; it rounds as that kernel does, not necessarily as the seven do.
    Gemma's norm (x normed in float32, times 1 + w) likewise, its 1 + w rounded once."""

    def __init__(self, norm: torch.nn.Module):
        super().__init__()
        from specdec.runtime.ggml import RMSNorm

        self.offset = type(norm).__name__ in RMSNorm.OFFSET_NORMS  # normed in float32, as Gemma's
        self.weight, self.eps = RMSNorm.weight_and_eps(norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.offset:
            return torch.rms_norm(x.float(), (x.shape[-1],), self.weight, self.eps).to(x.dtype)
        return torch.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def fuse_launches(model) -> None:
    """A Llama-family model's step on a GPU in fewer kernels (each costs its launch however
    little it computes: a 135M model's step was 1,424 launches): q, k and v as one product
    (with their biases, Qwen2's), gate and up as one, each norm one kernel. Every pass of
    the model runs through the same modules, so speculation's passes and the target
    alone's round alike."""
    from specdec.runtime.ggml import replace_norms
    from specdec.runtime.quantize import share_products

    products, norms = share_products(model), replace_norms(model, FusedRMSNorm)
    log.info("%d shared products and %d norms in one kernel each", products, norms)


def _cpu_attention(model, dtype: torch.dtype):
    """The float64 attention kernel, for a model on a CPU that attends in float64 (a
    quantized one) and keeps float32 keys and values; None elsewhere, or where the
    kernels do not build (torch's attention then)."""
    if model.device.type != "cpu" or dtype != torch.float64 or model.dtype != torch.float32:
        return None
    try:
        from specdec.runtime.kernels import cpu

        return cpu().attention
    except Exception as err:  # no compiler here
        log.warning("torch's attention, not specdec's kernel: %s", str(err).splitlines()[0] if str(err) else err)
        return None


def _transformers_forward(model, ids, positions, keep, plan: Plan) -> torch.Tensor:
    """ids, positions: [1, T]; keep: [k] -> logits [1, k, vocab]."""
    out = model(input_ids=ids, position_ids=positions, logits_to_keep=keep, use_cache=False,
                specdec_plan=plan, output_hidden_states=bool(plan.feature_layers))
    if plan.feature_layers:
        plan.features = {layer: out.hidden_states[layer][0, plan.feature_rows] for layer in plan.feature_layers}
    return out.logits


def _llama_like(model) -> bool:
    """A model whose layers compute as Llama's but for what _llama_forward takes from its
    modules: Mistral, Qwen2 (biases on q, k and v), Qwen3 (a norm on each q and k head),
    Phi-3 (q|k|v and gate|up one product each: quantize.share_fused; its residual dropout
    nothing in eval), Gemma 2 and 3 (four norms a layer, `_sandwiched`; the embedding's
    scale in the embedding; Gemma 2's soft-capped attention scores and logits, `_logits`;
    Gemma 3's local layers with a rotary embedding of their own; no bidirectional
    attention). Sliding-window layers attend within their window
    (attention.window_of). Rotary embeddings turn every dimension of a head, at a
    frequency of the position alone (RotaryTable holds each position's): a partial rotary
    embedding, or a dynamic one (frequencies that follow the longest position of a pass),
    takes the generic path."""
    from transformers.models.gemma2 import modeling_gemma2
    from transformers.models.gemma3 import modeling_gemma3
    from transformers.models.llama import modeling_llama
    from transformers.models.mistral import modeling_mistral
    from transformers.models.phi3 import modeling_phi3
    from transformers.models.qwen2 import modeling_qwen2
    from transformers.models.qwen3 import modeling_qwen3

    families = {modeling_llama.LlamaForCausalLM: modeling_llama.LlamaDecoderLayer,
                modeling_mistral.MistralForCausalLM: modeling_mistral.MistralDecoderLayer,
                modeling_qwen2.Qwen2ForCausalLM: modeling_qwen2.Qwen2DecoderLayer,
                modeling_qwen3.Qwen3ForCausalLM: modeling_qwen3.Qwen3DecoderLayer,
                modeling_phi3.Phi3ForCausalLM: modeling_phi3.Phi3DecoderLayer,
                modeling_gemma2.Gemma2ForCausalLM: modeling_gemma2.Gemma2DecoderLayer,
                modeling_gemma3.Gemma3ForCausalLM: modeling_gemma3.Gemma3DecoderLayer}
    config = model.config
    layer = families.get(type(model))
    if layer is None or not all(type(m) is layer for m in model.model.layers):
        return False
    if getattr(config, "use_bidirectional_attention", False):
        return False
    if not _turns_by_position(config):
        return False
    return layer is not modeling_phi3.Phi3DecoderLayer or all(
        hasattr(m.self_attn, "shared_q_k_v") and hasattr(m.mlp, "shared_gate_up") for m in model.model.layers)


def _turns_by_position(config) -> bool:
    """Does each rotary embedding of the config (Gemma 3's: one per layer type) turn every
    dimension of a head at a frequency of the position alone?"""
    rope = getattr(config, "rope_parameters", None) or {}
    each = list(rope.values()) if rope and all(isinstance(v, dict) for v in rope.values()) else [rope]
    return all(r.get("partial_rotary_factor", 1.0) == 1.0 and r.get("rope_type", "default") not in
               ("dynamic", "longrope") for r in each)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryTable:
    """The rotary embedding's cos and sin of each position, each row computed once, as a
    one-token step computes it, and read from here by every pass. Computed per pass, a
    row's bits depended on the pass: torch's cos and sin over a long pass's T x head_dim
    values split between threads mid-row, and a piece's SIMD lanes and scalar rest round
    differently. kind: the layer type whose embedding it holds, where the model's differs
    by layer (Gemma 3's local and global layers)."""

    def __init__(self, model, kind: str | None = None):
        rotary = model.model.rotary_emb
        self.rotary = rotary if kind is None else functools.partial(rotary, layer_type=kind)
        self.like = torch.empty(0, dtype=model.dtype, device=model.device)  # the dtype and device it computes for
        self.cos = self.sin = None  # [positions, head_dim]

    def __call__(self, positions: torch.Tensor, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [1, T], all below `end` (known on the host: no read from the device)
        -> cos, sin [1, T, head_dim]"""
        held = 0 if self.cos is None else len(self.cos)
        if end > held:
            self._grow(max(end, 2 * held, 256))
        return self.cos[positions], self.sin[positions]

    def _grow(self, size: int) -> None:
        held = 0 if self.cos is None else len(self.cos)
        rows = [self.rotary(self.like, torch.tensor([[p]], device=self.like.device)) for p in range(held, size)]
        cos, sin = (torch.cat([r[i][0] for r in rows]) for i in (0, 1))
        if self.cos is not None:
            cos, sin = torch.cat([self.cos, cos]), torch.cat([self.sin, sin])
        self.cos, self.sin = cos, sin


_rotary_tables: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()


def rotary(model, positions: torch.Tensor, end: int, kind: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [1, T, head_dim] of positions [1, T] (all below `end`), from the model's
    RotaryTable of `kind` (rotary_kind)."""
    tables = _rotary_tables.setdefault(model, {})
    if (table := tables.get(kind)) is None:
        table = tables[kind] = RotaryTable(model, kind)
    return table(positions, end)


def rotary_kind(model, layer) -> str | None:
    """The layer type whose rotary embedding a decoder layer takes, where the model's
    embedding differs by layer type (Gemma 3's holds one per type: `layer_types`); None:
    the model's one."""
    return layer.self_attn.layer_type if hasattr(model.model.rotary_emb, "layer_types") else None


def _softcap(attn) -> float | None:
    """The cap of an attention layer's scores (Gemma 2's; Gemma 3's config may set one)."""
    return getattr(attn, "attn_logit_softcapping", None)


def _sandwiched(layer) -> bool:
    """Gemma's layer: the attention's and the MLP's outputs each normed before they are
    added (post_attention_layernorm, post_feedforward_layernorm), the MLP's input by
    pre_feedforward_layernorm; Llama's post_attention_layernorm is its MLP's input norm."""
    return hasattr(layer, "pre_feedforward_layernorm")


def _turned_q_k_v(attn, x, cos, sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An attention layer's q, k (each head normed where it norms them, then turned) and v
    of its input x [1, T, hidden] -> each [1, heads, T, head_dim]."""
    shape = (*x.shape[:-1], -1, attn.head_dim)
    shared = getattr(attn, "shared_q_k_v", None)
    if shared is not None:
        qkv = shared.linear(x)
        (_, q_end), (_, k_end), _ = shared.columns
        qk = qkv[..., :k_end].view(shape)  # [1, T, heads + kv_heads, head_dim]
        if getattr(attn, "q_norm", None) is not None:  # Qwen3's, Gemma 3's: each head normed before it turns
            heads = q_end // attn.head_dim
            qk = torch.cat([attn.q_norm(qk[..., :heads, :]), attn.k_norm(qk[..., heads:, :])], dim=-2)
        qk = qk.transpose(1, 2)
        qk = (qk * cos) + (_rotate_half(qk) * sin)
        q, k = qk[:, :q_end // attn.head_dim], qk[:, q_end // attn.head_dim:]
        v = qkv[..., k_end:].view(shape).transpose(1, 2)
    else:
        q, k = attn.q_proj(x).view(shape), attn.k_proj(x).view(shape)
        if getattr(attn, "q_norm", None) is not None:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # [1, heads, T, head_dim]
        v = attn.v_proj(x).view(shape).transpose(1, 2)
        q = (q * cos) + (_rotate_half(q) * sin)
        k = (k * cos) + (_rotate_half(k) * sin)
    return q, k, v


def _llama_forward(model, ids, positions, keep, plan: Plan) -> torch.Tensor:
    """LlamaForCausalLM's forward (and its family's, `_llama_like`): its modules, and its
    operations on each element in its order (the same logits to the bit), without the
    plumbing around them (output capture, masks, cache, attention dispatch): on a CPU, a
    one-token step of the default target spent more time in that than in its arithmetic.
    Where q, k and v (gate and up) are one product (specdec.runtime.quantize), it is taken once,
    and q and k turn in one rotary operation."""
    inner = model.model
    h = inner.embed_tokens(ids)  # [1, T, hidden]
    turns = {}  # rotary_kind -> cos, sin [1, 1, T, head_dim]
    if plan.feature_layers:
        plan.features = {}
    for index, layer in enumerate(inner.layers):
        if index in plan.feature_layers:
            plan.features[index] = h[0, plan.feature_rows]
        if (kind := rotary_kind(model, layer)) not in turns:
            turns[kind] = tuple(t.unsqueeze(1) for t in rotary(model, positions, plan.end, kind))
        cos, sin = turns[kind]
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        q, k, v = _turned_q_k_v(attn, x, cos, sin)
        o, _ = paged_attention(attn, q, k, v, None, scaling=attn.scaling, specdec_plan=plan,
                               sliding_window=window_of(attn), softcap=_softcap(attn))
        o = attn.o_proj(o.reshape(*x.shape[:-1], -1).contiguous())
        sandwiched = _sandwiched(layer)
        if sandwiched:
            h = h + layer.post_attention_layernorm(o)
            x = layer.pre_feedforward_layernorm(h)
        else:
            h = h + o
            x = layer.post_attention_layernorm(h)
        mlp = layer.mlp
        shared = getattr(mlp, "shared_gate_up", None)
        if shared is not None:
            gate_up = shared.linear(x)
            (_, gate_end), _ = shared.columns
            y = mlp.down_proj(mlp.act_fn(gate_up[..., :gate_end]) * gate_up[..., gate_end:])
        else:
            y = mlp(x)
        h = h + (layer.post_feedforward_layernorm(y) if sandwiched else y)
    if len(inner.layers) in plan.feature_layers:
        plan.features[len(inner.layers)] = h[0, plan.feature_rows]
    return _logits(model, inner.norm(h)[:, keep])


def _logits(model, h: torch.Tensor) -> torch.Tensor:
    """The head's logits of the final norm's output h, capped where the config caps them
    (Gemma 2's cap · tanh(logit / cap)): in float64, rounded once, so that a logit's bits
    do not depend on where it lies in the pass (torch's tanh rounds its SIMD lanes and the
    values left over differently)."""
    logits = model.lm_head(h)
    if cap := getattr(model.config, "final_logit_softcapping", None):
        logits = (torch.tanh(logits.double() / cap) * cap).to(logits.dtype)
    return logits


class _LayerStacks:
    """The model's decoder layers in `LlamaStack`s: all of them in one, and the runs
    between the layers whose features a pass keeps, each built at its first use. A layer
    attends within a window (or none) through a rotary embedding (rotary_kind): the
    stack's own pair of them, or where the model's layers take two, the other for the
    layers flagged local (Gemma 3's local layers; Qwen2's windowed ones)."""

    def __init__(self, model, whole, own: tuple, local: tuple | None, flags: list[int]):
        self.model, self.count = model, len(model.model.layers)
        self.built = {(0, self.count): whole}
        self.own, self.local, self.flags = own, local, flags  # (window, rotary kind) each

    @classmethod
    def of(cls, model) -> "_LayerStacks | None":
        keys = [(window_of(layer.self_attn), rotary_kind(model, layer)) for layer in model.model.layers]
        distinct = list(dict.fromkeys(keys))
        if len(distinct) > 2:
            return None  # layers that attend otherwise still: the Python pass takes each
        own = next((key for key in distinct if key[0] is None), distinct[0])
        local = next((key for key in distinct if key != own), None)
        flags = [int(key != own) for key in keys] if local else []
        whole = _layer_stack(model, 0, None, flags)
        return None if whole is None else cls(model, whole, own, local, flags)

    def get(self, start: int, end: int):
        if (stack := self.built.get((start, end))) is None:
            stack = self.built[(start, end)] = _layer_stack(self.model, start, end, self.flags[start:end])
        return stack


def _products(module, shared: str, names: tuple[str, ...]) -> list:
    """The weights of a product of layers that read the same input: the one they share
    (specdec.runtime.quantize._Shared), or each its own where their blocks differ in type."""
    fused = getattr(module, shared, None)
    return [fused.linear] if fused is not None else [getattr(module, name, None) for name in names]


def _layer_stack(model, start: int = 0, end: int | None = None, local: list[int] = ()):
    """specdec/runtime/kernels/layer_cpu.cpp's `LlamaStack` over the decoder layers [start, end)
    of a Llama-family model (`_llama_like`) on GGUF blocks (q, k and v as one product or,
    in blocks of different types, three, with or without biases; gate and up as one or
    two; the norms in their kernel, two a layer or Gemma's four; our silu or gelu_tanh;
    Gemma 2's capped scores), local: a flag a layer (_LayerStacks), or None where a layer
    is otherwise: _llama_forward runs it."""
    from specdec.runtime import ggml
    from specdec.runtime.kernels import cpu

    config, layers = model.config, model.model.layers[start:end]
    norms, weights, kinds, biases, head_norms, parts = [], [], [], [], [], []
    activations = list(ggml.ACTIVATIONS)  # in the kernel's order: silu, gelu_tanh
    if (activation := ggml.activation_name(config)) not in activations:
        return None
    first = layers[0]
    eps, ours = getattr(first.input_layernorm, "variance_epsilon", None), ggml.ACTIVATIONS[activation][1]
    head_dim = first.self_attn.head_dim
    widths = None  # of q, k and v: every layer's the same

    def kernel_norm(n) -> bool:
        return isinstance(n, ggml.RMSNorm) and n.weight.dtype == torch.float32 and n.variance_epsilon == eps

    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        q_k_v = _products(attn, "shared_q_k_v", ("q_proj", "k_proj", "v_proj"))
        gate_up = _products(mlp, "shared_gate_up", ("gate_proj", "up_proj"))
        linears = [*q_k_v, attn.o_proj, *gate_up, mlp.down_proj]
        each = [layer.input_layernorm, layer.post_attention_layernorm]
        if _sandwiched(layer):
            each += [layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm]
        per_head = [n for n in (getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)) if n is not None]
        if not all(isinstance(m, ggml.GGUFLinear) for m in linears) \
                or any(m.bias is not None for m in linears[len(q_k_v):]) \
                or len({m.bias is None for m in q_k_v}) > 1 or not all(kernel_norm(n) for n in each + per_head) \
                or not isinstance(mlp.act_fn, ours) or attn.scaling != first.self_attn.scaling \
                or _softcap(attn) != _softcap(first.self_attn):
            return None
        columns = attn.shared_q_k_v.columns if len(q_k_v) == 1 else None
        its_widths = [b - a for a, b in columns] if columns else [m.out_features for m in q_k_v]
        if widths not in (None, its_widths):
            return None
        widths = its_widths
        norms += [n.weight for n in each]
        weights += [m.packed for m in linears]
        kinds += [m.kind for m in linears]
        parts += [len(q_k_v), len(gate_up)]
        if q_k_v[0].bias is not None:
            biases.append(torch.cat([m.bias for m in q_k_v]))
        head_norms += [n.weight for n in per_head]
    if len(biases) not in (0, len(layers)) or len(head_norms) not in (0, 2 * len(layers)) \
            or len(norms) not in (2 * len(layers), 4 * len(layers)):
        return None  # layers that differ: the Python pass takes each as it is
    sizes = [config.hidden_size, config.num_attention_heads, widths[-1] // head_dim, head_dim,
             first.mlp.down_proj.in_features]
    return cpu().LlamaStack(norms, weights, kinds, sizes, eps, first.self_attn.scaling, biases, head_norms,
                            activations.index(activation), list(local), _softcap(first.self_attn) or 0.0, parts)


def _layer_kernel_forward(stacks: _LayerStacks, model, ids, positions, keep, plan: Plan) -> torch.Tensor:
    """_llama_forward with the decoder layers in one kernel call (`LlamaStack.forward`,
    whose file says why), or one a run between the layers whose features the pass keeps:
    the same operations on each element, so the same bits."""
    inner = model.model
    h = inner.embed_tokens(ids)[0]  # [T, hidden]
    (window, kind), local = stacks.own, []
    cos, sin = rotary(model, positions, plan.end, kind)
    if stacks.local is not None:
        local_window, local_kind = stacks.local
        local = [t[0] for t in rotary(model, positions, plan.end, local_kind)] + list(plan.table_for(local_window))
    if plan.abandoned():
        raise Abandoned  # before the first layer writes
    bounds = sorted({0, stacks.count, *plan.feature_layers})
    if plan.feature_layers:
        plan.features = {}
    for start, end in zip(bounds, bounds[1:]):
        if start in plan.feature_layers:
            plan.features[start] = h[plan.feature_rows]
        h = stacks.get(start, end).forward(h, cos[0], sin[0], plan.pool.k[start:end], plan.pool.v[start:end],
                                           plan.write_slots, *plan.table_for(window), plan.stop, local)
        if h is None:
            raise Abandoned  # what the layers before it wrote lies past the rows' cached positions: not counted
    if stacks.count in plan.feature_layers:
        plan.features[stacks.count] = h[plan.feature_rows]
    return _logits(model, inner.norm(h[None])[:, keep])
