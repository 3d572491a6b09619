"""The KV memory that a model's sessions share, and who holds which blocks of it.

Every session keeps its keys and values in one pool (`KVPool`), in blocks of
`block_size` positions. A session is admitted when the pool has blocks for all its
tokens; a running session that must grow takes blocks back from the newest admitted
session outside the pass, which keeps its tokens and recomputes its cache when its turn
comes (preemption by recompute)."""

import itertools
import logging
import math

import torch

from specdec.engine.sequence import PagedSequence

log = logging.getLogger(__name__)


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


class BlockManager:
    """Hands the pool's blocks to sessions and takes them back. Not thread-safe: the
    engine calls it under its lock."""

    def __init__(self, pool: KVPool, metrics=None):
        self.pool = pool
        self.holders: set[PagedSequence] = set()  # sessions holding blocks
        self.admissions = itertools.count(1)
        self.evictions = 0
        self.metrics = metrics

    @property
    def used(self) -> int:
        return self.pool.capacity - len(self.pool.free)

    def fits(self, seq: PagedSequence) -> bool:
        """Could the whole pool hold seq?"""
        return self.pool.blocks_for(len(seq.tokens)) <= self.pool.capacity

    def admit(self, seq: PagedSequence) -> bool:
        """Blocks for all of seq's tokens, if the pool has them free."""
        need = self.pool.blocks_for(len(seq.tokens))
        if need > len(self.pool.free):
            return False
        seq.blocks = self.pool.allocate(need)
        seq.admitted = next(self.admissions)
        self.holders.add(seq)
        return True

    def reserve(self, seq: PagedSequence, n: int, in_pass: set) -> bool:
        """Blocks for seq's next n positions: a new session is admitted only with blocks
        for all its tokens; a running one may take blocks back from newer sessions
        (outside `in_pass`)."""
        pool = self.pool
        if not seq.admitted:
            return self.admit(seq)
        need = pool.blocks_for(seq.cached + n) - len(seq.blocks)
        while need > len(pool.free):
            newer = [s for s in self.holders if s.admitted > seq.admitted and s not in in_pass]
            if not newer:
                return False
            victim = max(newer, key=lambda s: s.admitted)
            log.info("KV pool full: a session of %d tokens gives its blocks back (it recomputes later)",
                     len(victim.tokens))
            self.evictions += 1
            if self.metrics is not None:
                self.metrics.evictions.inc()
            self.evict(victim)
        if need > 0:
            seq.blocks.extend(pool.allocate(need))
        return True

    def crop(self, seq: PagedSequence) -> bool:
        """Gives back the blocks seq no longer needs (past its cache and its tokens);
        -> whether any went back."""
        keep = self.pool.blocks_for(max(seq.cached, len(seq.tokens)))
        if not seq.admitted or len(seq.blocks) <= keep:
            return False
        self.pool.release(seq.blocks[keep:])
        del seq.blocks[keep:]
        return True

    def evict(self, seq: PagedSequence) -> None:
        """All of seq's blocks go back; its cache is recomputed from its tokens."""
        self.pool.release(seq.blocks)
        seq.blocks, seq.cached, seq.admitted = [], 0, 0
        self.holders.discard(seq)
