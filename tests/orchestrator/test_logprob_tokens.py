"""Completions' logprobs tokens and text offsets (orchestrator.openai_api): each offset is
where the token's text starts in the choice's text, for a target whose tokenizer adds a
BOS and for a character split across tokens."""

from types import SimpleNamespace

import pytest

from models import bpe_tokenizer
from orchestrator.openai_api import Echo, OpenAIFront, _unwritten
from specdec.api.common.v1 import common_pb2

PROMPT = "The café is open"


@pytest.fixture(scope="module")
def bos_tokenizer():
    """A byte-level BPE that knows no "é" (two byte tokens) and adds <s> before a text,
    as Llama's and Gemma's tokenizers do."""
    from tokenizers import processors

    tok = bpe_tokenizer(["The cat is open. The cab is open."] * 20, vocab_size=300)
    tok.add_special_tokens({"bos_token": "<s>"})
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.bos_token_id)])
    return tok


def echoed(tokenizer, generated: list[int]) -> tuple[str, dict]:
    front = OpenAIFront(SimpleNamespace(tokenizer=tokenizer), "m", [])
    ids = tokenizer(PROMPT)["input_ids"]
    echo = Echo(PROMPT, ids, _unwritten(ids, tokenizer(PROMPT, add_special_tokens=False)["input_ids"]))
    entries = [common_pb2.TokenLogprobs(token_id=t, logprob=-1.0) for t in generated]
    scored = [common_pb2.TokenLogprobs(token_id=t, logprob=-1.0) for t in ids[1:]]
    return PROMPT + tokenizer.decode(generated), front._logprobs(entries, False, echo, scored)


def test_offsets_are_where_each_token_starts_in_the_text(bos_tokenizer):
    generated = bos_tokenizer(" The cab", add_special_tokens=False)["input_ids"]
    text, logprobs = echoed(bos_tokenizer, generated)
    assert logprobs["tokens"][0] == "<s>" and logprobs["text_offset"][0] == 0
    # Not shifted by the BOS's three characters: " is" starts where the text has it.
    words = bos_tokenizer.convert_ids_to_tokens(bos_tokenizer(PROMPT)["input_ids"])
    at = words.index("Ġis")
    assert logprobs["text_offset"][at] == text.index(" is")
    assert logprobs["text_offset"][-1] == len(text) - len(bos_tokenizer.decode(generated[-1:]))
    assert len(logprobs["tokens"]) == len(logprobs["text_offset"]) == len(logprobs["token_logprobs"])


def test_a_character_split_across_tokens_is_its_bytes(bos_tokenizer):
    text, logprobs = echoed(bos_tokenizer, [])
    split = [t for t in logprobs["tokens"] if t.startswith("bytes:")]
    assert split == ["bytes:\\xc3", "bytes:\\xa9"]  # é, never U+FFFD
    assert "\ufffd" not in "".join(logprobs["tokens"])
    first = logprobs["tokens"].index(split[0])
    # Both of é's tokens start where é does; the next one after it.
    assert logprobs["text_offset"][first] == logprobs["text_offset"][first + 1] == text.index("é")
    assert logprobs["text_offset"][first + 2] == text.index("é") + 1
