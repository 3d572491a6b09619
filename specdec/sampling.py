"""Token distributions after sampling processing, and reproducible random draws.

Drafter and verifier both call `probs`, so the draft distribution q and the target
distribution p get the same temperature / top-k / top-p processing.
"""

import hashlib
import math
import struct

import torch

from specdec.common.v1 import common_pb2
from specdec.errors import InvalidArgument


def is_greedy(params: common_pb2.SamplingParams) -> bool:
    return params.temperature == 0.0


# Near 0, logits / temperature overflows float32 (inf, then NaN probabilities); well
# before that, sampling is greedy in all but name.
MIN_TEMPERATURE = 0.01


def until_stop(tokens: list[int], stop: set[int]) -> list[int]:
    """tokens up to and including the first stop token (an end of sequence): what a
    generation keeps of tokens committed together."""
    for i, token in enumerate(tokens):
        if token in stop:
            return tokens[:i + 1]
    return tokens


def check_temperature(field: str, t: float) -> None:
    if not math.isfinite(t) or not (t == 0 or t >= MIN_TEMPERATURE):
        raise InvalidArgument(field, f"must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE}, got {t}")


def validate(params: common_pb2.SamplingParams, field: str = "sampling") -> None:
    p = params.top_p
    check_temperature(f"{field}.temperature", params.temperature)
    if math.isnan(p) or not 0.0 < p <= 1.0:
        raise InvalidArgument(f"{field}.top_p", f"must be in (0, 1], got {p}")
    if params.top_k < 0:
        raise InvalidArgument(f"{field}.top_k", f"must be >= 0, got {params.top_k}")


def probs(logits: torch.Tensor, params: common_pb2.SamplingParams) -> torch.Tensor:
    """Next-token probabilities for sampling. logits: [..., vocab] -> probs: [..., vocab].

    Temperature, then top-k, then top-p (the order of transformers' warpers)."""
    logits = logits.float() / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=False)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # Drop the low tail whose mass stays within 1 - top_p; the top token always stays.
        drop = cumulative <= 1.0 - params.top_p
        drop[..., -1] = False
        logits = logits.masked_fill(drop.scatter(-1, order, drop), -math.inf)
    return logits.softmax(dim=-1)


class Draws:
    """Random draws keyed by (seed, absolute position, purpose).

    Keying by position rather than by a running generator makes the output a function
    of the seed alone: a resync or a retried call draws the same numbers again."""

    def __init__(self, seed: int, purpose: str):
        self.seed = seed
        self.purpose = purpose.encode()

    def _generator(self, position: int) -> torch.Generator:
        key = hashlib.blake2b(struct.pack("<QQ", self.seed, position) + self.purpose, digest_size=8).digest()
        return torch.Generator().manual_seed(int.from_bytes(key, "little") >> 1)

    def uniform(self, position: int) -> float:
        return torch.rand((), generator=self._generator(position)).item()

    def sample(self, probs: torch.Tensor, position: int) -> int:
        """One token from probs: [vocab] (a host generator: probs are copied to the host)."""
        return torch.multinomial(probs.float().cpu(), 1, generator=self._generator(position)).item()
