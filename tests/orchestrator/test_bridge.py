"""Carrying drafts of another tokenizer over to the target's (orchestrator.bridge), on
SmolLM2's tokenizer and tokenizers trained here."""

import pytest

from models import bpe_tokenizer, word_tokenizer
from orchestrator.bridge import CHUNK, Aligned, Bridge, token_bytes
from specdec.api.common.v1 import common_pb2

TEXT = ("The quick brown fox jumps over the lazy dog. Once upon a time, in a land far away, there lived "
        "a small band of rebels who fought an empire whose ships filled the sky.\n")


@pytest.fixture(scope="module")
def draft_tokenizer():
    return bpe_tokenizer([TEXT] * 50, vocab_size=400)


@pytest.fixture(scope="module")
def bridge(smol_tokenizer, draft_tokenizer):
    return Bridge(smol_tokenizer, draft_tokenizer)


def test_tokens_are_compared_as_the_bytes_they_stand_for(smol_tokenizer):
    smol = token_bytes(smol_tokenizer)
    assert smol[smol_tokenizer.convert_tokens_to_ids("Ġthe")] == b" the"
    assert smol_tokenizer.eos_token_id not in smol  # special tokens carry no text
    words = token_bytes(word_tokenizer(["<eos>", "?", "a", "b"]))  # "?" the unknown word's token: special
    assert words == {2: b"a", 3: b"b"}
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    piece = Tokenizer(models.WordLevel({"<unk>": 0, "▁the": 1, "<0x0A>": 2, "fox": 3}, unk_token="<unk>"))
    piece.pre_tokenizer, piece.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    sentencepiece = PreTrainedTokenizerFast(tokenizer_object=piece, unk_token="<unk>")
    assert token_bytes(sentencepiece) == {1: b" the", 2: b"\n", 3: b"fox"}


def test_the_shared_tokens_are_those_of_the_same_text(bridge, smol_tokenizer, draft_tokenizer):
    smol, draft = token_bytes(smol_tokenizer), token_bytes(draft_tokenizer)
    assert bridge.shared and all(draft[d] == smol[t] for d, t in bridge.shared.items())
    assert len(bridge.shared) == len(set(draft.values()) & set(smol.values()))


def test_sampled_drafts_carry_q_restricted_to_the_shared_tokens(bridge, draft_tokenizer):
    shared = sorted(bridge.shared)
    alone = next(i for i in range(len(draft_tokenizer)) if i not in bridge.shared
                 and i != draft_tokenizer.eos_token_id)
    a, b, c = shared[5], shared[6], shared[7]
    q = common_pb2.SparseDistribution(token_ids=[a, b, alone], probs=[0.5, 0.25, 0.25])
    drafts, qs = bridge.to_target([], [], [a, b, alone, c], [q, q, q, q], k=4)
    # The third draft has no token of the target's: the drafts stop before it.
    assert drafts == [bridge.shared[a], bridge.shared[b]]
    for carried in qs:
        assert list(carried.token_ids) == [bridge.shared[a], bridge.shared[b]]
        assert list(carried.probs) == pytest.approx([2 / 3, 1 / 3])
    assert bridge.to_target([], [], [a, draft_tokenizer.eos_token_id, b], [q] * 3, k=4)[0] == [bridge.shared[a]]
    assert bridge.to_target([], [], [a, b], [q, q], k=1)[0] == [bridge.shared[a]]  # never past k


def test_greedy_drafts_are_their_text_in_the_targets_tokens(bridge, smol_tokenizer, draft_tokenizer):
    context = smol_tokenizer("The quick brown")["input_ids"]
    draft_context = draft_tokenizer("The quick brown")["input_ids"]
    drafts = draft_tokenizer(" fox jumps over", add_special_tokens=False)["input_ids"]
    want = smol_tokenizer(" fox jumps over", add_special_tokens=False)["input_ids"]
    carried, qs = bridge.to_target(context, draft_context, drafts, [], k=len(want))
    assert carried == want and qs == []
    assert bridge.to_target(context, draft_context, drafts, [], k=1)[0] == want[:1]


def test_the_history_in_the_drafts_tokens_is_its_text_and_its_start_never_changes(bridge, smol_tokenizer,
                                                                                   draft_tokenizer):
    history = smol_tokenizer(TEXT * 8)["input_ids"]
    assert len(history) > 4 * CHUNK
    aligned, before = Aligned(bridge), []
    for end in range(1, len(history) + 1, 7):
        drafted = aligned.draft_history(history[:end])
        assert draft_tokenizer.decode(drafted) == smol_tokenizer.decode(history[:end])
        assert drafted[:len(aligned.stable_ids)] == aligned.stable_ids
        assert aligned.stable_ids[:len(before)] == before  # only ever extended
        before = aligned.stable_ids
    assert aligned.stable > CHUNK  # the start was fixed in chunks
    aligned.sent = drafted
    assert aligned.kept(drafted + [1]) == len(drafted) and aligned.kept(drafted[:3] + [-1]) == 3


