"""Token distributions after sampling processing, and reproducible random draws.

Drafter and verifier both call `penalize` and `probs`, so the draft distribution q and
the target distribution p get the same bias, penalties and temperature / top-k / top-p
processing.
"""

import hashlib
import math
import struct

import numpy
import torch

from specdec.api.common.v1 import common_pb2
from specdec.sampling_params import penalized


def argmax(logits: torch.Tensor) -> list[int]:
    """Each row's greedy token, the first of equal logits ([..., vocab] -> one per row).
    On a CPU through numpy: torch's argmax took 67 us a row of the default target's
    49,152 logits on this project's 2-core VM, numpy's 3 us, and the verifier takes one a
    row of every pass (at 8 streams, 7% of its engine thread's time, profiled)."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64, torch.float16):
        return logits.detach().numpy().argmax(axis=-1).reshape(-1).tolist()
    return logits.argmax(dim=-1).reshape(-1).tolist()


def penalize(logits: torch.Tensor, params: common_pb2.SamplingParams, tokens: list[int],
             drafts_from: int | None = None, columns: torch.Tensor | None = None) -> torch.Tensor:
    """The logits after the request's bias and penalties (SamplingParams says which and
    in what order). `tokens`: the history (prompt and output so far), then the pass's
    drafts from `drafts_from` on (None: no drafts); logits: [drafts + 1, width], after the
    history and after each draft in turn: row i counts the history and the first i drafts,
    as the target alone would count them at that position. `columns`: the token id of each
    logit where they are not the whole vocabulary in order (a draft's cut head)."""
    if not penalized(params):
        return logits  # before any copy of the tokens: this is every pass's path
    if drafts_from is None:
        history, drafts = tokens, []
    else:
        history, drafts = tokens[:drafts_from], tokens[drafts_from:]
    repetition = params.repetition_penalty not in (0.0, 1.0)
    frequency = params.frequency_penalty != 0 or params.presence_penalty != 0
    # Changed only at the tokens of the history, the drafts and the bias (a few hundred
    # columns, not the vocabulary), element by element: a row gets the same bits in a
    # pass of any number of rows.
    counted = history if repetition else history[params.output_start:]
    output_from = params.output_start if repetition else 0  # where the output starts in `counted`
    n, k, bias = len(counted), len(drafts), list(params.logit_bias.items())
    ids, where = numpy.unique(numpy.array(counted + list(drafts) + [t for t, _ in bias], dtype=numpy.int64),
                              return_inverse=True)
    ids, where = torch.from_numpy(ids), torch.from_numpy(where.reshape(-1))
    before = torch.zeros(k + 1, len(ids))  # the drafts before each row: row i holds drafts[:i]
    if k:
        rows, cols = zip(*((row, j) for i, j in enumerate(where[n:n + k].tolist()) for row in range(i + 1, k + 1)))
        before.index_put_((torch.tensor(rows), torch.tensor(cols)), torch.ones(len(rows)), accumulate=True)
    at = ids if columns is None else _columns_of(ids, columns)
    keep = at >= 0  # tokens a cut head has
    at = at.clamp(min=0).to(logits.device)
    values = logits[:, at].float()
    if bias:
        add = torch.zeros(len(ids))
        add[where[n + k:]] = torch.tensor([v for _, v in bias])
        values = values + add.to(logits.device)
    if repetition:
        # A device tensor, not a Python number: CUDA divides by a host scalar as a product
        # with its reciprocal, which rounds otherwise than the host's division.
        r = torch.tensor(params.repetition_penalty, dtype=values.dtype, device=values.device)
        seen = (torch.bincount(where[:n], minlength=len(ids))[None] + before > 0).to(logits.device)
        values = torch.where(seen, torch.where(values > 0, values / r, values * r), values)
    if frequency:
        counts = (torch.bincount(where[output_from:n], minlength=len(ids))[None] + before).to(logits.device)
        values = values - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).float()
    logits = logits.float().clone()
    keep = keep.to(logits.device)
    logits[:, at[keep]] = values[:, keep]
    return logits


def _columns_of(ids: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """The column of each token id among `columns` (-1 where it has none)."""
    if not len(ids):
        return ids
    where = torch.full((1 + max(int(columns.max()), int(ids.max())),), -1, dtype=torch.long)
    where[columns.cpu()] = torch.arange(len(columns))
    return where[ids]


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
