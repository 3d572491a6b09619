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
