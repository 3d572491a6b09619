"""The KV memory that a model's sessions share, and who holds which blocks of it.

Every session keeps its keys and values in one pool (`KVPool`), in blocks of
`block_size` positions. A session is admitted when the pool has blocks for all its
tokens; a running session that must grow takes blocks back from the newest admitted
session outside the pass, which keeps its tokens and recomputes its cache when its turn
comes (preemption by recompute).

Prefix caching (as vLLM's automatic prefix caching and nano-vllm's block manager do): a
full block whose keys and values are computed is known by a SHA-256 digest of its tokens
and of every token before it (the digest of the block before, and its own tokens). A
session admitted with a prompt whose first blocks have the same digests (a shared system
prompt; the earlier turns of a chat), and the same tokens, compared on every hit, takes
those blocks as they are and computes only the rest: a key that collides (Python's hash
of the tokens could be inverted, so a client could register a block another prompt would
be served: vLLM's CVE-2025-25183) serves nothing. Blocks are counted by reference; a block nobody holds keeps its
contents, and is handed out again (oldest first) only when no free block is left. A
shared block is never written: a session that rolls back into one lets it go and
computes those positions into a block of its own. The kernels are batch invariant, so
a block's keys and values are the same bits whoever computed them, in whatever pass."""

import hashlib
import itertools
import logging
import math
from array import array
from collections import OrderedDict

import torch

from specdec.runtime.engine.sequence import PagedSequence

log = logging.getLogger(__name__)


def prefix_digests(tokens: list[int], block_size: int, start: list[bytes] = ()) -> list[bytes]:
    """The prefix digests of tokens' full blocks, after `start` (the digests held): each
    block's from the one before it and its own tokens."""
    out = list(start)
    for i in range(len(out), len(tokens) // block_size):
        block = array("q", tokens[i * block_size:(i + 1) * block_size]).tobytes()
        out.append(hashlib.sha256((out[-1] if out else b"") + block).digest())
    return out


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
        self.capacity = num_blocks - 1  # blocks a session can get: 1 .. num_blocks - 1

    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_size)


