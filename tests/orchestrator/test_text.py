"""Streaming text with stop strings, on a word-level tokenizer (decode joins with spaces)."""

from models import word_tokenizer
from orchestrator.text import TextStream

TOK = word_tokenizer(["<eos>", "<unk>", "the", "end", "is", "near", "here"])
IDS = {w: i for i, w in enumerate(["<eos>", "<unk>", "the", "end", "is", "near", "here"])}


def ids(text):
    return [IDS[w] for w in text.split()]


def test_streams_everything_without_stop_strings():
    stream = TextStream(TOK, [])
    assert stream.add(ids("the end")) == (ids("the end"), "the end")
    assert stream.add(ids("is"))[1] == " is"
    assert stream.finish() == ""


def test_holds_back_a_possible_stop_string_then_releases_it():
    stream = TextStream(TOK, ["end is here"])
    assert stream.add(ids("the end"))[1] == "the "   # "end" may start the stop string
    assert stream.add(ids("is near"))[1] == "end is near"
    assert stream.stop_hit is None


def test_cuts_before_the_stop_string_and_the_tokens_after_it():
    stream = TextStream(TOK, ["is"])
    assert stream.add(ids("the end"))[1] == "the end"
    assert stream.add(ids("is near here")) == (ids("is"), " ")
    assert stream.stop_hit == "is"
    assert stream.text == "the end "
    assert stream.ids == ids("the end is")


def test_eos_is_not_text():
    stream = TextStream(TOK, [])
    assert stream.add(ids("the end <eos>"))[1] == "the end"


# The window: streamed deltas add up to the full decode, for any ids in any chunks.

from hypothesis import given, settings, HealthCheck, strategies as st  # noqa: E402


def metaspace_tokenizer():
    """SentencePiece's decoding (Llama's tokenizer.json): "▁" is a space, bytes fall back
    to <0xNN> tokens, and the decode's first space is stripped."""
    from tokenizers import Tokenizer, models, decoders
    from transformers import PreTrainedTokenizerFast

    words = ["<eos>", "<unk>", "▁the", "▁end", "ing", "▁is", "<0xE2>", "<0x82>", "<0xAC>", "<0xF0>", "<0x9F>",
             "<0x98>", "<0x80>", "▁", ".", "s"]
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")


def cleanup_tokenizer():
    """Words joined by spaces, then transformers' clean-up of the whole string (" ." to
    ".", "do n ' t" to "don't")."""
    tok = word_tokenizer(["<eos>", "<unk>", "do", "n", "'", "t", "n't", ".", ",", "?", "!", "s", "m", "ve", "re",
                          "'s", "a"])
    tok.clean_up_tokenization_spaces = True
    return tok


def streamed(tok, chunks, stop=()):
    stream, deltas = TextStream(tok, list(stop)), []
    for chunk in chunks:
        _, delta = stream.add(chunk)
        deltas.append(delta)
        if stream.stop_hit is not None:
            break
        assert stream.text == tok.decode(stream.ids, skip_special_tokens=True)
    deltas.append(stream.finish())
    return stream, "".join(deltas)


def chunked(draw, vocab):
    ids = draw(st.lists(st.integers(0, vocab - 1), max_size=60))
    cuts = sorted(draw(st.lists(st.integers(0, len(ids)), max_size=12)))
    return [ids[a:b] for a, b in zip([0] + cuts, cuts + [len(ids)])]


@st.composite
def smol_chunks(draw):
    # Low ids are single bytes, the pieces of characters the vocabulary lacks.
    ids = draw(st.lists(st.one_of(st.integers(0, 300), st.integers(0, 49151)), max_size=60))
    cuts = sorted(draw(st.lists(st.integers(0, len(ids)), max_size=12)))
    return [ids[a:b] for a, b in zip([0] + cuts, cuts + [len(ids)])]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(chunks=smol_chunks())
