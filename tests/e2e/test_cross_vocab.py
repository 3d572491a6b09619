"""Drafts of a model with another tokenizer, through the three real processes
(orchestrator.bridge): greedy output token-identical to the target alone, sampled output
in the target's distribution; a drafter whose drafts cannot be carried over is refused
at start."""

import subprocess
import sys
from pathlib import Path

import pytest

from cluster import PROMPTS, Cluster, Stream, as_tested, drafter, generate, orchestrator, pb, reference, verifier
from models import (MICRO_WORDS, bpe_tokenizer, merging_tokenizers, reindexed_copy, renumbered, unigram_pair,
                    word_tokenizer)
from tests.e2e.test_sampling import PROMPT, check_distribution, chi_square_p, exact_outcomes, sample_outputs
from specdec.api.common.v1 import common_pb2

ROOT = Path(__file__).resolve().parents[2]
# Prompts of every kind, none of which the draft's tokenizer was trained on whole.
LINES = [line for line in (ROOT / "deploy/bench/prompts.txt").read_text().splitlines()
         if line and not line.startswith(("#", "["))]
GREEDY_PROMPTS = PROMPTS + LINES[:10]
MAX_NEW = 24
# The micro target's words, and a draft's: "a" it lacks, "h" the target lacks, the rest
# in another order.
CROSS_WORDS = ["<eos>", "g", "f", "e", "d", "c", "b", "h"]
# The control's orchestrator: the draft's draws keyed by its own positions, as before
# they were keyed by the target's (a draw that decided a committed token drawn again).
OWN_POSITIONS = """
import runpy
from orchestrator import links
propose = links.DrafterLink._propose
async def own_positions(self, history, k, committed, draw_at):
    return await propose(self, history, k, committed, draw_at=len(history))
links.DrafterLink._propose = own_positions
runpy.run_module("orchestrator", run_name="__main__")
"""


@pytest.fixture(scope="module")
def cross_cluster(tiny_pair, smol_tokenizer, micro_pair, tmp_path_factory):
    root = tmp_path_factory.mktemp("cross")
    corpus = PROMPTS * 20 + LINES[10:]
    draft_tok = bpe_tokenizer(corpus, vocab_size=700)
    reindexed_copy(tiny_pair[2], smol_tokenizer, draft_tok, root / "draft", noise=0.06, seed=11)
    micro_draft_tok = word_tokenizer(CROSS_WORDS)
    reindexed_copy(micro_pair[2], word_tokenizer(MICRO_WORDS), micro_draft_tok, root / "micro-draft", noise=0.5,
                   seed=12)
    reindexed_copy(tiny_pair[2], smol_tokenizer, renumbered(smol_tokenizer), root / "renumbered", noise=0.06,
                   seed=13)
    cluster = Cluster()
    v, d = verifier(tiny_pair[0]), drafter(root / "draft", "cross-drafter")
    renumbered_d = drafter(root / "renumbered", "renumbered-drafter")
    micro_v, micro_d = verifier(micro_pair[0], "micro-verifier"), drafter(root / "micro-draft", "micro-cross-drafter")
    # A pair of BPE tokenizers whose draft's tokens merge across the target's
    # (models.merging_tokenizers): the draft over-proposes "b", which the target seldom
    # takes, and seldom proposes "g", which it often does; its rejected "b" drawn again
    # would skew the next token towards "g" (models.unigram_pair).
    merging = root / "merging"
    cluster.merging_target = as_tested(unigram_pair(*merging_tokenizers(), merging, {"d": 3, "g": 3}, {
        "<eos>": 0, "a": 0, "c": 0, "e": 0, "f": 0, "b": 3.5, "d": 3, "g": 0.5}, seed=14))
    merge_v, merge_d = verifier(merging / "target", "merging-verifier"), drafter(merging / "draft", "merging-drafter")
    cluster.start(v, d, renumbered_d, micro_v, micro_d, merge_v, merge_d)
    o = orchestrator(v, [d], tiny_pair[0])
    renumbered_o = orchestrator(v, [renumbered_d], tiny_pair[0], "orchestrator-renumbered")
    micro_o = orchestrator(micro_v, [micro_d], micro_pair[0], "micro-orchestrator")
    merge_o = orchestrator(merge_v, [merge_d], merging / "target", "merging-orchestrator")
    own_o = orchestrator(merge_v, [merge_d], merging / "target", "own-positions-orchestrator")
    own_o.argv = [sys.executable, "-c", OWN_POSITIONS, *own_o.argv[3:]]
    cluster.start(o, renumbered_o, micro_o, merge_o, own_o)
    cluster.roles = {"trained": o, "renumbered": renumbered_o, "sampled": micro_o, "verifier": v, "drafter": d,
                     "renumbered-drafter": renumbered_d, "merging": merge_o, "own-positions": own_o}
    cluster.draft_dir, cluster.renumbered_dir = root / "draft", root / "renumbered"
    yield cluster
    cluster.close()