def stripping_tokenizer():
    """A SentencePiece-style tokenizer trained here whose decoder strips the text's
    leading space (Llama 2's, Mistral's): a run of its tokens decoded alone loses the
    space its first token starts with."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.train_from_iterator([TEXT] * 50, trainers.BpeTrainer(vocab_size=80, special_tokens=["<unk>"],
                                                             initial_alphabet=["▁"] + list(set(TEXT))))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


@pytest.mark.parametrize("target, text", [("stripping", TEXT * 8), ("smol", "敏捷的棕色狐狸跳过了懒狗。" * 40)])
def test_the_history_in_the_drafts_tokens_is_its_text_wherever_its_chunks_are_cut(
        smol_tokenizer, draft_tokenizer, target, text):
    """The history's chunks tokenized for the draft are its text as it reads there: not
    without the space a stripping decoder takes off a chunk's start, and not cut inside a
    character where the text has no spaces (CJK: a cut inside a character kept U+FFFD in
    the stable tokens for good)."""
    target_tokenizer = stripping_tokenizer() if target == "stripping" else smol_tokenizer
    aligned = Aligned(Bridge(target_tokenizer, draft_tokenizer))
    history = target_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(history) > 4 * CHUNK
    for end in range(1, len(history) + 1, 5):
        drafted = aligned.draft_history(history[:end])
        want = target_tokenizer.decode(history[:end])
        assert draft_tokenizer.decode(drafted) == want.rstrip("\ufffd") or "\ufffd" in want[-1:]
    assert aligned.stable > CHUNK
    assert draft_tokenizer.decode(aligned.draft_history(history)) == target_tokenizer.decode(history)
    assert "\ufffd" not in draft_tokenizer.decode(aligned.stable_ids)


def test_a_logit_bias_reaches_the_draft_on_its_tokens_of_the_same_text(bridge, smol_tokenizer):
    the, fox = smol_tokenizer.convert_tokens_to_ids("Ġthe"), smol_tokenizer.convert_tokens_to_ids("Ġfox")
    lost = next(t for t in range(len(smol_tokenizer)) if t not in bridge.drafts_of)
    bias = bridge.draft_bias({the: 2.0, fox: -1.0, lost: 5.0})
    assert bias == {**{d: 2.0 for d in bridge.drafts_of[the]}, **{d: -1.0 for d in bridge.drafts_of[fox]}}
    assert all(bridge.shared[d] in (the, fox) for d in bias)


def sentencepiece(pieces: list[str], special: tuple[str, ...] = ()):
    """A SentencePiece-style tokenizer with byte fallback (Llama 2's, Gemma's): its pieces
    in order, "<0xNN>" the bytes, "▁" a space; `special` added as special tokens."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE({p: i for i, p in enumerate(pieces)}, [], unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", additional_special_tokens=list(special))


def test_pieces_of_the_same_bytes_carry_over_as_one_target_token_with_their_mass(smol_tokenizer):
    """A byte-fallback draft holds "A" twice (<0x41> and A): q names the target's "A" once,
    with both pieces' mass (twice, the verifier refused the call)."""
    draft = sentencepiece(["<unk>", "<0x41>", "A", "▁the"])
    bridge = Bridge(smol_tokenizer, draft)
    a, the = smol_tokenizer.convert_tokens_to_ids("A"), smol_tokenizer.convert_tokens_to_ids("Ġthe")
    assert bridge.shared == {1: a, 2: a, 3: the}
    q = common_pb2.SparseDistribution(token_ids=[1, 3, 2], probs=[0.25, 0.5, 0.25])
    drafts, qs = bridge.to_target([], [], [1, 3], [q, q], k=2)
    assert drafts == [a, the]
    for carried in qs:
        assert dict(zip(carried.token_ids, carried.probs)) == pytest.approx({a: 0.5, the: 0.5})
    assert bridge.draft_bias({a: 1.0}) == {1: 1.0, 2: 1.0}  # whichever piece the draft would pick


def test_a_target_with_byte_fallback_gets_the_piece_its_tokenizer_writes(draft_tokenizer):
    """Of a target's "A" and <0x41>, a draft's "A" is the target's A: the one the target
    picks (its <0x41> is for bytes no piece holds), so sampled single letters can pass."""
    target = sentencepiece(["<unk>", "<0x41>", "<0x42>", "A"])
    bridge = Bridge(target, draft_tokenizer)
    a = draft_tokenizer.convert_tokens_to_ids("A")
    assert bridge.shared[a] == 3 == target.convert_tokens_to_ids("A")
    b = draft_tokenizer.convert_tokens_to_ids("B")
    assert bridge.shared[b] == 2  # no piece but the byte's


def test_a_drafted_special_token_ends_the_drafts_unless_the_target_holds_it(smol_tokenizer):
    """An end of turn the target lacks (Gemma's <end_of_turn> drafted for SmolLM2) is no
    text: greedy and sampled drafts stop before it. One the target holds as a special
    token too (<|im_end|>) carries over as the target's."""
    draft = sentencepiece(["<unk>", "▁the", "▁fox"], special=("<end_of_turn>", "<|im_end|>"))
    bridge = Bridge(smol_tokenizer, draft)
    end_of_turn, im_end = draft.convert_tokens_to_ids("<end_of_turn>"), draft.convert_tokens_to_ids("<|im_end|>")
    the, fox = 1, 2
    context = smol_tokenizer("The quick brown")["input_ids"]
    draft_context = draft.encode("The quick brown", add_special_tokens=False)
    greedy, _ = bridge.to_target(context, draft_context, [the, fox, end_of_turn, the], [], k=5)
    assert smol_tokenizer.decode(greedy) == " the fox"
    q = common_pb2.SparseDistribution(token_ids=[the, end_of_turn, im_end], probs=[0.5, 0.25, 0.25])
    sampled, _ = bridge.to_target([], [], [the, end_of_turn], [q, q], k=2)
    assert sampled == [bridge.shared[the]]
    target_im_end = smol_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert bridge.shared[im_end] == target_im_end
    sampled, qs = bridge.to_target([], [], [the, im_end], [q, q], k=2)
    assert sampled == [bridge.shared[the], target_im_end]
    assert dict(zip(qs[1].token_ids, qs[1].probs)) == pytest.approx({bridge.shared[the]: 2 / 3, target_im_end: 1 / 3})
