"""A session's token sequence, and the KV memory that sessions share.

Every session of a model keeps its keys and values in one pool (`KVPool`), in blocks
of `block_size` positions that the engine hands out and takes back. A session's cache
is rolled back by position: a call names the position its new tokens start at, the
sequence keeps what still matches, and `cached` drops to that length. Nothing is ever
copied, and a session whose blocks were taken back still holds its tokens: its cache
is recomputed from them."""

import math

import torch

from specdec.errors import NeedsResync, RESYNC_DETAIL


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class TokenSequence:
    """Tokens a service holds for one session: committed ones and, beyond them, drafts
    of the last round. Only the caller knows which are committed."""

    def __init__(self):
        self.tokens: list[int] = []

    def sync(self, start: int, new_tokens: list[int]) -> int:
        """Makes tokens[start:] == new_tokens; returns how many held tokens survive."""
        if start > len(self.tokens):
            raise NeedsResync(f"session holds {len(self.tokens)} tokens, call starts at {start}; {RESYNC_DETAIL}")
        kept = start + common_prefix(self.tokens[start:], new_tokens)
        self.tokens = self.tokens[:start] + list(new_tokens)
        return kept

    def extend(self, tokens: list[int]) -> None:
        self.tokens.extend(tokens)


class KVPool:
    """Keys and values of every session of one model: per layer, [slots, kv_heads,
    head_dim], in blocks of `block_size` slots. Block 0 is never handed out; its first
    slot holds zeros, the padding read by rows shorter than their batch's longest."""

    def __init__(self, config, budget_bytes: int, dtype: torch.dtype, device, block_size: int = 16):
        layers = config.num_hidden_layers
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.block_size = block_size
        self.bytes_per_token = layers * 2 * kv_heads * head_dim * dtype.itemsize
        num_blocks = budget_bytes // (self.bytes_per_token * block_size)
        if num_blocks < 2:
            raise ValueError(f"a KV budget of {budget_bytes} bytes holds fewer than two blocks of {block_size} "
                             f"tokens at {self.bytes_per_token} bytes per token")
        slots = num_blocks * block_size
        # empty, not zeros: memory is touched only as sessions fill it
        self.k = [torch.empty(slots, kv_heads, head_dim, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.empty(slots, kv_heads, head_dim, dtype=dtype, device=device) for _ in range(layers)]
        for t in (*self.k, *self.v):
            t[0].zero_()
        self.capacity = num_blocks - 1  # blocks a session can get
        self.free = list(range(num_blocks - 1, 0, -1))

    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_size)

    def allocate(self, n: int) -> list[int]:
        assert n <= len(self.free)
        taken, self.free = self.free[len(self.free) - n:], self.free[:len(self.free) - n]
        return taken

    def release(self, blocks: list[int]) -> None:
        self.free.extend(blocks)


class PagedSequence(TokenSequence):
    """A TokenSequence whose first `cached` tokens have keys and values in the engine's
    pool, in `blocks`. The engine owns `blocks`, `cached` and `admitted`; a sync changes
    them through the engine (under its lock), never while a forward holds the session."""

    def __init__(self, engine):
        super().__init__()
        self.engine = engine
        self.blocks: list[int] = []
        self.cached = 0
        self.admitted = 0  # admission order while it holds blocks; 0: holds none
        self.released = False

    def sync(self, start: int, new_tokens: list[int]) -> int:
        kept = super().sync(start, new_tokens)
        self.engine.crop(self, kept)
        return kept

    async def logits(self, last: int, again: bool = True):
        """Computes what is not cached; -> (logits after each of the last `last` tokens
        [last, vocab], the engine's Pass that finished them). `again`: more calls follow
        soon (the engine may wait a moment for them to batch)."""
        return await self.engine.forward(self, last, again)

    def decode(self, pick):
        """Decodes from here, one token per pass (Engine.decode)."""
        return self.engine.decode(self, pick)

    def slots(self, end: int, device) -> torch.Tensor:
        """Pool slots of positions [0, end). -> [end]"""
        bs = self.engine.pool.block_size
        blocks = torch.tensor(self.blocks[:math.ceil(end / bs)], dtype=torch.long, device=device)
        return (blocks[:, None] * bs + torch.arange(bs, device=device)).flatten()[:end]
