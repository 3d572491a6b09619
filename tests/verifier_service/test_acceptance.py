"""The acceptance rule: greedy longest-prefix, and Leviathan et al.'s rejection rule,
checked statistically, with a control showing the test catches a wrong residual."""

import numpy as np
import pytest
import torch
from scipy import stats

from specdec import sampling
from specdec.sampling import Draws
from verifier_service.acceptance import accept_greedy, accept_sampled, dense_q
from specdec.api.common.v1 import common_pb2


def test_greedy_all_accepted_gives_the_bonus():
    assert accept_greedy([5, 6, 7, 8], [5, 6, 7]) == (3, 8)


def test_greedy_first_mismatch_gives_the_correction():
    assert accept_greedy([5, 9, 7, 8], [5, 6, 7]) == (1, 9)


def test_greedy_no_drafts_is_one_target_step():
    assert accept_greedy([4], []) == (0, 4)


def test_dense_q_one_hot_without_distributions():
    q = dense_q([], [2, 0], vocab=3)
    assert q.tolist() == [[0, 0, 1], [1, 0, 0]]


def test_dense_q_from_sparse():
    q = dense_q([common_pb2.SparseDistribution(token_ids=[2, 1], probs=[0.75, 0.25])], [2], vocab=4)
    assert q.tolist() == [[0, 0.25, 0.75, 0]]


P = torch.tensor([[0.40, 0.30, 0.15, 0.10, 0.05],   # target after the prefix
                  [0.10, 0.20, 0.30, 0.20, 0.20]])  # target after the draft (bonus)
Q = torch.tensor([[0.05, 0.10, 0.15, 0.30, 0.40]])  # a draft that disagrees a lot


ONE_HOT = torch.tensor([[0.0, 0.0, 0.0, 1.0, 0.0]])  # a deterministic proposer (greedy, n-gram)


def first_tokens(n: int, accept_fn, q=Q) -> np.ndarray:
    """The first committed token of n rounds with K = 1 and independent seeds."""
    counts = np.zeros(P.shape[1])
    for seed in range(n):
        x = Draws(seed, "draft").sample(q[0], 0)
        a, t = accept_fn(P, q, [x], 0, Draws(seed, "accept"), Draws(seed, "target"))
        counts[x if a == 1 else t] += 1
    return counts


def wrong_residual(p, q, drafts, start, accept, target):
    """A classic bug: on rejection, resample from p instead of norm(max(0, p - q))."""
    x = drafts[0]
    if accept.uniform(start) * q[0, x] < p[0, x]:
        return 1, target.sample(p[1], start + 1)
    return 0, target.sample(p[0], start)


def chi2_pvalue(counts: np.ndarray, probs: torch.Tensor) -> float:
    expected = probs.double().numpy()
    return stats.chisquare(counts, expected / expected.sum() * counts.sum()).pvalue


def test_rejection_rule_keeps_the_target_distribution():
    n = 6000
    assert chi2_pvalue(first_tokens(n, accept_sampled), P[0]) > 1e-3
    # The same test, the same samples' size, rejects the wrong residual decisively.
    assert chi2_pvalue(first_tokens(n, wrong_residual), P[0]) < 1e-6


def test_one_hot_proposals_keep_the_target_distribution():
    # A proposer without probabilities: q is one-hot, x is accepted with probability p(x).
    assert chi2_pvalue(first_tokens(4000, accept_sampled, ONE_HOT), P[0]) > 1e-3


def test_all_accepted_bonus_comes_from_p():
    # q == p: every draft is accepted; the bonus is sampled from the last row of p.
    counts = np.zeros(P.shape[1])
    for seed in range(3000):
        x = Draws(seed, "draft").sample(P[0], 0)
        a, t = accept_sampled(P, P[:1], [x], 0, Draws(seed, "accept"), Draws(seed, "target"))
        assert a == 1
        counts[t] += 1
    assert chi2_pvalue(counts, P[1]) > 1e-3


def test_draws_are_keyed_by_seed_and_position():
    assert Draws(1, "x").uniform(5) == Draws(1, "x").uniform(5)
    assert len({Draws(1, "x").uniform(i) for i in range(5)}) == 5
    assert Draws(1, "x").uniform(5) != Draws(1, "y").uniform(5)
    assert Draws(1, "x").uniform(5) != Draws(2, "x").uniform(5)


def test_a_matcher_that_failed_with_no_new_token_is_invalid_argument_not_an_index_error(smol_tokenizer):
    """The matcher in its error state and nothing new to consume: `constrained` read the
    committed tokens one past their end (INTERNAL) where INVALID_ARGUMENT belongs."""
    import json

    from specdec import grammar
    from specdec.api.common.v1 import common_pb2
    from specdec.errors import InvalidArgument
    from verifier_service.passes import constrained

    vocab = grammar.Vocabulary(smol_tokenizer, len(smol_tokenizer), [2])
    guide = vocab.guide(common_pb2.Constraint(json_schema=json.dumps({"type": "integer"})), 1)
    committed = [5] + smol_tokenizer.encode("12", add_special_tokens=False)
    assert guide.sync(committed)
    guide.matcher.consume_token(smol_tokenizer.encode("x", add_special_tokens=False)[0])  # its error state
    assert guide.matcher.is_error()
    with pytest.raises(InvalidArgument, match="^constraint: "):
        constrained(guide, committed, len(committed))
