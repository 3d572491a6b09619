"""specdec.grammar on the default target's tokenizer: what each kind of constraint allows,
the masks a round checks its drafts with, forced tokens, and a matcher that follows a
history that grows, is cut back and grows again."""

import json
import time

import pytest
import torch

from specdec import grammar
from specdec.api.common.v1 import common_pb2
from specdec.errors import InvalidArgument

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}


@pytest.fixture(scope="module")
def vocab(smol_tokenizer):
    return grammar.Vocabulary(smol_tokenizer, len(smol_tokenizer), [2])


def ids(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def test_the_output_a_schema_allows_and_its_end(vocab, smol_tokenizer):
    guide = vocab.guide(common_pb2.Constraint(json_schema=json.dumps(SCHEMA)), 3)
    answer = ids(smol_tokenizer, '{"name": "Ada", "age": 36}')
    assert guide.sync([7, 7, 7] + answer)  # the first 3 tokens are the prompt's
    assert torch.nonzero(guide.mask()).flatten().tolist() == [2]  # only the end of sequence
    fresh = vocab.guide(common_pb2.Constraint(json_schema=json.dumps(SCHEMA)), 0)
    assert fresh.allowed(ids(smol_tokenizer, '{"name": 5')) == len(ids(smol_tokenizer, '{"name": '))
    assert not fresh.mask()[2]  # no end before the object


def test_an_object_of_named_properties_takes_no_other_key_unless_its_schema_allows_one(vocab, smol_tokenizer):
    # A tool's parameters as users write them: no word on other keys.
    params = {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}
    extra = ids(smol_tokenizer, '{"city": "Oslo", "description": "x"}')
    just = ids(smol_tokenizer, '{"city": "Oslo"}')
    for schema, extra_allowed in ((params, False), ({**params, "additionalProperties": True}, True),
                                  ({**params, "additionalProperties": {"type": "string"}}, True)):
        guide = vocab.guide(common_pb2.Constraint(json_schema=json.dumps(schema)), 0)
        assert guide.allowed(just + [2]) == len(just) + 1
        assert (guide.allowed(extra) == len(extra)) == extra_allowed, schema


def test_closing_reaches_every_subschema_and_leaves_composed_objects_open():
    leaf = {"properties": {"a": {}}}
    schema = {"type": "object", "properties": {"inner": leaf, "free": {"type": "object"}},
              "items": leaf, "prefixItems": [leaf], "anyOf": [leaf], "$defs": {"d": leaf},
              "additionalProperties": {"properties": {"b": {}}}}
    out = grammar.closed(schema)
    shut = {**leaf, "additionalProperties": False}
    assert out["properties"] == {"inner": shut, "free": {"type": "object"}}
    assert out["items"] == shut and out["prefixItems"] == [shut] and out["anyOf"] == [shut]
    assert out["$defs"] == {"d": shut}
    assert out["additionalProperties"] == {"properties": {"b": {}}, "additionalProperties": False}
    assert schema["properties"]["inner"] == leaf  # the caller's schema is not changed
    # Beside allOf or a $ref, an object may be named in part: left open.
    for composed in ({**leaf, "allOf": [{"properties": {"b": {}}}]}, {**leaf, "$ref": "#/$defs/x"}):
        assert "additionalProperties" not in grammar.closed(composed)
    assert grammar.closed({"allOf": [leaf]})["allOf"] == [shut]  # one part: the whole object
    # Several parts: each, and any definition one refers to, names only some keys.
    merged = {"allOf": [{"$ref": "#/$defs/base"}, {"properties": {"b": {}}}], "$defs": {"base": leaf}}
    assert grammar.closed(merged) == merged
    # A map of property names is not a schema: a property called "properties" stays one.
    named = {"type": "object", "properties": {"properties": {"type": "string"}}}
    assert grammar.closed(named)["properties"] == {"properties": {"type": "string"}}


@pytest.mark.parametrize("constraint, good, bad", [
    (common_pb2.Constraint(regex=r"(yes|no), [0-9]+"), "no, 42", "maybe"),
    (common_pb2.Constraint(json_object=True), '{"a": [1, 2]}', "[1]"),
    (common_pb2.Constraint(lark='start: "x" /[0-9]{3}/'), "x123", "y"),
    (common_pb2.Constraint(gbnf='root ::= "answer: " [a-z]+'), "answer: ok", "Answer"),
])
def test_each_kind_allows_its_language(vocab, smol_tokenizer, constraint, good, bad):
    guide = vocab.guide(constraint, 0)
    assert guide.allowed(ids(smol_tokenizer, good) + [2]) == len(ids(smol_tokenizer, good)) + 1
    assert guide.allowed(ids(smol_tokenizer, bad)) < len(ids(smol_tokenizer, bad))


def test_masks_follow_the_drafts_up_to_the_first_forbidden_one(vocab, smol_tokenizer):
    guide = vocab.guide(common_pb2.Constraint(regex="(cat|dog)s? are nice"), 0)
    drafts = ids(smol_tokenizer, "dogs are") + ids(smol_tokenizer, " bad")
    masks = guide.masks(drafts)
    assert masks.shape == (len(drafts) + 1, len(smol_tokenizer))
    good = len(ids(smol_tokenizer, "dogs are"))
    for i in range(good):  # each draft is allowed where it stands
        assert masks[i, drafts[i]]
    assert not masks[good, drafts[good]]  # the forbidden one is not: the round rejects it
    assert guide.end == 0 and torch.equal(guide.mask(), masks[0])  # the matcher is where it was


def test_greedy_picks_are_those_of_the_masked_logits(vocab, smol_tokenizer):
    """Guide.greedy reads a row's mask at its first choice instead of applying it: at
    every place of an output, over drafts that the grammar allows and drafts it stops at,
    with logits whose first choice the mask often forbids (a token no object allows; a
    quote alone where the grammar forces a quote and more, which validate_tokens allows
    and the mask does not) and with ties, its picks are argmax of the masked logits, and
    the matcher ends where it began."""
    answer = ids(smol_tokenizer, '{"name": "Ada Lovelace", "age": 36}') + [2]
    forbidden, quote = ids(smol_tokenizer, "]")[0], ids(smol_tokenizer, '"')[0]
    generator = torch.Generator().manual_seed(0)
    guide = vocab.guide(common_pb2.Constraint(json_schema=json.dumps(SCHEMA)), 0)
    fell_back = validated = 0
    for place in range(len(answer)):
        assert guide.sync(answer[:place])
        stopped = answer[place:place + 1] + [forbidden] + answer[place + 2:place + 3]
        for drafts in (answer[place:place + 3], stopped, []):
            for first_choice in (forbidden, quote, None):
                logits = torch.randn(len(drafts) + 1, len(smol_tokenizer), generator=generator)
                if first_choice is None:
                    logits[:, answer[place]] = logits[:, 0] = logits.max() + 1  # a tie: the first is picked
                else:
                    logits[:, first_choice] += 10.0
                picks = guide.greedy(logits, drafts)
                masks = guide.masks(drafts)
                assert picks == torch.argmax(grammar.apply(logits, masks), dim=-1).tolist()
                firsts = torch.argmax(logits, dim=-1).tolist()
                fell_back += sum(first != pick for first, pick in zip(firsts, picks))
                validated += sum(first == quote and not masks[0, quote] and guide.allowed([quote]) == 1
                                 for first in firsts[:1])
                assert guide.end == place and torch.equal(guide.mask(), masks[0])
    assert fell_back > 10 and validated  # rows picked from their masks, some of a token validate_tokens allows


def test_drafts_past_the_end_leave_the_matcher_where_it_was(vocab, smol_tokenizer):
    """An end of sequence after the grammar stopped is a token llguidance takes without
    counting: masks and picks over drafts that end the output, and a history cut back over
    its end, leave the matcher at the committed tokens (it allows what a fresh one does)."""
    answer = ids(smol_tokenizer, '{"name": "Ada", "age": 3')
    closing = ids(smol_tokenizer, "}")
    guide = vocab.guide(common_pb2.Constraint(json_schema=json.dumps(SCHEMA)), 0)
    reference = vocab.guide(common_pb2.Constraint(json_schema=json.dumps(SCHEMA)), 0)
    assert reference.sync(answer)
    assert guide.sync(answer)
    drafts = closing + [2, 2]
    guide.masks(drafts)
    guide.greedy(torch.zeros(len(drafts) + 1, len(smol_tokenizer)), drafts)
    assert torch.equal(guide.mask(), reference.mask()) and guide.allowed(closing) == 1
    assert guide.sync(answer + closing + [2])  # the output's end, then cut back to the answer
    assert guide.sync(answer, since=len(answer))
    assert guide.end == len(answer) and torch.equal(guide.mask(), reference.mask())
    assert guide.sync(answer + closing + [2])


def test_forced_tokens_are_the_schemas_fixed_text(vocab, smol_tokenizer):
    """The bytes a schema fixes, as the tokenizer writes them (its last token held back
    where a longer one could still start there)."""
    guide = vocab.guide(common_pb2.Constraint(json_schema=json.dumps(SCHEMA)), 0)
    assert smol_tokenizer.decode(guide.forced()) == '{"name":'
    guide.sync(ids(smol_tokenizer, '{"name": "Ada'))
    assert guide.forced() == []  # the string may go on
    guide.sync(ids(smol_tokenizer, '{"name": "Ada", "'))
    assert smol_tokenizer.decode(guide.forced()) == 'age":'


def test_the_matcher_follows_a_history_cut_back_and_rewritten(vocab, smol_tokenizer):
    """A run's last picks its caller never read are rolled back (`since`), and the history
    then grows another way."""
    guide = vocab.guide(common_pb2.Constraint(json_schema=json.dumps(SCHEMA)), 2)
    prompt = [5, 5]
    first = prompt + ids(smol_tokenizer, '{"name": "Bob", "age": 4')
    assert guide.sync(first)
    second = prompt + ids(smol_tokenizer, '{"name": "Bo"')
    assert guide.sync(second, since=len(prompt) + 4)
    assert guide.end == len(second)
    reference = vocab.guide(common_pb2.Constraint(json_schema=json.dumps(SCHEMA)), 2)
    reference.sync(second)
    assert torch.equal(guide.mask(), reference.mask())
    assert not guide.sync(second + ids(smol_tokenizer, "]"))  # refused, and nothing consumed
    assert guide.end == len(second) and torch.equal(guide.mask(), reference.mask())


@pytest.mark.parametrize("constraint, field", [
    (common_pb2.Constraint(json_schema="{"), "constraint.json_schema"),
    (common_pb2.Constraint(json_schema="[]"), "constraint.json_schema"),
    (common_pb2.Constraint(json_schema='{"type": "integer", "minimum": "x"}'), "constraint.json_schema"),
    (common_pb2.Constraint(regex="a{2,1}"), "constraint.regex"),
    (common_pb2.Constraint(lark="start: other"), "constraint.lark"),
    (common_pb2.Constraint(gbnf="root ::= [a-"), "constraint.gbnf"),
    (common_pb2.Constraint(regex=""), "constraint.regex"),
    (common_pb2.Constraint(lark="x" * (grammar.MAX_GRAMMAR_BYTES + 1)), "constraint.lark"),
])
def test_a_constraint_that_does_not_compile_is_refused_at_once(vocab, constraint, field):
    started = time.monotonic()
    with pytest.raises(InvalidArgument) as err:
        vocab.guide(constraint, 0)
    assert err.value.field.startswith(field)
    assert time.monotonic() - started < 1.0


def test_a_large_alternation_compiles_within_its_bound(vocab):
    """A schema of a thousand enum values: compiled in well under a second."""
    schema = {"type": "object", "properties": {"code": {"enum": [f"code-{i:04d}" for i in range(1000)]}},
              "required": ["code"]}
    started = time.monotonic()
    guide = vocab.guide(common_pb2.Constraint(json_schema=json.dumps(schema)), 0)
    guide.mask()
    assert time.monotonic() - started < 1.0


def test_no_constraint_is_none(vocab):
    assert vocab.guide(common_pb2.Constraint(), 0) is None


def test_a_schema_nested_past_the_bound_is_refused_naming_the_field(vocab):
    """600 levels of `items` raised RecursionError in the schema's walk (UNKNOWN, HTTP 500)."""
    schema = {"type": "integer"}
    for _ in range(600):
        schema = {"type": "array", "items": schema}
    with pytest.raises(InvalidArgument, match=r"^constraint\.json_schema: nests deeper than"):
        vocab.guide(common_pb2.Constraint(json_schema=json.dumps(schema)), 0)
    deep = "[" * 5000 + "]" * 5000  # deeper than Python's json parser recurses
    with pytest.raises(InvalidArgument, match=r"^constraint\.json_schema: "):
        vocab.guide(common_pb2.Constraint(json_schema=deep), 0)


def test_a_required_key_the_properties_do_not_name_stays_allowed(vocab, smol_tokenizer):
    """`b` is required but not described: any value. Closing the object made the schema
    unsatisfiable and the request got a 400."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]}
    assert "additionalProperties" not in grammar.closed(schema)
    guide = vocab.guide(common_pb2.Constraint(json_schema=json.dumps(schema)), 0)
    answer = ids(smol_tokenizer, '{"a": 1, "b": "x"}')
    assert guide.allowed(answer) == len(answer)


def test_a_constraint_sent_again_is_compiled_once_and_its_guides_are_apart(vocab, smol_tokenizer, monkeypatch):
    """Each request compiled its constraint anew (a 57 KB schema: 0.35 s of matcher) and
    each of n samples again; now a compiled one is kept, by digest, and copied."""
    compiles = []
    text = grammar.grammar_text
    monkeypatch.setattr(grammar, "grammar_text", lambda *a, **k: compiles.append(1) or text(*a, **k))
    constraint = common_pb2.Constraint(json_schema=json.dumps({**SCHEMA, "title": "compiled once"}))
    first, second = vocab.guide(constraint, 0), vocab.guide(common_pb2.Constraint(json_schema=constraint.json_schema), 4)
    assert len(compiles) == 1 and first.matcher is not second.matcher and second.start == 4
    answer = ids(smol_tokenizer, '{"name": "Ada", "age": 36}')
    assert first.sync(answer) and first.end == len(answer)
    assert second.end == 4 and second.allowed(answer) == len(answer)  # the first one's tokens are not the second's
    for i in range(grammar.COMPILED_CACHE):  # the oldest leave first
        vocab.guide(common_pb2.Constraint(regex=f"a{{{i + 1}}}"), 0)
    vocab.guide(constraint, 0)
    assert len(compiles) == 2 + grammar.COMPILED_CACHE


def test_a_matcher_behind_its_history_fails_it_and_counts_never_repairs(vocab, smol_tokenizer):
    """Guide._replay rebuilt a matcher that refused a token of the history it followed and
    went on with a warning: the token had been picked under the refusing state, so the
    output may already have differed from the target alone's. Now the sync fails (the
    request with it) and the vocabulary counts it (a verifier metric)."""
    guide = vocab.guide(common_pb2.Constraint(json_schema=json.dumps(SCHEMA)), 0)
    answer = ids(smol_tokenizer, '{"name": "Ada", "age": 36}')
    assert guide.sync(answer[:3])
    guide.matcher.consume_token(answer[3])  # the matcher moved on behind the guide's back (a race)
    before = vocab.refused
    assert not guide.sync(answer)
    assert vocab.refused == before + 1
