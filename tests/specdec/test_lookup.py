"""The orchestrator's incremental lookup index gives what the scan gives, at
every length of a growing history; the memory of earlier outputs drafts where a history
has no match of its own, and forgets its oldest outputs first."""

from hypothesis import given, settings, strategies as st

from specdec.lookup import LookupIndex, OutputMemory, suffix_match


def test_suffix_match_takes_the_longest_suffix_and_its_latest_occurrence():
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 2, 3]
    assert suffix_match(tokens, 3, 4, 1) == [7, 2, 3]  # [2, 3] last occurred before 7
    assert suffix_match(tokens, 4, 4, 3) == []  # no 3-token suffix occurred before
    # The 3-gram [4, 1, 2] occurred once (then 9); the 2-gram's latest occurrence would give 5.
    assert suffix_match([4, 1, 2, 9, 1, 2, 5, 4, 1, 2], 1, 3, 1) == [9]
    assert suffix_match([1, 2, 3, 4], 4, 3, 1) == [] and suffix_match([7], 4, 4, 1) == []


def test_a_copy_that_reaches_the_end_copies_its_own_drafts():
    """A loop drafts as far as asked, not one period of it: after [2, 3], 7 came last, and
    the copy that follows 7, 2, 3 is 7, 2, 3 again."""
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 2, 3]
    assert suffix_match(tokens, 8, 4, 1) == [7, 2, 3, 7, 2, 3, 7, 2]
    loop = [5, 8, 4, 6, 4, 6, 4, 6]  # a greedy loop of period 2
    assert suffix_match(loop, 5, 4, 3) == [4, 6, 4, 6, 4]
    index = LookupIndex(4, 3)
    index.update(loop)
    assert index.match(5) == [4, 6, 4, 6, 4]


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


def test_a_history_without_a_match_drafts_from_an_earlier_output():
    memory = OutputMemory(max_tokens=100, max_n=3, min_n=2)
    memory.add([5, 6, 7, 8, 9, 10])
    index = LookupIndex(3, 2, memory)
    index.update([1, 2, 3, 6, 7])
    assert index.match(3) == [8, 9, 10] and index.from_memory  # [6, 7] was followed by 8, 9, 10 earlier
    index.update([1, 2, 3, 6, 7, 1, 2])
    assert index.match(3) == [3, 6, 7] and not index.from_memory  # its own [1, 2] match; the memory has none
    memory.add([9, 7, 1, 2, 4, 4])
    assert index.match(3) == [4, 4] and index.from_memory  # the memory's [7, 1, 2] is longer
    tie = OutputMemory(max_tokens=100, max_n=3, min_n=2)
    tie.add([1, 2, 5])
    own = LookupIndex(3, 2, tie)
    own.update([1, 2, 3, 6, 7, 1, 2])
    assert own.match(3) == [3, 6, 7]  # the memory's [1, 2] is no longer than its own: its own
    assert LookupIndex(3, 2).match(3) == []


def test_the_oldest_outputs_leave_the_memory_first():
    memory = OutputMemory(max_tokens=10, max_n=2, min_n=1, min_score=0.0)
    memory.add([1, 2, 3, 4])
    memory.add([1, 2, 9, 9])
    assert memory.match([7, 1, 2], 2) == (2, [9, 9])  # a tie: the latest occurrence
    memory.add([5, 6, 7])  # 11 tokens held: the first output leaves
    assert memory.held == 7 and memory.match([3], 1) == (0, [])
    assert memory.match([1, 2], 2) == (2, [9, 9]) and memory.match([6], 1) == (1, [7])
    memory.add([8, 8, 8, 8, 8, 8, 8, 8])  # 15 held: both others leave
    assert memory.held == 8 and memory.match([1, 2], 2) == (0, []) and memory.match([6], 1) == (0, [])
    assert memory.match([8], 3) == (1, [8, 8, 8])


def test_the_memory_drafts_the_continuation_seen_most_often_and_stops_where_the_fills_differ():
    # Three answers from one template: "dear <name> , thanks for the order" with 10, 11, 12 as
    # the names; the last one's continuation differs once ("the" -> 7).
    memory = OutputMemory(max_tokens=100, max_n=2, min_n=1, min_score=0.5)
    memory.add([1, 10, 2, 3, 4, 5, 6])
    memory.add([1, 11, 2, 3, 4, 5, 6])
    memory.add([1, 12, 2, 3, 4, 7, 6])
    assert memory.match([9, 2], 8) == (1, [3, 4, 5, 6])  # after 4: 5 twice, 7 once
    assert memory.match([9, 1], 8) == (0, [])  # three names seen once each: no draft scores 0.5
    memory.min_score = 0.3
    assert memory.match([9, 1], 8) == (1, [12, 2, 3, 4])  # a tie: the latest name; then 5 (1/3 * 2/3) is too unsure
    memory.min_score = 0.5
    memory.add([1, 12, 2, 3, 4, 7, 6])
    memory.add([1, 12, 2, 3, 4, 7, 6])
    assert memory.match([9, 2], 8) == (1, [3, 4, 7, 6])  # now 7 three times against 5 twice


def test_a_long_context_follows_the_answer_that_short_ones_stray_from():
    # One answer says [1, 2] twice, followed by 3 and then by 4: on 2-grams alone a walk
    # after [1, 2] takes the latest (4), whichever place in the answer it is at.
    answer = [10, 11, 12, 13, 1, 2, 3, 20, 21, 22, 23, 1, 2, 4, 30]
    memory = OutputMemory(max_tokens=100, max_n=2, min_n=1, min_score=0.3, long_n=4)
    memory.add(answer)
    assert memory.match([7, 7, 1, 2], 3) == (2, [4, 30])  # no long context held: the 2-grams' latest
    assert memory.match([10, 11, 12, 13, 1, 2], 5) == (4, [3, 20, 21, 22, 23])  # the answer, sent again
    assert memory.match([20, 21, 22, 23, 1, 2], 3) == (4, [4, 30])
    index = LookupIndex(2, 1, memory)
    index.update([5, 6, 1, 2, 9, 10, 11, 12, 13, 1, 2])  # its own [1, 2] match says 9: the memory's longer context wins
    assert index.match(3) == [3, 20, 21] and index.from_memory


@settings(max_examples=100, deadline=None)
@given(outputs=st.lists(st.lists(st.integers(0, 3), max_size=12), max_size=12), max_tokens=st.integers(2, 40))
def test_the_counts_are_those_of_the_outputs_held(outputs, max_tokens):
    memory = OutputMemory(max_tokens=max_tokens, max_n=3, min_n=1, long_n=5)
    for tokens in outputs:
        memory.add(tokens)
        counts, long = {}, {}
        for held in memory.outputs.values():
            for end in range(1, len(held)):
                for n in [*range(1, min(3, end) + 1)] + ([5] if end >= 5 else []):
                    table = long if n == 5 else counts
                    key = tuple(held[end - n:end])
                    table.setdefault(key, {})
                    table[key][held[end]] = table[key].get(held[end], 0) + 1
        assert memory.next == counts and memory.long_next == long
        assert memory.held == sum(map(len, memory.outputs.values())) <= max_tokens
