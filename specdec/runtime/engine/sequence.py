"""One session's tokens, and where its cached keys and values live.

A session's cache is rolled back by position: a call names the position its new tokens
start at, the sequence keeps what still matches, and `cached` drops to that length.
Nothing is ever copied, and a session whose blocks were taken back still holds its
tokens: its cache is recomputed from them."""

import math

import numpy as np
import torch

from specdec.lookup import common_prefix

from specdec.errors import NeedsResync, RESYNC_DETAIL


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


class PagedSequence(TokenSequence):
    """A TokenSequence whose first `cached` tokens have keys and values in the engine's
    pool, in `blocks`. The engine owns `blocks`, `hashes`, `cached` and `admitted`; a sync changes
    them through the engine (under its lock), never while a forward holds the session."""

    def __init__(self, engine):
        super().__init__()
        self.engine = engine
        self.blocks: list[int] = []
        self.hashes: list[bytes] = []  # prefix digests of its first full blocks (see block_manager)
        self.cached = 0
        self.admitted = 0  # admission order while it holds blocks; 0: holds none
        self.released = False

    def sync(self, start: int, new_tokens: list[int]) -> int:
        kept = super().sync(start, new_tokens)
        self.engine.crop(self, kept)
        return kept

    async def logits(self, last: int, again: bool = True, layers: tuple[int, ...] = (),
                     logits_last: int | None = None):
        """Computes what is not cached; -> (logits after each of the last `last` tokens
        [last, vocab] (with `logits_last`, of that many of them), the engine's Pass that
        finished them[, the features at `layers`]). `again`: more calls follow soon (the
        engine may wait a moment for them to batch)."""
        return await self.engine.forward(self, last, again, layers, logits_last)

    def decode(self, pick, layers: tuple[int, ...] = (), last: int = 1):
        """Decodes from here, one token per pass (Engine.decode)."""
        return self.engine.decode(self, pick, layers, last)

    def slots(self, end: int, block_size: int, device) -> torch.Tensor:
        """Pool slots of positions [0, end). -> [end]"""
        return torch.from_numpy(self.slot_array(end, block_size)).to(device)

    def slot_array(self, end: int, block_size: int) -> np.ndarray:
        """slots(), on the host."""
        blocks = np.asarray(self.blocks[:math.ceil(end / block_size)], dtype=np.int64)
        return (blocks[:, None] * block_size + np.arange(block_size)).ravel()[:end]
