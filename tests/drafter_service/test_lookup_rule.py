"""A drafter reports its prompt-lookup rule and drafts with its model alone: the
orchestrator, which owns the history, drafts lookup rounds itself (specdec.lookup)."""

import asyncio

import pytest
from transformers import AutoModelForCausalLM

from cluster import as_tested
from drafter_service.proposers import ModelProposer, NoModel
from drafter_service.server import build_parser, lookup_rule, make_proposer, reported
from specdec.api.common.v1 import common_pb2
from specdec.runtime.engine import Engine
from specdec.lookup import suffix_match

GREEDY = common_pb2.SamplingParams(top_p=1.0)
SAMPLED = common_pb2.SamplingParams(temperature=1.0, top_p=1.0, seed=3)
MATCH = [11, 12, 13, 14, 15, 16, 17, 90, 91, 11, 12, 13]  # [11, 12, 13] occurred before, then 14, 15...


def args(*argv):
    return build_parser().parse_args(list(argv))


def drafts(proposer, tokens, k, params=GREEDY):
    seq = proposer.new_sequence()
    seq.sync(0, tokens)

    async def go():
        return [d async for d in proposer.propose(seq, k, params)]

    out = asyncio.run(go())
    proposer.release(seq)
    return out


@pytest.fixture(scope="module")
def model_proposer(tiny_pair, smol_tokenizer):
    model = as_tested(AutoModelForCausalLM.from_pretrained(tiny_pair[1]).eval())
    proposer = ModelProposer(Engine(model, 1 << 22), smol_tokenizer, "tiny-draft")
    yield proposer
    proposer.engine.stop()


def test_an_ngram_drafter_reports_its_rule_and_drafts_nothing_itself():
    ngram = args("--proposer", "ngram", "--ngram-min", "2", "--ngram-max", "5")
    proposer = make_proposer(ngram)
    assert isinstance(proposer, NoModel)
    info = reported(proposer, ngram)
    assert (info.kind, info.lookup_min_match, info.lookup_max_match) == ("ngram", 2, 5)
    assert suffix_match(MATCH, 4, 5, 2) == [14, 15, 16, 17]  # the orchestrator's lookup drafts here
    assert drafts(proposer, MATCH, 4) == []


def test_a_hybrid_drafter_reports_the_rule_beside_its_model_and_drafts_with_the_model_at_a_match(model_proposer):
    hybrid = args("--proposer", "hybrid", "--lookup-min-match", "3", "--ngram-max", "4")
    info = reported(model_proposer, hybrid)
    own = model_proposer.info()
    assert (info.kind, info.lookup_min_match, info.lookup_max_match) == ("hybrid", 3, 4)
    assert (info.vocab_size, info.vocab_fingerprint, info.numerics) == (own.vocab_size, own.vocab_fingerprint,
                                                                        own.numerics)
    for params in (GREEDY, SAMPLED):
        out = drafts(model_proposer, MATCH, 4, params)
        assert len(out) == 4 and [t for t, _ in out] != [14, 15, 16, 17]  # the model's, not the lookup's
        assert all((q is None) == (params is GREEDY) for _, q in out)
    # --lookup-min-match past --ngram-max: the longest match is raised to it.
    assert reported(model_proposer, args("--lookup-min-match", "6")).lookup_max_match == 6


def test_a_model_drafter_reports_no_rule(model_proposer):
    info = reported(model_proposer, args("--proposer", "model"))
    assert (info.kind, info.lookup_min_match, info.lookup_max_match) == ("model", 0, 0)


@pytest.mark.parametrize("argv", [("--proposer", "ngram", "--ngram-min", "3", "--ngram-max", "2"),
                                  ("--proposer", "ngram", "--ngram-min", "0"),
                                  ("--proposer", "hybrid", "--lookup-min-match", "0")])
def test_a_rule_that_matches_nothing_is_refused_at_start(argv):
    with pytest.raises(SystemExit, match="lookup rule needs 1 <= the shortest match"):
        lookup_rule(args(*argv))
