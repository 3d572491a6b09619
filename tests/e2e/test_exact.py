"""Greedy output through the three real processes is token-identical to the target's
own `generate(do_sample=False)`, on CPU in fp32."""

import pytest

import cluster
from cluster import cases, generate, pb

PROMPTS = cluster.PROMPTS[:4]  # prose, code, a list that repeats, a story
MAX_NEW = 40


@pytest.fixture(scope="module")
def expected(tiny_pair, smol_tokenizer):
    by_prompt = cases(tiny_pair[2], smol_tokenizer, PROMPTS, MAX_NEW)
    # A degenerate target proves nothing: its output must vary.
    for ids, out in by_prompt.values():
        assert len(set(out)) > MAX_NEW // 4, out
    return by_prompt


@pytest.mark.parametrize("kind", ["model", "ngram", "hybrid", "overlap"])
@pytest.mark.parametrize("k", [1, 4, 8])
def test_greedy_matches_target(tiny_cluster, expected, kind, k):
    stub = tiny_cluster.orchestrator_stub(tiny_cluster.roles[kind])
    drafted = accepted = hits = 0
    for prompt, (ids, want) in expected.items():
        chunks, result = generate(stub, token_ids=pb.TokenIds(ids=ids), max_new_tokens=MAX_NEW,
                                  num_speculative_tokens=k)
        assert list(result.token_ids) == want, prompt
        assert [t for c in chunks for t in c.token_ids] == want
        assert result.usage.completion_tokens == len(want)
        s = result.stats
        drafted += s.draft_tokens
        accepted += s.accepted_tokens
        hits += s.lookahead_hits
        # Every round commits its accepted drafts plus one token of the target's.
        assert s.accepted_tokens + s.rounds == len(want)
        assert s.lookaheads == 0 if kind != "overlap" else s.lookaheads > 0
    if kind != "ngram":
        # Both paths ran: some drafts were accepted, some corrected.
        assert 0 < accepted < drafted, (accepted, drafted)
    if kind == "overlap" and k == 1:
        assert hits > 0  # some rounds used drafts made while the last one was verified


def test_text_prompt_matches_target(tiny_cluster, expected, smol_tokenizer):
    stub = tiny_cluster.orchestrator_stub(tiny_cluster.roles["model"])
    prompt = PROMPTS[0]
    chunks, result = generate(stub, text=prompt, max_new_tokens=MAX_NEW, num_speculative_tokens=4)
    want = expected[prompt][1]
    assert list(result.token_ids) == want
    assert "".join(c.text for c in chunks) == result.text == smol_tokenizer.decode(want, skip_special_tokens=True)
    assert result.finish_reason == pb.FINISH_REASON_LENGTH


def test_target_alone_k0(tiny_cluster, expected):
    stub = tiny_cluster.orchestrator_stub(tiny_cluster.roles["model"])
    ids, want = expected[PROMPTS[1]]
    _, result = generate(stub, token_ids=pb.TokenIds(ids=ids), max_new_tokens=MAX_NEW, num_speculative_tokens=0)
    assert list(result.token_ids) == want
    assert result.stats.draft_tokens == 0 and result.stats.rounds == MAX_NEW


def test_unary_complete(tiny_cluster, expected):
    stub = tiny_cluster.orchestrator_stub(tiny_cluster.roles["ngram"])
    ids, want = expected[PROMPTS[2]]
    result = stub.Complete(pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), max_new_tokens=MAX_NEW), timeout=60)
    assert list(result.token_ids) == want


def test_adaptive_k_matches_target(tiny_cluster, expected):
    """No K in the request: the orchestrator picks K per round (it tries several while
    it learns the costs); the output stays the target's."""
    stub = tiny_cluster.orchestrator_stub(tiny_cluster.roles["model"])
    rounds = 0
    for prompt, (ids, want) in expected.items():
        _, result = generate(stub, token_ids=pb.TokenIds(ids=ids), max_new_tokens=MAX_NEW)
        assert list(result.token_ids) == want, prompt
        assert result.stats.accepted_tokens + result.stats.rounds == len(want)
        rounds += result.stats.rounds
    assert rounds > 0


def test_a_greedy_request_drafts_from_an_earlier_requests_output(tiny_cluster, tiny_pair, smol_tokenizer):
    """The orchestrator keeps recent outputs: the same request again drafts its tokens from
    the first one's output (the lookup drafter's rule, longest match first), and its output
    is still the target's."""
    prompt = "Ticket 4417: the printer on the third floor jams on every second page since"
    ((ids, want),) = cases(tiny_pair[2], smol_tokenizer, [prompt], MAX_NEW).values()
    stub = tiny_cluster.orchestrator_stub(tiny_cluster.roles["ngram"])
    runs = [generate(stub, token_ids=pb.TokenIds(ids=ids), max_new_tokens=MAX_NEW, num_speculative_tokens=8)[1]
            for _ in range(2)]
    assert [list(r.token_ids) for r in runs] == [want, want]
    first, again = (r.stats for r in runs)
    assert again.accepted_tokens >= MAX_NEW // 2 and again.accepted_tokens > first.accepted_tokens, (first, again)