class BlockManager:
    """Hands the pool's blocks to sessions and takes them back. Not thread-safe: the
    engine calls it under its lock."""

    def __init__(self, pool: KVPool, metrics=None, prefix_caching: bool = True):
        self.pool = pool
        self.free = list(range(pool.capacity, 0, -1))  # blocks with nothing worth keeping
        self.refs: dict[int, int] = {}  # block -> sessions holding it
        self.cached: dict[bytes, int] = {}  # prefix digest -> the block holding its keys and values
        self.hash_of: dict[int, bytes] = {}  # the other way
        self.tokens_of: dict[int, tuple[int, ...]] = {}  # a cached block's own tokens, compared on a hit
        self.idle: OrderedDict[int, None] = OrderedDict()  # cached blocks nobody holds, oldest first
        self.prefix_caching = prefix_caching
        self.holders: set[PagedSequence] = set()  # sessions holding blocks
        self.admissions = itertools.count(1)
        self.evictions = 0
        self.reused_tokens = 0  # prompt tokens admitted with their keys and values already computed
        self.metrics = metrics

    @property
    def available(self) -> int:
        """Blocks that can be handed out now."""
        return len(self.free) + len(self.idle)

    @property
    def used(self) -> int:
        """Blocks sessions hold."""
        return self.pool.capacity - self.available

    def fits(self, seq: PagedSequence) -> bool:
        """Could the whole pool hold seq?"""
        return self.pool.blocks_for(len(seq.tokens)) <= self.pool.capacity

    def _take(self, n: int) -> list[int]:
        assert n <= self.available
        taken = []
        while len(taken) < n:
            if self.free:
                block = self.free.pop()
            else:  # the oldest cached block nobody holds
                block, _ = self.idle.popitem(last=False)
                del self.cached[self.hash_of.pop(block)]
                self.tokens_of.pop(block, None)
            self.refs[block] = 1
            taken.append(block)
        return taken

    def _drop(self, blocks: list[int]) -> None:
        for block in blocks:
            self.refs[block] -= 1
            if self.refs[block] == 0:
                del self.refs[block]
                if block in self.hash_of:
                    self.idle[block] = None
                else:
                    self.free.append(block)

    def admit(self, seq: PagedSequence, limit: int) -> bool:
        """Blocks for all of seq's tokens, if the pool has them; the cached blocks of its
        longest known prefix of at most `limit` tokens come as they are."""
        hashes = prefix_digests(seq.tokens[:limit], self.pool.block_size) if self.prefix_caching else []
        shared, bs = [], self.pool.block_size
        for i, h in enumerate(hashes):
            block = self.cached.get(h)
            if block is None or self.tokens_of.get(block) != tuple(seq.tokens[i * bs:(i + 1) * bs]):
                break
            shared.append(block)
        need = self.pool.blocks_for(len(seq.tokens)) - len(shared)
        if need > self.available - sum(block in self.idle for block in shared):
            return False
        for block in shared:
            self.idle.pop(block, None)
            self.refs[block] = self.refs.get(block, 0) + 1
        seq.blocks = shared + self._take(need)
        seq.hashes = hashes[:len(shared)]
        seq.cached = len(shared) * self.pool.block_size
        seq.admitted = next(self.admissions)
        self.holders.add(seq)
        self.reused_tokens += seq.cached
        if self.metrics is not None and seq.cached:
            self.metrics.prefix_tokens.inc(seq.cached)
        return True

    def reserve(self, seq: PagedSequence, n: int, in_pass: set) -> bool:
        """Blocks for the next n positions of an admitted session: it may take blocks
        back from newer sessions (outside `in_pass`)."""
        pool = self.pool
        need = pool.blocks_for(seq.cached + n) - len(seq.blocks)
        if need <= self.available:
            newer = []
        else:
            newer = sorted((s for s in self.holders if s.admitted > seq.admitted and s not in in_pass),
                           key=lambda s: s.admitted)
            if need > self.available + self._freed_by(newer):
                return False  # evicting them all would not do: nobody is evicted for nothing
        while need > self.available:
            if not newer:
                return False
            victim = newer.pop()  # the newest
            log.info("KV pool full: a session of %d tokens gives its blocks back (it recomputes later)",
                     len(victim.tokens))
            self.evictions += 1
            if self.metrics is not None:
                self.metrics.evictions.inc()
            self.evict(victim)
        if need > 0:
            seq.blocks.extend(self._take(need))
        return True

    def _freed_by(self, seqs: list[PagedSequence]) -> int:
        """Blocks that evicting `seqs` would make available (those no one else holds)."""
        held: dict[int, int] = {}
        for seq in seqs:
            for block in seq.blocks:
                held[block] = held.get(block, 0) + 1
        return sum(self.refs[block] == count for block, count in held.items())

    def computed(self, seq: PagedSequence) -> None:
        """seq's cache grew: its new full blocks become known by their prefix hashes."""
        if not self.prefix_caching:
            return
        full = seq.cached // self.pool.block_size
        if full <= len(seq.hashes):
            return
        known = len(seq.hashes)
        seq.hashes = prefix_digests(seq.tokens[:full * self.pool.block_size], self.pool.block_size, seq.hashes)
        bs = self.pool.block_size
        for i, (block, h) in enumerate(zip(seq.blocks[known:full], seq.hashes[known:]), known):
            if block not in self.hash_of and h not in self.cached:  # else another block holds the same
                self.cached[h], self.hash_of[block] = block, h
                self.tokens_of[block] = tuple(seq.tokens[i * bs:(i + 1) * bs])

    def crop(self, seq: PagedSequence) -> bool:
        """seq's cache was cut back to seq.cached: gives back the blocks it no longer
        needs, and the cached blocks it would write into; -> whether any went back."""
        bs = self.pool.block_size
        del seq.hashes[seq.cached // bs:]
        keep = self.pool.blocks_for(max(seq.cached, len(seq.tokens)))
        # The blocks it writes next must be its own: a cached one (maybe shared) goes back.
        first = seq.cached // bs
        cached = [i for i in range(first, min(keep, len(seq.blocks))) if seq.blocks[i] in self.hash_of]
        if cached:
            keep = cached[0]
            seq.cached = min(seq.cached, keep * bs)
        if not seq.admitted or len(seq.blocks) <= keep:
            return False
        self._drop(seq.blocks[keep:])
        del seq.blocks[keep:]
        return True

    def evict(self, seq: PagedSequence) -> None:
        """All of seq's blocks go back; its cache is recomputed from its tokens."""
        self._drop(seq.blocks)
        seq.blocks, seq.hashes, seq.cached, seq.admitted = [], [], 0, 0
        self.holders.discard(seq)
