"""Committed token ids to streamed text, with stop strings.

Each round decodes a window of the last tokens, not the whole output again (that costs
a round O(n), a request O(n²)): the text before the window is kept, and the window
starts CONTEXT tokens before the first token it may change, so a decode that reads its
first token differently (SentencePiece drops a leading space there) only touches text
that is compared and cut off. Where the window's start does not decode as it did, a
later token changed earlier text: that round decodes everything.

Text that could still change is held back until it cannot: an incomplete character,
the start of a stop string, or, for tokenizers that clean up spaces in the decoded
string (transformers' `clean_up_tokenization_spaces`: " ." to ".", " n ' t" to "n't"),
the text from a space that a clean-up could still remove. So the streamed deltas add up
to the full decode; the final text stops before the first stop string."""

CONTEXT = 6  # tokens: a character is at most 4 byte tokens

# Characters back from the end that a clean-up may still change: its patterns start with
# the space they remove, and the longest chain of them (" n ' t" to "n't") spans 6.
CLEANUP_REACH = 6


class TextStream:
    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer = tokenizer
        self.stop = stop
        self.cleans_up = bool(getattr(tokenizer, "clean_up_tokenization_spaces", False))
        self.ids: list[int] = []
        self.text = ""  # the decode of self.ids
        self.sent = 0  # characters of self.text already streamed
        self.stop_hit: str | None = None
        # The window: text[:kept] is what ids[:anchor] decode to whatever follows; the
        # window decodes ids[anchor - CONTEXT:], whose first `context` characters it drops.
        self.anchor = 0
        self.kept = 0
        self.context = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _text_of(self, end: int) -> str | None:
        """The decode of ids[:end], end >= anchor, from the kept text and the window; None
        where a token changed text before the window."""
        window = self._decode(self.ids[max(0, self.anchor - CONTEXT):end])
        if window.startswith(self.context):
            return self.text[:self.kept] + window[len(self.context):]
        return None

    def _advance(self):
        """Moves the window up to CONTEXT tokens behind the end, where the text is settled:
        to an anchor whose context decodes as the start of the window. Only once the
        window has grown by CONTEXT tokens: a move costs two decodes."""
        if len(self.ids) - self.anchor < 2 * CONTEXT:
            return
        for anchor in range(len(self.ids) - CONTEXT, max(self.anchor, len(self.ids) - 2 * CONTEXT), -1):
            start = max(0, anchor - CONTEXT)
            context, window = self._decode(self.ids[start:anchor]), self._decode(self.ids[start:])
            # U+FFFD is text not settled: SentencePiece's byte fallback decodes a run of
            # byte tokens as a whole, so a broken one spreads to the run's whole bytes.
            if "\ufffd" not in window and window.startswith(context) and self.text.endswith(window[len(context):]):
                self.anchor, self.context = anchor, context
                self.kept = len(self.text) - (len(window) - len(context))
                return

    def _find_stop(self, text: str, since: int) -> tuple[int, str] | None:
        hits = [(text.find(s, since), s) for s in self.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        return min(hits) if hits else None

    def add(self, ids: list[int]) -> tuple[list[int], str]:
        """Adds one round's tokens; returns the ids and the text to stream now. After a
        stop string, ids are cut after the token that completed it."""
        before = len(self.ids)
        self.ids.extend(ids)
        text = self._text_of(len(self.ids))
        if text is None:
            self.anchor, self.kept, self.context = 0, 0, ""
            text = self._decode(self.ids)
        since = max(0, self.sent - max((len(s) for s in self.stop), default=0))
        hit = self._find_stop(text, since)
        if hit is not None:
            index, self.stop_hit = hit
            # Keep the tokens up to the one that completed the stop string.
            for end in range(before + 1, len(self.ids) + 1):
                if self._find_stop(self._text_of(end) or self._decode(self.ids[:end]), since) is not None:
                    break
            ids, self.ids = self.ids[before:end], self.ids[:end]
            self.text = text[:index]
            return ids, self._flush()
        self.text = text
        self._advance()
        end = len(text.rstrip("\ufffd"))  # an incomplete UTF-8 character decodes as U+FFFD
        # The start of a stop string is held back; where a clean-up may still remove a space
        # ("n '" + "t" is "n't"), a start with spaces in it too.
        reach = max((len(s) - 1 for s in self.stop), default=0) + (CLEANUP_REACH if self.cleans_up else 0)
        for held in range(min(end - self.sent, reach), 0, -1):
            tail = text[end - held:end]
            if any(s.startswith(tail) or (self.cleans_up and tail.replace(" ", "") and
                                          s.startswith(tail.replace(" ", ""))) for s in self.stop):
                end -= held
                break
        if self.cleans_up:
            space = text.find(" ", max(self.sent, end - CLEANUP_REACH), end)
            end = space if space >= 0 else end
        delta, self.sent = text[self.sent:end], max(self.sent, end)
        return ids, delta

    def _flush(self) -> str:
        delta, self.sent = self.text[self.sent:], len(self.text)
        return delta

    def finish(self) -> str:
        """The text still held back, once no more tokens come."""
        return self._flush()
