"""A session's token sequence and the model's KV cache over it.

The cache is rolled back by position: a call names the position its new tokens start
at, the sequence keeps what still matches, and the cache is cropped to that length.
Nothing is ever copied."""

import torch
from transformers import DynamicCache

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


class CachedSequence(TokenSequence):
    """A TokenSequence with the model's KV cache over its first `cached` tokens."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.cache = DynamicCache(config=model.config)

    @property
    def cached(self) -> int:
        return self.cache.get_seq_length()

    def _crop(self, length: int) -> None:
        if self.cached > length:
            self.cache.crop(length - self.cached)  # transformers 5: negative = tokens to drop

    def sync(self, start: int, new_tokens: list[int]) -> int:
        kept = super().sync(start, new_tokens)
        self._crop(kept)
        return kept

    @torch.inference_mode()
    def logits(self, last: int) -> torch.Tensor:
        """Runs the model over the tokens not yet cached; returns the logits that
        predict the token after each of the `last` final tokens. -> [last, vocab]"""
        self._crop(len(self.tokens) - last)
        pending = self.tokens[self.cached:]
        input_ids = torch.tensor([pending], dtype=torch.long, device=self.model.device)
        out = self.model(input_ids=input_ids, past_key_values=self.cache, use_cache=True, logits_to_keep=last)
        return out.logits[0, -last:].float()
