"""Committed token ids to streamed text, with stop strings.

Text that could still become a stop string, or that ends in an incomplete character,
is held back until it cannot; the final text stops before the first stop string."""


class TextStream:
    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer = tokenizer
        self.stop = stop
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0  # characters of self.text already streamed
        self.stop_hit: str | None = None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _find_stop(self, text: str, since: int) -> tuple[int, str] | None:
        hits = [(text.find(s, since), s) for s in self.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        return min(hits) if hits else None

    def add(self, ids: list[int]) -> tuple[list[int], str]:
        """Adds one round's tokens; returns the ids and the text to stream now. After a
        stop string, ids are cut after the token that completed it."""
        before = len(self.ids)
        self.ids.extend(ids)
        text = self._decode(self.ids)
        since = max(0, self.sent - max((len(s) for s in self.stop), default=0))
        hit = self._find_stop(text, since)
        if hit is not None:
            index, self.stop_hit = hit
            # Keep the tokens up to the one that completed the stop string.
            for end in range(before + 1, len(self.ids) + 1):
                if self._find_stop(self._decode(self.ids[:end]), since) is not None:
                    break
            ids, self.ids = self.ids[before:end], self.ids[:end]
            self.text = text[:index]
            return ids, self._flush()
        self.text = text
        end = len(text.rstrip("\ufffd"))  # an incomplete UTF-8 character decodes as U+FFFD
        for held in range(min(end - self.sent, max((len(s) - 1 for s in self.stop), default=0)), 0, -1):
            if any(s.startswith(text[end - held:end]) for s in self.stop):
                end -= held
                break
        delta, self.sent = text[self.sent:end], max(self.sent, end)
        return ids, delta

    def _flush(self) -> str:
        delta, self.sent = self.text[self.sent:], len(self.text)
        return delta

    def finish(self) -> str:
        """The text still held back, once no more tokens come."""
        return self._flush()
