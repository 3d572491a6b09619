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

A constraint applies to the tokens from its `start` position on (a request's output)."""

import functools
import json
import logging

import llguidance
import numpy as np
import torch
from llguidance.gbnf_to_lark import gbnf_to_lark

from specdec.common.v1 import common_pb2
from specdec.errors import InvalidArgument, Precondition

log = logging.getLogger(__name__)

MAX_GRAMMAR_BYTES = 64 * 1024
# Bounds on what one grammar may cost: building its lexer, and each step's mask. The step
# bounds stay llguidance's defaults (about 15 ms of work at most); construction is capped
# well under a second (llguidance's default fuel is ~20 ms; ten times that).
LIMITS = llguidance.LLParserLimits(initial_lexer_fuel=10_000_000, max_grammar_size=200_000, verbose_errors=False)
# JSON as the models write it (json.dumps' separators) and no free whitespace, where a
# small model can spend its whole budget on blank lines.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


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
        if not isinstance(schema, (dict, bool)):
            raise InvalidArgument(f"{field}.json_schema", "must be a JSON object (a schema)")
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
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
        self.vocab_size = vocab_size

    @functools.lru_cache(maxsize=256)
    def check(self, grammar: str) -> str:
        """'' where the grammar compiles against these tokens within the limits, else why
        not (cached by grammar: a schema sent again costs nothing)."""
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer, limits=LIMITS)
        return "" if error.startswith("WARNING") else error

    def guide(self, constraint: common_pb2.Constraint, start: int, field: str = "constraint") -> "Guide | None":
        """A matcher for the tokens from `start` on; None for no constraint. INVALID_ARGUMENT
        naming the field for one that does not compile."""
        grammar = grammar_text(constraint, field)
        if grammar is None:
            return None
        error = self.check(grammar)
        if error:
            raise InvalidArgument(f"{field}.{constraint.WhichOneof('kind')}", f"does not compile: {error}")
        return Guide(self, grammar, start)


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
    to `end` (absolute positions)."""

    def __init__(self, vocab: Vocabulary, grammar: str, start: int):
        self.vocab, self.grammar, self.start = vocab, grammar, start
        self.matcher = llguidance.LLMatcher(vocab.tokenizer, grammar, log_level=0, limits=LIMITS)
        self.end = start
        self._mask: torch.Tensor | None = None  # the mask after `end`, once computed

    def sync(self, history: list[int], since: int | None = None) -> bool:
        """Consumes the history's tokens it has not; rolls back those it no longer holds,
        and those from `since` on (where the history may differ from what it consumed).
        False where the grammar refuses one: the history is not the grammar's."""
        keep = len(history) if since is None else min(since, len(history))
        if keep < self.end:
            back = self.end - max(keep, self.start)
            self.matcher.rollback(back)
            self.end -= back
            self._mask = None
        new = history[self.end:]
        if self.allowed(new) < len(new):  # checked first: a refused token ends the matcher for good
            return self._replay(history)
        if not new:
            return not self.matcher.is_error()
        self.end += len(new)
        self._mask = None
        return self.matcher.consume_tokens(new)

    def _replay(self, history: list[int]) -> bool:
        """A fresh matcher over the whole output, where the incremental one refused a token
        of it: seen on a verifier under full CPU load (three benchmark runs beside a
        compiler, 2 cores), the refused token a pick of its own; not reproduced without
        that load nor by randomized advance / masks / rollback sequences. A fresh matcher
        took the same output."""
        fresh = llguidance.LLMatcher(self.vocab.tokenizer, self.grammar, log_level=0, limits=LIMITS)
        output = history[self.start:]
        if fresh.validate_tokens(output) < len(output) if output else False:
            return False
        log.warning("constraint: the matcher refused token %d at position %d of an output it allows; "
                    "replayed %d tokens on a fresh one", history[self.end + self.allowed(history[self.end:])],
                    self.end + self.allowed(history[self.end:]), len(output))
        fresh.consume_tokens(output)
        self.matcher, self.end, self._mask = fresh, len(history), None
        return True

    def advance(self, token: int) -> bool:
        """Consumes one more token; False (consuming nothing) where the grammar refuses it."""
        if not self.allowed([token]):
            return False
        self.end += 1
        self._mask = None
        return self.matcher.consume_token(token)

    def mask(self) -> torch.Tensor:
        """[vocab] bool: the tokens the grammar allows next (the eos tokens where it accepts)."""
        if self._mask is None:
            self._mask = self._compute()
        return self._mask

    def _compute(self) -> torch.Tensor:
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        return torch.from_numpy(np.unpackbits(bits, bitorder="little")[:self.vocab.vocab_size].astype(bool))

    def masks(self, drafts: list[int]) -> torch.Tensor:
        """[len(drafts) + 1, vocab]: the mask after each prefix of the drafts, up to the first
        one the grammar forbids (the rows after it repeat its mask: a round never reaches
        them, the forbidden draft is rejected). The matcher ends where it began."""
        rows, taken = [self.mask()], self.allowed(drafts)
        for token in drafts[:taken]:
            self.matcher.consume_token(token)
            rows.append(self._compute())
        rows.extend(rows[-1:] * (len(drafts) - taken))
        if taken:
            self.matcher.rollback(taken)
        return torch.stack(rows)

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
        return self.matcher.is_error() or not bool(self.mask().any())

    @property
    def error(self) -> str:
        return self.matcher.get_error()


def apply(logits: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """logits [n, vocab] with what the masks [n, vocab] forbid at -inf."""
    return logits.masked_fill(~masks.to(logits.device), float("-inf"))
