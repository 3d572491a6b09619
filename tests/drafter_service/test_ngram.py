"""Prompt lookup on small hand-written token lists."""

import asyncio

from drafter_service.proposers import NgramProposer
from specdec.common.v1 import common_pb2
from specdec.engine import TokenSequence

GREEDY = common_pb2.SamplingParams(top_p=1.0)


def test_continues_the_latest_match_of_the_longest_suffix():
    # The suffix [1, 2] occurs twice before; the latest occurrence (followed by 7) wins.
    assert NgramProposer(max_n=2).lookup([1, 2, 5, 1, 2, 7, 8, 1, 2], k=3) == [7, 8, 1]


def test_prefers_longer_ngrams():
    # The 3-gram [4, 1, 2] matches once (followed by 9); the 2-gram's latest match would give 5.
    assert NgramProposer(max_n=3).lookup([4, 1, 2, 9, 1, 2, 5, 4, 1, 2], k=1) == [9]


def test_no_match_proposes_nothing():
    assert NgramProposer(max_n=3).lookup([1, 2, 3, 4], k=4) == []
    assert NgramProposer().lookup([7], k=4) == []


def test_a_copy_that_reaches_the_end_of_the_sequence_goes_on_from_its_drafts():
    # The only match of [3] is followed by 5, 3 and the sequence ends: the text it copies
    # is its own, so the copy goes on (a loop of period 2), k tokens in all.
    assert NgramProposer(max_n=1).lookup([3, 5, 3], k=4) == [5, 3, 5, 3]


def test_propose_appends_drafts_without_probabilities():
    seq = TokenSequence()
    seq.sync(0, [1, 2, 3, 1, 2])
    async def drafted():
        return [d async for d in NgramProposer(max_n=2).propose(seq, 2, GREEDY)]

    drafts = asyncio.run(drafted())
    assert drafts == [(3, None), (1, None)]
    assert seq.tokens == [1, 2, 3, 1, 2, 3, 1]