def test_the_pair_has_another_vocabulary_with_tokens_in_common(cross_cluster, smol_tokenizer):
    from orchestrator.bridge import Bridge
    from specdec import model_files

    draft = model_files.load_tokenizer(str(cross_cluster.draft_dir))
    assert model_files.vocab_fingerprint(draft) != model_files.vocab_fingerprint(smol_tokenizer)
    shared = Bridge(smol_tokenizer, draft).shared
    assert 200 < len(shared) < len(draft)  # words both learnt; the rest the draft's alone
    assert any(d != t for d, t in shared.items())  # the same string under another id


@pytest.mark.parametrize("k", [2, 5])
@pytest.mark.parametrize("draft", ["trained", "renumbered"])
def test_greedy_matches_the_target_alone_on_16_prompts(cross_cluster, tiny_pair, smol_tokenizer, draft, k):
    """A draft whose tokenizer was trained here (it splits the target's words otherwise,
    and its drafts mostly miss), and one whose tokenizer is the target's with its ids
    renumbered (the same tokens under other ids: its drafts pass where the history's text
    comes back as the target's tokens, so a carry-over that mapped them wrong would show;
    the random target's output is often not how its tokenizer would write its text)."""
    stub = cross_cluster.orchestrator_stub(cross_cluster.roles[draft])
    drafted = accepted = 0
    for prompt in GREEDY_PROMPTS:
        ids = smol_tokenizer(prompt)["input_ids"]
        _, result = generate(stub, token_ids=pb.TokenIds(ids=ids), max_new_tokens=MAX_NEW, num_speculative_tokens=k)
        assert list(result.token_ids) == reference(tiny_pair[2], ids, MAX_NEW), prompt
        drafted += result.stats.draft_tokens
        accepted += result.stats.accepted_tokens
    assert drafted > len(GREEDY_PROMPTS) * MAX_NEW // 4  # the drafts were carried over and verified
    if draft == "renumbered":
        assert 0.1 * drafted < accepted < drafted, (accepted, drafted)


LONG = 160


@pytest.fixture(scope="module")
def long_case(tiny_pair, smol_tokenizer):
    ids = smol_tokenizer(PROMPTS[5])["input_ids"]
    return ids, reference(tiny_pair[2], ids, LONG)


def test_a_lost_drafter_session_resyncs_in_the_drafters_tokens(cross_cluster, long_case):
    ids, want = long_case
    roles = cross_cluster.roles
    stream = Stream(cross_cluster.orchestrator_stub(roles["renumbered"]), request_id="cross-lost",
                    token_ids=pb.TokenIds(ids=ids), max_new_tokens=LONG, num_speculative_tokens=4)
    session = cross_cluster.session_of(roles["renumbered"], "cross-lost")
    assert cross_cluster.close_session(roles["renumbered-drafter"], session)  # as after a restart
    result = stream.finish()
    assert list(result.token_ids) == want
    assert result.stats.resyncs == 1 and result.stats.accepted_tokens > 0


