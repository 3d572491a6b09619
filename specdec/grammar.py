"""Output constraints: a JSON schema, any JSON object, a regex, or a Lark or GBNF grammar,
compiled and matched by llguidance (token masks of tens of microseconds a step on the
default target's 49,152 tokens, a schema's compile in milliseconds).

Where the constraint acts, by role:
- the verifier masks the target's logits at every position it picks, in a round and in a
  run of the target alone, before temperature, top-k and top-p: p is the masked
  distribution, so the output is the target alone's under the same constraint;
- the orchestrator drafts the tokens the grammar forces (free drafts) and cuts a draft
  after its first forbidden token (which the masked p rejects: the rejection rule then
  draws the correction from the masked residual, so the rule stays exact with the
  draft's own q).

A constraint applies to the tokens from its `start` position on (a request's output).

The masks as tensors are the verifier's alone: torch is imported where they are made, so
that the orchestrator follows a grammar without the model runtime."""

import collections
import functools
import hashlib
import json
import logging
import threading
from typing import TYPE_CHECKING

import llguidance
import numpy as np
from llguidance.gbnf_to_lark import gbnf_to_lark

from specdec.api.common.v1 import common_pb2
from specdec.errors import InvalidArgument, Precondition

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

MAX_GRAMMAR_BYTES = 64 * 1024
# Bounds on what one grammar may cost: building its lexer, and each step's mask. The step
# bounds stay llguidance's defaults; construction is capped well under a second (ten
# times llguidance's default fuel).
LIMITS = llguidance.LLParserLimits(initial_lexer_fuel=10_000_000, max_grammar_size=200_000, verbose_errors=False)
# JSON as the models write it (json.dumps' separators) and no free whitespace, where a
# small model can spend its whole budget on blank lines.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Deepest nesting of a schema's JSON (objects and lists) we walk; llguidance's own bound on
# a schema's depth is lower.
MAX_SCHEMA_DEPTH = 256
# Constraints whose compiled matcher a Vocabulary keeps: a request that sends one again (a
# tool set, a schema, each of n samples) takes a copy, not a compile (a 57 KB schema: 0.35 s).
COMPILED_CACHE = 64


# Where a schema holds subschemas: one, a list of them, or a map of names to them.
_ONE = ("items", "additionalProperties", "additionalItems", "unevaluatedProperties", "unevaluatedItems", "contains",
        "propertyNames", "not", "if", "then", "else")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
# Keys that say what other keys may be, or that let subschemas beside `properties` name more.
_OTHER_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties", "allOf", "anyOf", "oneOf",
               "$ref", "if", "then", "else", "dependentSchemas")


def closed(schema, field: str = "constraint.json_schema"):
    """The schema with every object that names its properties and says nothing of other
    keys closed to them (`additionalProperties: false`), as OpenAI's strict schemas and
    xgrammar's strict mode (vLLM's default) have it. JSON Schema's own default allows any
    other key, and a small model under it adds keys to its token limit (a tool call's
    arguments: "description" again and again). A schema that allows other keys says so,
    and keeps them; so does an object of no named properties (`json_object`). Left open
    too, where closing could forbid keys the schema names elsewhere: an object beside
    `allOf`, `anyOf`, `oneOf`, `$ref` or a condition; and a schema that merges several
    (an `allOf` of two or more) is left as written, since each part, or a definition one
    refers to, names only some of an object's keys. INVALID_ARGUMENT naming `field` for a
    schema nested deeper than MAX_SCHEMA_DEPTH."""
    check_depth(schema, field)
    return schema if _merges(schema) else _close(schema)


def check_depth(node, field: str) -> None:
    """INVALID_ARGUMENT naming the field where JSON nests deeper than MAX_SCHEMA_DEPTH
    (walked without recursion: the walks after it recurse)."""
    level = [node]
    for depth in range(MAX_SCHEMA_DEPTH + 1):
        level = [child for item in level if isinstance(item, (dict, list))
                 for child in (item.values() if isinstance(item, dict) else item)]
        if not level:
            return
    raise InvalidArgument(field, f"nests deeper than {MAX_SCHEMA_DEPTH} levels")


