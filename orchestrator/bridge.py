"""Drafts of a model with another tokenizer than the target's.

The orchestrator owns the history in the target's tokens; a drafter of another
vocabulary holds the same text in its own (`Aligned`: the history's text tokenized by
the draft's tokenizer, in chunks that do not change once written, so that its cache
stays valid as the history grows). Its drafts come back in its tokens and are carried
over before the verifier sees them (`Bridge.to_target`):

- greedy: the drafts' text, tokenized by the target's tokenizer after the committed
  text (string-level: transformers' universal assisted generation). The verifier keeps
  the drafts that are the target's own choices, so the output is the target's whatever
  the drafts are;
- sampled: token-level intersection (Timor et al., ICML 2025): a draft carries over
  where its string is one token of the target's vocabulary too, with q restricted to
  those tokens and renormalised. A draft is drawn from q; where it lies in the
  intersection, its distribution given that is exactly the restricted q, which the
  verifier's rule is given; where it does not, the round stops drafting there and the
  target draws that position from p. Either way the position is drawn from p: the
  output keeps the target's distribution.

Either carry-over affects only how many drafts pass, never the output."""

import json
import re
from dataclasses import dataclass, field

from specdec.api.common.v1 import common_pb2
from specdec.lookup import common_prefix

CHUNK = 64  # target tokens of text below which the draft's tokens of the history are re-made each call
_BYTE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character that stands for each byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, n = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def _fallback_ids(tokenizer) -> set[int]:
    """A SentencePiece vocabulary's byte-fallback pieces (<0xNN>)."""
    return {i for piece, i in tokenizer.get_vocab().items() if _BYTE.match(piece)}


def token_bytes(tokenizer) -> dict[int, bytes]:
    """Each ordinary token's bytes as text: byte-level BPE's alphabet read back, a
    SentencePiece "▁" a space and its <0xNN> pieces bytes; special tokens left out."""
    special = set(tokenizer.all_special_ids)
    decoder = json.loads(tokenizer.backend_tokenizer.to_str()).get("decoder") or {}
    byte_level = '"ByteLevel"' in json.dumps(decoder)
    alphabet = _byte_level_decoder() if byte_level else {}
    out = {}
    for piece, i in tokenizer.get_vocab().items():
        if i in special:
            continue
        if byte_level:
            if all(c in alphabet for c in piece):
                out[i] = bytes(alphabet[c] for c in piece)
            continue
        byte = _BYTE.match(piece)
        out[i] = bytes([int(byte.group(1), 16)]) if byte else piece.replace("▁", " ").encode()
    return out


