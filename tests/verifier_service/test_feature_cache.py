"""The verifier's cache of prompt blocks' features, alone: what a lookup serves, from
where, and what it never serves (another prompt's block under a colliding key; blocks
past the budget)."""

import numpy as np

from specdec.api.common.v1 import common_pb2
from specdec.runtime.engine.block_manager import prefix_digests
from verifier_service.feature_cache import FeatureCache, Pending, join

BS, WIDTH, LAYERS = 4, 3, (2, 5)


def rows(start: int, end: int) -> common_pb2.Features:
    """Features whose every value is its position (exact in float16 up to 2048)."""
    values = np.repeat(np.arange(start, end, dtype="<f2"), WIDTH)
    return common_pb2.Features(start=start, rows=end - start, width=WIDTH, data=values.tobytes())


def positions(data: bytes) -> list[int]:
    return np.frombuffer(data, dtype="<f2").reshape(-1, WIDTH)[:, 0].astype(int).tolist()


def test_a_lookup_serves_the_whole_blocks_stored_from_any_position_in_them():
    cache, tokens = FeatureCache(1 << 20, BS), list(range(100, 120))
    cache.store(LAYERS, tokens, rows(2, 15))  # blocks [4, 8) and [8, 12) are whole
    assert cache.lookup(LAYERS, tokens, 0, 19) == (0, b"")  # the block of position 0 is not held
    stop, data = cache.lookup(LAYERS, tokens, 5, 19)
    assert stop == 12 and positions(data) == list(range(5, 12))
    stop, part = cache.lookup(LAYERS, tokens, 5, 11)  # [8, 12) does not end before 11
    assert stop == 8 and positions(part) == [5, 6, 7]
    assert cache.lookup(LAYERS, tokens, 5, 8) == (5, b"")  # fewer positions than a block: no digests taken
    assert cache.lookup((2, 6), tokens, 5, 19) == (5, b"")  # other layers
    joined = join(5, data, rows(12, 14))
    assert (joined.start, joined.rows) == (5, 9) and positions(joined.data) == list(range(5, 14))


def test_a_block_is_served_only_after_the_same_tokens():
    cache, tokens = FeatureCache(1 << 20, BS), list(range(100, 120))
    cache.store(LAYERS, tokens, rows(0, 12))
    other = tokens[:5] + [7] + tokens[6:]  # differs in block 1: blocks 1 and 2 have other digests
    assert cache.lookup(LAYERS, other, 0, 19)[0] == 4
    # A block registered under another prompt's digest (a forged collision) serves nothing.
    forged = prefix_digests(other, BS)[1]
    cache.blocks[(LAYERS, forged)] = cache.blocks[(LAYERS, prefix_digests(tokens, BS)[1])]
    assert cache.lookup(LAYERS, other, 0, 19)[0] == 4


def test_the_least_recently_used_blocks_go_past_the_budget():
    block_bytes = BS * WIDTH * 2
    cache, a, b = FeatureCache(3 * block_bytes, BS), list(range(100, 108)), list(range(200, 208))
    cache.store(LAYERS, a, rows(0, 8))
    assert cache.lookup(LAYERS, a, 0, 7)[0] == 4  # a's first block is used: a's second is older
    cache.store(LAYERS, b, rows(0, 8))
    assert cache.bytes == 3 * block_bytes
    assert cache.lookup(LAYERS, a + [0], 0, 8)[0] == 4  # a's second block went
    assert cache.lookup(LAYERS, b + [0], 0, 8)[0] == 8
    assert FeatureCache(0, BS).lookup(LAYERS, b, 0, 8) == (0, b"")  # a budget of 0: off


def test_rows_that_come_a_few_a_call_join_the_cache_a_whole_block_at_a_time():
    cache, pending, tokens = FeatureCache(1 << 20, BS), Pending(), list(range(100, 130))
    for start, end in [(2, 3), (3, 6), (6, 7), (7, 11)]:  # a prompt's end, then a round or a step at a time
        pending.crop(start, BS)
        cache.store(LAYERS, tokens, rows(start, end), pending)
    assert cache.lookup(LAYERS, tokens, 4, 29)[0] == 8  # [4, 8) whole; [0, 4) never came whole
    assert (pending.rows.start, positions(pending.rows.data)) == (8, [8, 9, 10])
    # A call from position 9 (a resync: the tokens after it may differ) keeps only 8.
    pending.crop(9, BS)
    tokens[9:] = range(900, 921)
    cache.store(LAYERS, tokens, rows(9, 13), pending)
    stop, data = cache.lookup(LAYERS, tokens, 4, 29)
    assert stop == 12 and positions(data) == list(range(4, 12))
    assert cache.lookup(LAYERS, list(range(100, 130)), 8, 29) == (8, b"")  # the old tokens' block never came
