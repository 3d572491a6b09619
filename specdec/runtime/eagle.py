"""EAGLE-3 draft heads (Li et al. 2025): one decoder layer that drafts from the target's
own hidden states.

The target's residual stream at a few of its layers (EAGLE-3 takes a low, a middle and a
high one) at position i, fused by `fc` into one vector f[i], goes with the embedding of
token x[i+1] into the head's layer; the layer's output g predicts x[i+2] through the
head's own output head (over a draft vocabulary: `d2t` maps its rows to token ids).
Drafting goes on from the head's own output: (g, the drafted token) is the next input.

The format is the one the ecosystem trains these heads in (SpecForge and the EAGLE
repository: `LlamaForCausalLMEagle3`, weights `midlayer.*`, `fc`, `norm`, `lm_head`,
`d2t`; the `speculators` format: the same weights under `layers.0.*`, the layer's config
in `transformer_layer_config`), so that a published head loads as it ships. A head
without `embed_tokens.weight` reads the target's embedding (`borrowed.json`).

Both sides of a head meet here: the drafter's batched steps (`Eagle3Head.step`) and the
training's unrolled pass (`Eagle3Head.unrolled`) run the same operations, so a head
trained here drafts as it was trained (a test holds the two to each other)."""

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

# Keys of our own in a head's config.json (the ecosystem's readers ignore them).
WINDOW_KEY = "specdec_window"  # positions the head attends to at most (see Eagle3Head.step)
DEFAULT_WINDOW = 256


def is_head(path: str | Path) -> bool:
    """Whether a model directory holds an EAGLE-3 head."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    raw = json.loads(config.read_text())
    return raw.get("speculators_model_type") == "eagle3" or \
        any("eagle3" in a.lower() for a in raw.get("architectures", []))


@dataclass
class HeadConfig:
    layer: dict  # the head's decoder layer, as a Llama config's fields
    draft_vocab: int
    target_hidden: int
    aux_layers: tuple[int, ...] | None  # the target's layers it reads; None: EAGLE-3's choice for the target
    norm_before_residual: bool = False
    window: int = DEFAULT_WINDOW

    @classmethod
    def read(cls, path: str | Path) -> "HeadConfig":
        raw = json.loads((Path(path) / "config.json").read_text())
        layer = raw.get("transformer_layer_config", raw)  # speculators nests it
        eagle = raw.get("eagle_config") or {}
        aux = eagle.get("eagle_aux_hidden_state_layer_ids") or raw.get("eagle_aux_hidden_state_layer_ids")
        return cls(layer=layer, draft_vocab=int(raw.get("draft_vocab_size") or layer["vocab_size"]),
                   target_hidden=int(raw.get("target_hidden_size") or layer["hidden_size"]),
                   aux_layers=tuple(aux) if aux else None,
                   norm_before_residual=bool(raw.get("norm_before_residual", False)),
                   window=int(raw.get(WINDOW_KEY, DEFAULT_WINDOW)))

    def llama(self):
        from transformers import LlamaConfig

        fields = {k: v for k, v in self.layer.items() if k not in ("architectures", "model_type")}
        return LlamaConfig(**fields)


def aux_layers_for(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's layers of a target of `num_layers`: the residual stream entering layers
    2, L/2 and L-3 (vLLM's and SGLang's choice where the head does not name them)."""
    return 2, num_layers // 2, num_layers - 3


