"""The hybrid proposer: prompt lookup where the context holds a long match, the model
draft elsewhere, one source per round, on the tiny draft model."""

import asyncio

import pytest
from transformers import AutoModelForCausalLM

from cluster import as_tested
from drafter_service.proposers import HybridProposer, ModelProposer, NgramProposer
from specdec.common.v1 import common_pb2
from specdec.engine import Engine

GREEDY = common_pb2.SamplingParams(top_p=1.0)
SAMPLED = common_pb2.SamplingParams(temperature=1.0, top_p=1.0, seed=3)


@pytest.fixture(scope="module")
def proposers(tiny_pair, smol_tokenizer):
    def model_proposer():
        model = as_tested(AutoModelForCausalLM.from_pretrained(tiny_pair[1]).eval())
        return ModelProposer(Engine(model, 1 << 22), smol_tokenizer, "tiny-draft")

    alone = model_proposer()
    hybrid = HybridProposer(model_proposer(), NgramProposer(max_n=4, min_n=3))
    yield hybrid, alone
    for p in (hybrid.model, alone):
        p.engine.stop()


def drafts(proposer, tokens, k, params=GREEDY):
    seq = proposer.new_sequence()
    seq.sync(0, tokens)

    async def go():
        return [d async for d in proposer.propose(seq, k, params)]

    out = asyncio.run(go())
    proposer.release(seq)
    return out, seq


def test_a_long_match_drafts_by_lookup_without_the_model(proposers):
    hybrid, _ = proposers
    tokens = [11, 12, 13, 14, 15, 16, 17, 90, 91, 11, 12, 13]  # [11, 12, 13] occurred before, then 14, 15...
    passes = hybrid.model.engine.passes
    for params in (GREEDY, SAMPLED):
        out, seq = drafts(hybrid, tokens, 4, params)
        assert out == [(14, None), (15, None), (16, None), (17, None)]  # one-hot q: nothing on the wire
        assert seq.tokens == tokens + [14, 15, 16, 17]
    assert hybrid.model.engine.passes == passes  # no draft step ran


def test_a_short_match_drafts_with_the_model(proposers):
    hybrid, alone = proposers
    tokens = [11, 12, 40, 41, 42, 43, 11, 12]  # only a 2-token match: below min_n
    assert NgramProposer(max_n=4, min_n=1).lookup(tokens, 4)  # pure lookup would have drafted
    for params in (GREEDY, SAMPLED):
        out, _ = drafts(hybrid, tokens, 4, params)
        want, _ = drafts(alone, tokens, 4, params)
        assert [t for t, _ in out] == [t for t, _ in want] and len(out) == 4
        assert [q for _, q in out] == [q for _, q in want]  # the model's q, sampled or not


def test_the_model_catches_up_after_lookup_rounds(proposers):
    """Tokens a lookup round added enter the model's cache at its next step: the model's
    draft after them equals a draft from scratch."""
    hybrid, alone = proposers
    seq = hybrid.new_sequence()
    seq.sync(0, [11, 12, 13, 14, 15, 90, 11, 12, 13])

    async def go():
        first = [t async for t, _ in hybrid.propose(seq, 2, GREEDY)]  # lookup: 14, 15
        seq.extend([7, 8])  # the verifier's token and a rejection elsewhere: no match any more
        return first, [t async for t, _ in hybrid.propose(seq, 3, GREEDY)]

    first, second = asyncio.run(go())
    assert first == [14, 15]
    want, _ = drafts(alone, [11, 12, 13, 14, 15, 90, 11, 12, 13, 14, 15, 7, 8], 3)
    assert second == [t for t, _ in want]
    hybrid.release(seq)


def test_asked_for_model_drafts_it_drafts_with_the_model_where_a_match_would_draft_by_lookup(proposers):
    """The orchestrator drafts lookup rounds itself; where it chose a model round at a
    match (ProposeRequest.model_drafts), the drafter's model drafts it."""
    hybrid, alone = proposers
    tokens = [11, 12, 13, 14, 15, 16, 17, 90, 91, 11, 12, 13]  # a lookup match: 14, 15, 16, 17
    out, _ = drafts(hybrid.by_model(), tokens, 4)
    want, _ = drafts(alone, tokens, 4)
    assert [t for t, _ in out] == [t for t, _ in want] != [14, 15, 16, 17]
    assert alone.by_model() is alone and NgramProposer().by_model() is None