def _special_ids(tokenizer) -> dict[str, int]:
    """A tokenizer's special tokens (an end of turn, an end of text, ...) by their content."""
    special = {t.content: i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    special.update(zip(tokenizer.all_special_tokens, tokenizer.all_special_ids))
    return special


class Bridge:
    """What carries a draft of the draft's tokenizer over to the target's: the two
    tokenizers, and the tokens whose strings both vocabularies hold (draft id -> target id;
    several draft ids may stand for one target id: a SentencePiece "A" and its <0x41>)."""

    def __init__(self, target_tokenizer, draft_tokenizer):
        self.target, self.draft = target_tokenizer, draft_tokenizer
        # Of the target's tokens of the same bytes, the one its tokenizer writes them as: an
        # ordinary piece before a byte-fallback one (whose "A" the target seldom picks).
        target_bytes, fallback = token_bytes(target_tokenizer), _fallback_ids(target_tokenizer)
        by_bytes = {}
        for i in sorted(target_bytes, key=lambda i: (i in fallback, i)):
            by_bytes.setdefault(target_bytes[i], i)
        self.shared = {d: by_bytes[text] for d, text in token_bytes(draft_tokenizer).items() if text in by_bytes}
        # Special tokens carry no text: one the target holds too (by its content) carries over
        # as the target's; any other ends the drafts (an end of turn is no text to draft).
        target_special, draft_special = _special_ids(target_tokenizer), _special_ids(draft_tokenizer)
        for content, d in draft_special.items():
            if content in target_special:
                self.shared[d] = target_special[content]
        self.draft_stops = {d for d in draft_special.values() if d not in self.shared}  # its EOS among them
        self.drafts_of: dict[int, list[int]] = {}
        for d, t in self.shared.items():
            self.drafts_of.setdefault(t, []).append(d)

    def draft_bias(self, bias) -> dict[int, float]:
        """A logit bias over the target's tokens, on the draft's tokens of the same text
        (a biased target's choices are the draft's to guess too)."""
        return {d: b for t, b in bias.items() for d in self.drafts_of.get(t, ())}

    def encode_draft(self, text: str) -> list[int]:
        return self.draft(text, add_special_tokens=False)["input_ids"]

    def to_target(self, context: list[int], draft_context: list[int], drafts: list[int],
                  qs: list[common_pb2.SparseDistribution], k: int
                  ) -> tuple[list[int], list[common_pb2.SparseDistribution]]:
        """Up to k drafts in the target's tokens after `context` (the committed history;
        `draft_context` the same in the draft's tokens), and their q where sampled."""
        for i, token in enumerate(drafts):
            if token in self.draft_stops:
                drafts, qs = drafts[:i], qs[:i]
                break
        if qs:
            return self._intersected(drafts, qs, k)
        return self._retokenized(context, draft_context, drafts, k)

    def _intersected(self, drafts: list[int], qs: list[common_pb2.SparseDistribution], k: int):
        out, out_qs = [], []
        for token, q in zip(drafts[:k], qs):
            if token not in self.shared:
                break
            # The mass of the draft's tokens of one target token is that token's.
            kept: dict[int, float] = {}
            for t, p in zip(q.token_ids, q.probs):
                if t in self.shared and p > 0:
                    kept[self.shared[t]] = kept.get(self.shared[t], 0.0) + p
            mass = sum(kept.values())
            out.append(self.shared[token])
            out_qs.append(common_pb2.SparseDistribution(token_ids=list(kept),
                                                        probs=[p / mass for p in kept.values()]))
        return out, out_qs

    def _retokenized(self, context: list[int], draft_context: list[int], drafts: list[int], k: int):
        # The drafts' text as the draft writes it after its last few tokens (a piece's
        # leading space depends on what precedes it), then that text after the target's
        # last few tokens: where those come back as they were, the tokens after them.
        tail_d, tail = draft_context[-8:], context[-8:]
        before = self.draft.decode(tail_d)
        text = self.draft.decode(tail_d + drafts)
        if not text.startswith(before):
            return [], []
        text = text[len(before):].rstrip("\ufffd")  # a character cut short at the end
        if not text:
            return [], []
        ids = self.target(self.target.decode(tail) + text, add_special_tokens=False)["input_ids"]
        if ids[:len(tail)] == tail:
            return ids[len(tail):][:k], []
        return self.target(text, add_special_tokens=False)["input_ids"][:k], []


@dataclass
class Aligned:
    """A request's history in the draft's tokens: the text of its first `stable` target
    tokens as `stable_ids` (chunks tokenized once, cut where a target token starts a new
    word), then the rest's, tokenized anew at each call."""
    bridge: Bridge
    stable: int = 0
    stable_ids: list[int] = field(default_factory=list)
    sent: list[int] = field(default_factory=list)  # what the drafter was last sent

    def draft_history(self, history: list[int]) -> list[int]:
        if len(history) < self.stable:  # never: the history only grows; a new one starts again
            self.stable, self.stable_ids = 0, []
        if len(history) - self.stable > 2 * CHUNK:
            cut = self._cut(history, len(history) - CHUNK)
            self.stable_ids = self.stable_ids + self.bridge.encode_draft(self._text(history, self.stable, cut))
            self.stable = cut
        return self.stable_ids + self.bridge.encode_draft(self._text(history, self.stable, len(history)))

    def _text(self, history: list[int], start: int, end: int) -> str:
        """The text of history[start:end] as it reads after what precedes it: decoded
        alone, a run of tokens can read otherwise (a SentencePiece decoder strips the
        space its first token starts with)."""
        target, before = self.bridge.target, history[max(0, start - 8):start]
        head, whole = target.decode(before), target.decode(before + history[start:end])
        return whole[len(head):] if whole.startswith(head) else target.decode(history[start:end])

    def _cut(self, history: list[int], at: int) -> int:
        """A position near `at` whose token starts with a space (a word's start, where
        tokenizers split text anyway), else one where a character ends (text without
        spaces: a cut inside a character would keep its part as U+FFFD)."""
        lowest = max(self.stable + 1, at - 16)
        for i in range(at, lowest, -1):
            if self._text(history, i, i + 1).startswith((" ", "\n")):
                return i
        for i in range(at, lowest, -1):
            if not self.bridge.target.decode(history[max(0, i - 8):i]).endswith("\ufffd"):
                return i
        return at

    def kept(self, drafted: list[int]) -> int:
        """How many of the draft tokens the drafter was last sent still hold."""
        return common_prefix(self.sent, drafted)
