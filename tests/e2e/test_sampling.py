"""Sampling through the three real processes: the committed tokens follow the target's
own distribution (chi-square over the joint of the first two tokens, on an 8-token
vocabulary), and a seed reproduces an output."""

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from scipy import stats

from cluster import Cluster, drafter, generate, orchestrator, pb, verifier
from specdec import sampling
from specdec.common.v1 import common_pb2

PROMPT = [1, 2, 3]
EOS = 0  # the micro tokenizer's end-of-sequence token
SAMPLES = 1200


@pytest.fixture(scope="module")
def micro_cluster(micro_pair):
    target_dir, draft_dir, _ = micro_pair
    cluster = Cluster()
    v, d = verifier(target_dir), drafter(draft_dir)
    cluster.start(v, d)
    o = orchestrator(v, [d], target_dir)
    cluster.start(o)
    yield cluster, o
    cluster.close()


def exact_outcomes(model, params: common_pb2.SamplingParams) -> dict[tuple, float]:
    """P(output) under the target alone, for outputs of at most two tokens: (t1, t2),
    or (EOS,) when the first token ends generation."""
    with torch.no_grad():
        p1 = sampling.probs(model(torch.tensor([PROMPT])).logits[0, -1], params).double()
        vocab = p1.shape[0]
        rows = torch.tensor([PROMPT + [t] for t in range(vocab)])
        p2 = sampling.probs(model(rows).logits[:, -1], params).double()
    outcomes = {(EOS,): p1[EOS].item()}
    for t1 in range(vocab):
        if t1 != EOS:
            outcomes.update({(t1, t2): (p1[t1] * p2[t1, t2]).item() for t2 in range(vocab)})
    return outcomes


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.8, 5, 0.9)])
def test_distribution_matches_target(micro_cluster, micro_pair, temperature, top_k, top_p):
    cluster, o = micro_cluster
    stub = cluster.orchestrator_stub(o)
    params = common_pb2.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    exact = exact_outcomes(micro_pair[2], params)

    def one(seed):
        _, result = generate(stub, token_ids=pb.TokenIds(ids=PROMPT), max_new_tokens=2, num_speculative_tokens=2,
                             temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        return list(result.token_ids), result.stats

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(SAMPLES)))
    counts = dict.fromkeys(exact, 0)
    for tokens, _ in results:
        counts[tuple(tokens)] += 1
    drafted = sum(s.draft_tokens for _, s in results)
    accepted = sum(s.accepted_tokens for _, s in results)
    # Rejections must be common, or the residual distribution would go untested.
    assert 0.1 < accepted / drafted < 0.9, accepted / drafted

    # Pool the cells too rare for the chi-square approximation.
    expected = np.array(list(exact.values())) * SAMPLES
    observed = np.array([counts[o] for o in exact])
    # Outputs the processing rules out (top-k / top-p) must never occur.
    assert observed[expected == 0].sum() == 0
    rare = (expected < 5) & (expected > 0)
    keep = expected >= 5
    if rare.any():
        observed = np.append(observed[keep], observed[rare].sum())
        expected = np.append(expected[keep], expected[rare].sum())
    else:
        observed, expected = observed[keep], expected[keep]
    expected *= observed.sum() / expected.sum()  # float rounding only
    assert stats.chisquare(observed, expected).pvalue > 1e-3


def test_seed_reproduces_output(micro_cluster):
    cluster, o = micro_cluster
    stub = cluster.orchestrator_stub(o)

    def run(seed, k):
        return list(generate(stub, token_ids=pb.TokenIds(ids=PROMPT), max_new_tokens=30, temperature=1.0,
                             seed=seed, num_speculative_tokens=k)[1].token_ids)

    first = run(7, 3)
    assert run(7, 3) == first
    assert any(run(seed, 3) != first for seed in (8, 9, 10))
