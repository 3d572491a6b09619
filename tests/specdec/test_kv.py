"""Rollback by position: after a sync, the cached logits equal a fresh computation."""

import pytest
import torch

from specdec.errors import NeedsResync
from specdec.kv import CachedSequence, TokenSequence


def fresh_logits(model, tokens, last):
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0, -last:]


def test_sync_keeps_the_matching_prefix():
    seq = TokenSequence()
    assert seq.sync(0, [1, 2, 3, 4]) == 0
    assert seq.sync(2, [3, 9]) == 3  # [3] matched, [4] replaced by [9]
    assert seq.tokens == [1, 2, 3, 9]


def test_sync_beyond_what_is_held_needs_resync():
    seq = TokenSequence()
    seq.sync(0, [1, 2])
    with pytest.raises(NeedsResync):
        seq.sync(3, [4])


def test_cropped_cache_gives_the_same_logits(tiny_pair):
    model = tiny_pair[2]
    seq = CachedSequence(model)
    seq.sync(0, [10, 20, 30, 40])
    seq.logits(1)
    seq.extend([50, 60, 70])          # drafts
    seq.logits(4)
    assert seq.cached == 7
    seq.sync(4, [50, 61])             # one draft accepted, then a correction
    assert seq.cached == 5
    torch.testing.assert_close(seq.logits(1), fresh_logits(model, [10, 20, 30, 40, 50, 61], 1),
                               rtol=1e-4, atol=1e-4)
    seq.sync(0, [10, 20, 99])         # a resync with a different history
    torch.testing.assert_close(seq.logits(2), fresh_logits(model, [10, 20, 99], 2), rtol=1e-4, atol=1e-4)