def _merges(node) -> bool:
    if isinstance(node, dict):
        return isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1 or any(map(_merges, node.values()))
    return isinstance(node, list) and any(map(_merges, node))


def _close(schema):
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key] = _close(out[key])
    for key in _LIST:
        if isinstance(out.get(key), list):
            out[key] = [_close(s) for s in out[key]]
    for key in _MAP:
        if isinstance(out.get(key), dict):
            out[key] = {name: _close(s) for name, s in out[key].items()}
    # A name `required` lists beside the properties is a key of any value: closed, the object
    # could never be.
    named = out.get("properties")
    required = out.get("required") if isinstance(out.get("required"), list) else []
    if isinstance(named, dict) and named and not any(key in out for key in _OTHER_KEYS) \
            and all(name in named for name in required):
        out["additionalProperties"] = False
    return out


def grammar_text(constraint: common_pb2.Constraint, field: str = "constraint") -> str | None:
    """llguidance's grammar for a constraint; None where it constrains nothing.
    INVALID_ARGUMENT naming the field for one that is too large or malformed (its
    compilation against a vocabulary is `Vocabulary.check`)."""
    kind = constraint.WhichOneof("kind")
    if kind is None:
        return None
    source = getattr(constraint, kind)
    if isinstance(source, str) and len(source.encode()) > MAX_GRAMMAR_BYTES:
        raise InvalidArgument(f"{field}.{kind}", f"at most {MAX_GRAMMAR_BYTES} bytes, got {len(source.encode())}")
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if not source:
        raise InvalidArgument(f"{field}.{kind}", "must not be empty")
    if kind == "json_schema":
        try:
            schema = json.loads(source)
        except json.JSONDecodeError as err:
            raise InvalidArgument(f"{field}.json_schema", f"is not JSON: {err}") from None
        except RecursionError:
            raise InvalidArgument(f"{field}.json_schema", f"nests deeper than {MAX_SCHEMA_DEPTH} levels") from None
        if not isinstance(schema, (dict, bool)):
            raise InvalidArgument(f"{field}.json_schema", "must be a JSON object (a schema)")
        return llguidance.LLMatcher.grammar_from_json_schema(closed(schema, f"{field}.json_schema"),
                                                              defaults=JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(source)
    if kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(source)
    try:
        return llguidance.LLMatcher.grammar_from_lark(gbnf_to_lark(source))
    except Exception as err:  # the converter's own errors are plain exceptions
        raise InvalidArgument(f"{field}.gbnf", f"does not parse: {err}") from None


class Vocabulary:
    """A model's tokens as llguidance matches them; built once per tokenizer (~0.3 s).
    `vocab_size`: the model's logits width (may exceed the tokenizer's); `eos`: the tokens
    that end the output, allowed where the grammar accepts."""

    def __init__(self, tokenizer, vocab_size: int, eos: list[int]):
        import llguidance.hf  # transformers, imported only where a tokenizer is at hand
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(eos) or None)
        self.vocab_size, self.eos = vocab_size, set(eos)
        # digest of a constraint -> (its grammar, a matcher that has consumed nothing), newest last
        self._compiled: collections.OrderedDict[bytes, tuple[str, llguidance.LLMatcher]] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._compiling: dict[bytes, threading.Lock] = {}  # one compile of a constraint at a time
        self.refused = 0  # tokens a guide's matcher refused in a history it was asked to follow (Guide.sync)

    @functools.lru_cache(maxsize=256)
    def check(self, grammar: str) -> str:
        """'' where the grammar compiles against these tokens within the limits, else why
        not (cached by grammar: a schema sent again costs nothing)."""
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer, limits=LIMITS)
        return "" if error.startswith("WARNING") else error

    def guide(self, constraint: common_pb2.Constraint, start: int, field: str = "constraint") -> "Guide | None":
        """A matcher for the tokens from `start` on; None for no constraint. INVALID_ARGUMENT
        naming the field for one that does not compile. A compile takes up to a second of
        CPU: call it off an event loop. Thread-safe."""
        if constraint.WhichOneof("kind") is None:
            return None
        grammar, pristine = self.compiled(constraint, field)
        return Guide(self, grammar, start, pristine.deep_copy())

    def compiled(self, constraint: common_pb2.Constraint, field: str) -> tuple[str, "llguidance.LLMatcher"]:
        """(the constraint's grammar, a matcher that has consumed nothing), from the cache
        of the last COMPILED_CACHE constraints, keyed by their digest."""
        key = hashlib.sha256(constraint.SerializeToString(deterministic=True)).digest()
        with self._lock:
            lock = self._compiling.setdefault(key, threading.Lock())
        with lock:  # a second request for a constraint being compiled waits for that compile
            with self._lock:
                if key in self._compiled:
                    self._compiled.move_to_end(key)
                    return self._compiled[key]
            try:
                grammar = grammar_text(constraint, field)
                error = self.check(grammar)
                if error:
                    raise InvalidArgument(f"{field}.{constraint.WhichOneof('kind')}", f"does not compile: {error}")
                entry = grammar, llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=LIMITS)
                with self._lock:
                    self._compiled[key] = entry
                    while len(self._compiled) > COMPILED_CACHE:
                        self._compiled.popitem(last=False)
                return entry
            finally:
                with self._lock:
                    self._compiling.pop(key, None)