def test_streamed_text_is_the_full_decode_byte_level(smol_tokenizer, chunks):
    stream, text = streamed(smol_tokenizer, chunks)
    assert text == stream.text == smol_tokenizer.decode(sum(chunks, []), skip_special_tokens=True)


SENTENCEPIECE, CLEANUP = metaspace_tokenizer(), cleanup_tokenizer()


# SentencePiece's byte fallback decodes a run of byte tokens as a whole: one that ends
# broken turns the whole run into U+FFFD, rewriting a character already sent. No stream
# can take that back, so its outputs here are whole characters (cut anywhere in chunks).
PIECES = [[i] for i in (0, 2, 3, 4, 5, 13, 14, 15)] + [[6, 7, 8], [9, 10, 11, 12]]  # €, 😀


@st.composite
def sentencepiece_chunks(draw):
    ids = sum(draw(st.lists(st.sampled_from(PIECES), max_size=40)), [])
    cuts = sorted(draw(st.lists(st.integers(0, len(ids)), max_size=12)))
    return [ids[a:b] for a, b in zip([0] + cuts, cuts + [len(ids)])]


@settings(max_examples=300, deadline=None)
@given(chunks=sentencepiece_chunks())
def test_streamed_text_is_the_full_decode_across_the_windows_edge_sentencepiece(chunks):
    stream, text = streamed(SENTENCEPIECE, chunks)
    assert text == stream.text == SENTENCEPIECE.decode(sum(chunks, []), skip_special_tokens=True)


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_streamed_text_is_the_full_decode_across_the_windows_edge_clean_up(data):
    chunks = chunked(data.draw, len(CLEANUP))
    stream, text = streamed(CLEANUP, chunks)
    assert text == stream.text == CLEANUP.decode(sum(chunks, []), skip_special_tokens=True)


@settings(max_examples=300, deadline=None)
@given(data=st.data(), stop=st.sampled_from(["n't", "a.", "s a", "do"]))
def test_stop_strings_cut_the_streamed_text_where_the_full_decode_has_them(data, stop):
    chunks = chunked(data.draw, len(CLEANUP))
    stream, text = streamed(CLEANUP, chunks, [stop])
    assert text == stream.text
    full = CLEANUP.decode(stream.ids, skip_special_tokens=True)
    if stream.stop_hit is None:
        assert stop not in full and text == full
    else:
        assert full.find(stop) == len(text)
        assert stop not in CLEANUP.decode(stream.ids[:-1], skip_special_tokens=True)


def test_a_stop_string_that_a_clean_up_completes_across_a_space_is_held_back():
    """"n '" streams nothing of a stop "n't": the clean-up turns "n '" + "t" into "n't".
    (Before: "n" went out, then the stop string cut the text before it. Found by the
    property test above.)"""
    stream, text = streamed(CLEANUP, [[0, 0, 0, 3, 4], [5]], ["n't"])
    assert text == stream.text == "" and stream.stop_hit == "n't"


def test_a_long_output_decodes_only_a_window_a_round(smol_tokenizer):
    decoded = []
    decode = smol_tokenizer.decode

    class Counting:
        def decode(self, ids, **kw):
            decoded.append(len(ids))
            return decode(ids, **kw)

    stream = TextStream(Counting(), [])
    ids = smol_tokenizer("The quick brown fox jumps over the lazy dog. " * 60)["input_ids"]
    for i in range(0, len(ids), 3):
        stream.add(ids[i:i + 3])
    assert stream.text == decode(ids)
    assert max(decoded[len(decoded) // 2:]) <= 4 * 6, "rounds late in the output decoded more than a window"


def test_a_clean_up_that_reaches_back_over_held_text():
    w = {word: i for i, word in enumerate(CLEANUP.convert_ids_to_tokens(list(range(len(CLEANUP)))))}
    for cut in range(1, 5):
        ids = [w["a"], w["do"], w["n"], w["'"], w["t"]]  # "a do n ' t" decodes as "a don't"
        stream, text = streamed(CLEANUP, [ids[:cut], ids[cut:]])
        assert text == "a don't"
