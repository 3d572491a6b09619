"""The orchestrator's incremental lookup index gives what the drafter's scan gives, at
every length of a growing history."""

from hypothesis import given, settings, strategies as st

from specdec.lookup import LookupIndex, suffix_match


def test_suffix_match_takes_the_longest_suffix_and_its_latest_occurrence():
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 2, 3]
    assert suffix_match(tokens, 4, 4, 1) == [7, 2, 3]  # [2, 3] last occurred before 7
    assert suffix_match(tokens, 4, 4, 3) == []  # no 3-token suffix occurred before


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 4), max_size=80), k=st.integers(1, 8),
       bounds=st.tuples(st.integers(1, 4), st.integers(0, 3)))
def test_the_index_equals_the_scan_at_every_length(tokens, k, bounds):
    min_n, extra = bounds
    max_n = min_n + extra
    index = LookupIndex(max_n, min_n)
    for end in range(len(tokens) + 1):
        index.update(tokens[:end])
        assert index.match(k) == suffix_match(tokens[:end], k, max_n, min_n)