class Eagle3Layer(torch.nn.Module):
    """The head's decoder layer: attention over [norm(embedding); norm(hidden)] (2H wide),
    then the usual MLP, both with residuals on the hidden side."""

    def __init__(self, config):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

        hidden = config.hidden_size
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or hidden // self.heads
        bias = bool(getattr(config, "attention_bias", False))
        self.q_proj = torch.nn.Linear(2 * hidden, self.heads * self.head_dim, bias=bias)
        self.k_proj = torch.nn.Linear(2 * hidden, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = torch.nn.Linear(2 * hidden, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = torch.nn.Linear(self.heads * self.head_dim, hidden, bias=bias)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.norm_before_residual = False

    def qkv(self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """embeds, hidden [..., T, H]; cos, sin [..., T, head_dim] -> q [..., heads, T, d],
        k, v [..., kv_heads, T, d] (rotated), the residual [..., T, H]."""
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        shape = (*x.shape[:-1], -1, self.head_dim)
        q, k, v = (proj(x).view(shape).transpose(-2, -3) for proj in (self.q_proj, self.k_proj, self.v_proj))
        cos, sin = cos.unsqueeze(-3), sin.unsqueeze(-3)
        return _rotate(q, cos, sin), _rotate(k, cos, sin), v, residual

    def finish(self, attended: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """attended [..., heads, T, d] -> the layer's output [..., T, H]."""
        h = residual + self.o_proj(attended.transpose(-2, -3).flatten(-2))
        return h + self.mlp(self.post_attention_layernorm(h))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class HeadCache:
    """One session's keys and values in the head's layer, [kv_heads, positions, d], and
    the position of their first column; at most `window` positions are kept."""

    def __init__(self):
        self.k = self.v = None
        self.first = 0  # position of column 0
        self.end = 0  # position after the last column

    def crop(self, end: int) -> None:
        """Forgets the positions from `end` on (a round's drafts, once the round is over)."""
        if self.k is not None and end < self.end:
            keep = max(0, end - self.first)
            self.k, self.v = self.k[:, :keep], self.v[:, :keep]
            self.end = self.first + keep

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k = k if self.k is None else torch.cat([self.k, k], dim=1)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=1)
        self.end += k.shape[1]

    def trim(self, window: int) -> None:
        """Keeps the last `window` positions: all the next position attends."""
        if self.k is not None and (over := self.k.shape[1] - window) > 0:
            self.k, self.v = self.k[:, over:], self.v[:, over:]
            self.first += over


class Eagle3Head(torch.nn.Module):
    def __init__(self, config: HeadConfig, target_layers: int | None = None):
        """target_layers: the target's layer count (where the config does not name the
        layers the head reads)."""
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

        llama = config.llama()
        self.config, self.window = config, config.window
        if config.aux_layers is not None:
            self.aux_layers = config.aux_layers
        elif target_layers is not None:
            self.aux_layers = aux_layers_for(target_layers)
        else:
            raise ValueError("the head's config.json names no target layers to read: add them as "
                             "eagle_config.eagle_aux_hidden_state_layer_ids (EAGLE-3 reads the inputs of layers 2, "
                             "L/2 and L-3 of an L-layer target)")
        hidden = llama.hidden_size
        self.embed_tokens = torch.nn.Embedding(llama.vocab_size, hidden)
        self.fc = torch.nn.Linear(len(self.aux_layers) * config.target_hidden, hidden, bias=False)
        self.midlayer = Eagle3Layer(llama)
        self.midlayer.norm_before_residual = config.norm_before_residual
        self.norm = LlamaRMSNorm(hidden, eps=llama.rms_norm_eps)
        self.lm_head = torch.nn.Linear(hidden, config.draft_vocab, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab, dtype=torch.long))
        self.rotary = LlamaRotaryEmbedding(llama)

    @property
    def token_ids(self) -> torch.Tensor:
        """The token id of each row of the output head."""
        return torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t

    def _cos_sin(self, positions: torch.Tensor):
        cos, sin = self.rotary(self.fc.weight, positions.reshape(1, -1))
        return cos.reshape(*positions.shape, -1), sin.reshape(*positions.shape, -1)

    def logits(self, g: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(g))

    # -- drafting --------------------------------------------------------------------

    @torch.inference_mode()
    def step(self, rows: list[tuple[HeadCache, torch.Tensor, torch.Tensor, int, bool]]
             ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """One pass over several sessions' new inputs. A row: (its cache, tokens [t], hidden
        [t, H] (the fused target features, or the head's own output), position of the first,
        whether `hidden` is the target's features (fused by fc here)). Each row attends its
        cache (at most `window` positions) and its own inputs, causally; its keys and values
        join the cache. -> each row's last output g [H] and its logits [draft_vocab]."""
        fused = [(self.fc(h) if raw else h) for _, _, h, _, raw in rows]
        tokens = torch.cat([t for _, t, _, _, _ in rows])
        positions = torch.cat([torch.arange(p, p + len(t)) for _, t, _, p, _ in rows]).to(tokens.device)
        cos, sin = self._cos_sin(positions)
        q, k, v, residual = self.midlayer.qkv(self.embed_tokens(tokens), torch.cat(fused), cos, sin)
        attended, at = [], 0
        for cache, t, _, position, raw in rows:
            n = len(t)
            if cache.end != position:
                raise ValueError(f"inputs start at position {position}; the cache ends at {cache.end}")
            cache.append(k[:, at:at + n], v[:, at:at + n])
            attended.append(_attend(q[:, at:at + n], cache.k, cache.v, self.window))
            if raw:  # a round's drafts stay whole until it crops them: the window is of the real inputs
                cache.trim(self.window)
            at += n
        out = self.midlayer.finish(torch.cat(attended, dim=1), residual)
        ends = torch.cumsum(torch.tensor([len(t) for _, t, _, _, _ in rows]), 0) - 1
        last = out[ends.to(out.device)]
        logits = self.logits(last)
        return list(last), list(logits)

    # -- training --------------------------------------------------------------------

    def unrolled(self, tokens: torch.Tensor, features: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Training-time test (EAGLE-3): drafting unrolled `steps` deep at every position at
        once, as the drafter runs it. tokens [B, T] (x[i+1] at index i), features [B, T,
        n*target_hidden] (the target's at position i). The chain that starts at index i
        takes (f[i], x[i+1]), then (its own output, x[i+1+j]) at step j, at position i+j,
        attending index <= i's real inputs (the cache) and its own earlier steps. ->
        outputs g of each step [B, T, H] (step j at index i predicts x[i+2+j])."""
        batch, length = tokens.shape
        positions = torch.arange(length, device=tokens.device)
        hidden = self.fc(features)
        outputs, chain = [], []  # chain: each later step's keys and values [B, kv, T, d]
        for j in range(steps):
            shifted = F.pad(tokens[:, j:], (0, j))  # x[i+1+j] at index i (padding past the end)
            cos, sin = self._cos_sin(positions + j)
            q, k, v, residual = self.midlayer.qkv(self.embed_tokens(shifted), hidden, cos, sin)
            if j == 0:
                keys0, values0 = k, v
            else:
                chain.append((k, v))
            groups = self.midlayer.heads // self.midlayer.kv_heads
            k0, v0 = keys0.repeat_interleave(groups, 1), values0.repeat_interleave(groups, 1)
            scale = 1 / math.sqrt(self.midlayer.head_dim)
            scores = (q @ k0.transpose(-1, -2)) * scale  # [B, heads, T, T]
            # index i's chain attends real inputs <= i, within the window of its position i + j
            mask = (positions[None, :] <= positions[:, None]) & (positions[None, :] > positions[:, None] + j - self.window)
            scores = scores.masked_fill(~mask, float("-inf"))
            scores_own = [(q * kc.repeat_interleave(groups, 1)).sum(-1, keepdim=True) * scale for kc, _ in chain]
            weights = torch.softmax(torch.cat([scores, *scores_own], dim=-1), dim=-1)
            attended = weights[..., :length] @ v0
            for s, (_, vc) in enumerate(chain):
                attended = attended + weights[..., length + s:length + s + 1] * vc.repeat_interleave(groups, 1)
            out = self.midlayer.finish(attended, residual)
            outputs.append(out)
            hidden = out
        return outputs


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, window: int) -> torch.Tensor:
    """q [heads, n, d] (a row's last n positions), keys, values [kv_heads, L, d] ending at
    the same position -> [heads, n, d]; each query attends causally, at most `window` back."""
    heads, n, _ = q.shape
    length = keys.shape[1]
    groups = heads // keys.shape[0]
    keys, values = keys.repeat_interleave(groups, 0), values.repeat_interleave(groups, 0)
    query_pos = torch.arange(length - n, length, device=q.device)[:, None]
    key_pos = torch.arange(length, device=q.device)[None, :]
    mask = (key_pos <= query_pos) & (key_pos > query_pos - window)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)


def load_head(path: str | Path, target_layers: int | None = None, dtype=torch.float32, device="cpu",
              window: int | None = None) -> Eagle3Head:
    """A head from its directory (the formats above), in eval mode."""
    from safetensors.torch import load_file

    path = Path(path)
    config = HeadConfig.read(path)
    if window is not None:
        config.window = window
    head = Eagle3Head(config, target_layers)
    state = {}
    for file in sorted(path.glob("*.safetensors")):
        state.update(load_file(file))
    renamed = {}
    for name, tensor in state.items():
        name = name.removeprefix("model.")
        if name.startswith("layers.0."):
            name = "midlayer." + name[len("layers.0."):]
        if name == "t2d":
            continue  # d2t says the same
        renamed[name] = tensor
    if "d2t" not in renamed:
        if config.draft_vocab != head.embed_tokens.num_embeddings:
            raise ValueError(f"{path}: a draft vocabulary of {config.draft_vocab} tokens needs d2t")
        renamed["d2t"] = torch.zeros(config.draft_vocab, dtype=torch.long)
    missing, unexpected = head.load_state_dict(renamed, strict=False)
    missing = [m for m in missing if not m.startswith("rotary.")]
    if missing or unexpected:
        raise ValueError(f"{path}: not an EAGLE-3 head this loader knows: missing {missing}, "
                         f"unexpected {unexpected}")
    head.d2t.copy_(renamed["d2t"].long())
    return head.to(device=device, dtype=dtype).eval()


def save_head(head: Eagle3Head, path: str | Path, extra: dict | None = None,
              dtype=torch.float16, skip: tuple[str, ...] = ()) -> None:
    """Writes `head` in the SpecForge format (`skip`: weights left out, e.g. a borrowed
    embedding)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = head.config
    raw = dict(config.layer, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=config.draft_vocab,
               target_hidden_size=config.target_hidden,
               eagle_config={"eagle_aux_hidden_state_layer_ids": list(head.aux_layers)},
               norm_before_residual=config.norm_before_residual, **{WINDOW_KEY: config.window}, **(extra or {}))
    (path / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    state = {name: t.detach().to(dtype if t.is_floating_point() else t.dtype).contiguous()
             for name, t in head.state_dict().items() if name not in skip and not name.startswith("rotary.")}
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