class NoVocabulary:
    """A tokenizer llguidance cannot read (a slow one): a constraint is refused, saying why."""

    def __init__(self, why: str):
        self.why = why

    def guide(self, constraint: common_pb2.Constraint, start: int, field: str = "constraint") -> None:
        if grammar_text(constraint, field) is not None:
            raise Precondition(f"{field}: this deployment cannot constrain output: {self.why}")


def vocabulary(tokenizer, vocab_size: int, eos: list[int]) -> "Vocabulary | NoVocabulary":
    try:
        return Vocabulary(tokenizer, vocab_size, eos)
    except Exception as err:  # llguidance's reasons are plain exceptions
        log.warning("output constraints are off: llguidance cannot read the tokenizer (%s)", err)
        return NoVocabulary(f"llguidance cannot read the target's tokenizer ({type(err).__name__}: {err})")


class Guide:
    """One output's place in its grammar: the matcher has consumed the tokens from `start`
    to `end` (absolute positions).

    An end of sequence consumed where the grammar had already stopped (nothing but the end
    could come next) is a token llguidance (1.9.1) takes without counting it: a rollback
    over it must count one fewer, or it undoes a token before it too (found checking drafts
    that end an output, rolled back; vLLM's llguidance backend counts the same way). The
    positions of such ends are `_uncounted`."""

    def __init__(self, vocab: Vocabulary, grammar: str, start: int, matcher: "llguidance.LLMatcher"):
        self.vocab, self.grammar, self.start = vocab, grammar, start
        self.matcher = matcher  # its own copy of the compiled one (Vocabulary.guide)
        self.end = start
        self._uncounted: list[int] = []
        self._bits: np.ndarray | None = None  # the packed mask after `end`, once computed

    def sync(self, history: list[int], since: int | None = None) -> bool:
        """Consumes the history's tokens it has not; rolls back those it no longer holds,
        and those from `since` on (where the history may differ from what it consumed).
        False where the grammar refuses one: the history is not the grammar's."""
        keep = len(history) if since is None else min(since, len(history))
        if keep < self.end:
            self._rollback(max(keep, self.start))
            self._bits = None
        new = history[self.end:]
        if self.allowed(new) < len(new):  # checked first: a refused token ends the matcher for good
            # Never repaired: where the history is the target's picks under this grammar, a
            # refusal means a pick was made under another state than this one, and the output
            # may already differ from the target alone's. The caller fails the request.
            refused = new[self.allowed(new)]
            if refused not in self.vocab.eos:  # an end after the grammar stopped: llguidance's way, no fault
                self.vocab.refused += 1
                log.warning("constraint: the matcher refuses token %d at position %d of the history it follows",
                            refused, self.end + self.allowed(new))
            return False
        if not new:
            return not self.matcher.is_error()
        self._bits = None
        return self._take(new)

    def _take(self, tokens: list[int]) -> bool:
        """Consumes tokens the grammar allows (checked by the caller)."""
        for token in tokens:
            if self.matcher.is_stopped():
                self._uncounted.append(self.end)
            self.end += 1
            if not self.matcher.consume_token(token):
                return False
        return True

    def _rollback(self, to: int) -> None:
        """Undoes the tokens from absolute position `to` on."""
        uncounted = sum(position >= to for position in self._uncounted)
        if uncounted:
            self._uncounted = [position for position in self._uncounted if position < to]
        if self.end - to - uncounted:
            self.matcher.rollback(self.end - to - uncounted)
        self.end = to

    def advance(self, token: int) -> bool:
        """Consumes one more token; False (consuming nothing) where the grammar refuses it."""
        if not self.allowed([token]):
            return False
        self._bits = None
        return self._take([token])

    def mask(self) -> "torch.Tensor":
        """[vocab] bool: the tokens the grammar allows next (the eos tokens where it accepts)."""
        return self._unpack(self._packed())

    def _packed(self) -> np.ndarray:
        if self._bits is None:
            self._bits = self._compute()
        return self._bits

    def _compute(self) -> np.ndarray:
        return np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)

    def _unpack(self, bits: np.ndarray) -> "torch.Tensor":
        import torch

        return torch.from_numpy(np.unpackbits(bits, bitorder="little")[:self.vocab.vocab_size].astype(bool))

    def masks(self, drafts: list[int]) -> "torch.Tensor":
        """[len(drafts) + 1, vocab]: the mask after each prefix of the drafts, up to the first
        one the grammar forbids (the rows after it repeat its mask: a round never reaches
        them, the forbidden draft is rejected). The matcher ends where it began."""
        rows, taken, end = [self.mask()], self.allowed(drafts), self.end
        for token in drafts[:taken]:
            self._take([token])
            rows.append(self._unpack(self._compute()))
        rows.extend(rows[-1:] * (len(drafts) - taken))
        self._rollback(end)
        import torch

        return torch.stack(rows)

    def greedy(self, logits: "torch.Tensor", drafts: list[int]) -> list[int]:
        """Each row's greedy token under the masks `masks(drafts)` gives ([len(drafts) + 1,
        vocab] logits), as argmax(apply(logits, masks)) picks them, applying a row's mask
        only where it forbids the row's first choice: the first of a row's equal maxima,
        where allowed, is the first of those allowed. The mask decides, not
        validate_tokens: where the grammar forces the next bytes, the mask allows only the
        token the tokenizer writes them as (`":`), validate_tokens any prefix of it too (`"`)."""
        from specdec import sampling

        firsts, picks = sampling.argmax(logits), []
        taken, end = self.allowed(drafts), self.end
        bits = self._packed()
        for i, first in enumerate(firsts):
            if 0 < i <= taken:  # past a forbidden draft, the rows repeat its mask
                self._take([drafts[i - 1]])
                bits = self._compute()
            if bits[first >> 3] >> (first & 7) & 1:
                picks.append(first)
            else:
                mask = self._unpack(bits)
                picks.append(sampling.argmax(apply(logits[i:i + 1], mask[None]))[0])
        self._rollback(end)
        return picks

    def allowed(self, drafts: list[int]) -> int:
        """How many of the drafts, in order, the grammar allows."""
        return self.matcher.validate_tokens(drafts) if drafts else 0

    def forced(self) -> list[int]:
        """Tokens the grammar's next bytes are forced to, as the tokenizer writes them (the
        target may tokenize them otherwise: they are drafts, never committed unchecked)."""
        if self.matcher.is_stopped():
            return []
        return self.matcher.compute_ff_tokens()

    @property
    def dead(self) -> bool:
        """No token can come next: the grammar failed (a step over its limits), or it
        allows nothing where it does not accept."""
        return self.matcher.is_error() or not self._packed().any()

    @property
    def error(self) -> str:
        return self.matcher.get_error()


def apply(logits: "torch.Tensor", masks: "torch.Tensor") -> "torch.Tensor":
    """logits [n, vocab] with what the masks [n, vocab] forbid at -inf."""
    return logits.masked_fill(~masks.to(logits.device), float("-inf"))
