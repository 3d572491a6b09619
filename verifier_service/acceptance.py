"""Which draft tokens the target keeps, and the target's own next token.

Names follow Leviathan et al. 2023 (Algorithm 1): p is the target distribution and q
the draft distribution, both after the same sampling processing; x_i are the draft
tokens. The target keeps the longest accepted prefix and adds one token: the
*correction* at the first rejected position, or the *bonus* when all were accepted.
"""

import torch

from specdec import grammar, sampling, sampling_params
from specdec.api.common.v1 import common_pb2
from specdec.sampling import Draws


def judge(logits: torch.Tensor, drafts: list[int], draft_probs: list[common_pb2.SparseDistribution],
          params: common_pb2.SamplingParams, start: int, guide: grammar.Guide | None = None,
          logprobs: bool = False) -> tuple[int, int, torch.Tensor]:
    """The acceptance rule over a pass's logits after the committed tokens and each draft
    [K+1, vocab] (drafts from absolute position `start`), masked by the constraint where
    there is one (`guide`, where the committed tokens are): (accepted, the target's token,
    the logits masked, as log-probabilities read them where they are asked for)."""
    if guide is not None and sampling_params.is_greedy(params) and not logprobs:
        return *accept_greedy(guide.greedy(logits, drafts), drafts), logits
    if guide is not None:
        logits = grammar.apply(logits, guide.masks(drafts))
    if sampling_params.is_greedy(params):
        return *accept_greedy(sampling.argmax(logits), drafts), logits
    # The rule runs on the host, from one copy of p per round (K+1 rows): its draws come
    # from host generators keyed by position, whatever the model's device.
    p = sampling.probs(logits, params).cpu()
    q = dense_q(draft_probs, drafts, p.shape[-1])
    return *accept_sampled(p, q, drafts, start, Draws(params.seed, "accept"), Draws(params.seed, "target")), logits


def accept_greedy(target_argmax: list[int], drafts: list[int]) -> tuple[int, int]:
    """target_argmax: [K+1] the target's choice after each prefix. Longest match wins."""
    a = 0
    while a < len(drafts) and drafts[a] == target_argmax[a]:
        a += 1
    return a, target_argmax[a]


def dense_q(draft_probs: list[common_pb2.SparseDistribution], drafts: list[int], vocab: int) -> torch.Tensor:
    """q: [K, vocab]. No distributions on the wire means deterministic drafting: one-hot."""
    q = torch.zeros(len(drafts), vocab)
    if not draft_probs:
        q[torch.arange(len(drafts)), torch.tensor(drafts, dtype=torch.long)] = 1.0
        return q
    for i, dist in enumerate(draft_probs):
        q[i, torch.tensor(list(dist.token_ids), dtype=torch.long)] = torch.tensor(list(dist.probs))
    return q / q.sum(dim=-1, keepdim=True)


def accept_sampled(
    p: torch.Tensor,  # [K+1, vocab] target probs after each prefix
    q: torch.Tensor,  # [K, vocab] draft probs the drafts were sampled from
    drafts: list[int],  # [K]
    start: int,  # absolute position of drafts[0]
    accept: Draws,
    target: Draws,
) -> tuple[int, int]:
    for i, x in enumerate(drafts):
        # Accept x with probability min(1, p(x) / q(x)); q(x) <= p(x) always accepts.
        if accept.uniform(start + i) * q[i, x] < p[i, x]:
            continue
        # Rejected: the correction comes from norm(max(0, p - q)).
        residual = (p[i] - q[i]).clamp(min=0)
        return i, target.sample(residual / residual.sum(), start + i)
    # All accepted: the bonus comes from p after the last draft.
    return len(drafts), target.sample(p[-1], start + len(drafts))