def test_failover_between_drafters_of_another_vocabulary(cross_cluster, tiny_pair, long_case):
    ids, want = long_case
    first, second = (drafter(cross_cluster.renumbered_dir, f"renumbered-{n}") for n in "ab")
    cross_cluster.start(first, second)
    o = orchestrator(cross_cluster.roles["verifier"], [first, second], tiny_pair[0], "orchestrator-cross-two")
    cross_cluster.start(o)
    stream = Stream(cross_cluster.orchestrator_stub(o), token_ids=pb.TokenIds(ids=ids), max_new_tokens=LONG,
                    num_speculative_tokens=4)
    cross_cluster.kill(first)  # on a tie the pool pairs the request with the first listed
    result = stream.finish()
    assert list(result.token_ids) == want
    assert result.stats.drafter_failovers == 1 and result.stats.accepted_tokens > 0


@pytest.mark.parametrize("bias", [{}, {5: 1.5}])
def test_sampling_keeps_the_targets_distribution(cross_cluster, micro_pair, bias):
    """T = 1 over two tokens at K = 2: a draft whose word the target lacks ("h") stops the
    round's drafts, the rest carry q restricted to the shared words; the joint of the two
    tokens follows the target's own distribution (with a logit bias too: the drafter gets
    it on its own id of the word). The same samples reject the target's distribution at
    another temperature (the test's power)."""
    params = common_pb2.SamplingParams(temperature=1.0, top_p=1.0, logit_bias=bias)
    hotter = exact_outcomes(micro_pair[2], common_pb2.SamplingParams(temperature=1.6, top_p=1.0, logit_bias=bias),
                            depth=2)
    check_distribution(cross_cluster.orchestrator_stub(cross_cluster.roles["sampled"]), micro_pair[2], params,
                       depth=2, k=2, wrong=hotter, p_min=0.01)


def test_sampling_keeps_the_targets_distribution_where_drafts_merge(cross_cluster):
    """T = 1 over three tokens at K = 2, the draft's tokens merging across the target's: a
    letter committed after "abc" leaves the draft's history as long as before, so its next
    draw, keyed by the draft's own position, would be the one that drew the last round's
    first draft (rounds of two drafts, then one: a round drafts no more than the budget).
    Keyed by the target's position, the joint of the three tokens follows the target's
    distribution; the control, keyed as before, does not (the test's power)."""
    _, draft = merging_tokenizers()
    prompt = draft.decode(PROMPT)
    assert all(len(draft.encode(prompt + x)) == len(draft.encode(prompt)) for x in MICRO_WORDS[1:])
    params = common_pb2.SamplingParams(temperature=1.0, top_p=1.0)
    model = cross_cluster.merging_target
    results = check_distribution(cross_cluster.orchestrator_stub(cross_cluster.roles["merging"]), model, params,
                                 depth=3, k=2, p_min=0.01)
    assert sum(s.draft_tokens for s in results) > len(results)  # the drafts were carried over
    exact = exact_outcomes(model, params, depth=3)
    counts, _ = sample_outputs(cross_cluster.orchestrator_stub(cross_cluster.roles["own-positions"]), params,
                               depth=3, k=2, exact=exact)
    assert chi_square_p(counts, exact) < 1e-3


def test_a_drafter_whose_tokenizer_is_not_at_hand_is_refused_at_start(cross_cluster, tiny_pair):
    v, d = cross_cluster.roles["verifier"], cross_cluster.roles["drafter"]
    for tokenizer, says in (("/nonexistent/tokenizer", "does not load here"),
                            (str(tiny_pair[0]), "is not its own")):
        o = orchestrator(v, [d], tiny_pair[0], "orchestrator-no-bridge", extra=["--draft-tokenizer", tokenizer])
        done = subprocess.run(o.argv, capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, done.stderr[-2000:]
        assert "vocabulary differs from the target" in done.stderr and says in done.stderr
