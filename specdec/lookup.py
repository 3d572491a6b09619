"""Prompt lookup: the tokens that followed the latest earlier occurrence of a history's
last n tokens, for the longest n in [min_n, max_n] that occurred. The drafter drafts
with it (the n-gram and hybrid proposers); the orchestrator runs the same rule on its
own history to know, before a round, whether the drafter will draft it by lookup."""


def suffix_match(tokens: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """Up to k tokens following the latest earlier occurrence of tokens[-n:], longest n
    first; [] when no suffix of at least min_n tokens occurred before."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        for i in range(len(tokens) - n - 1, -1, -1):
            if tokens[i:i + n] == suffix:
                return tokens[i + n:i + n + k]
    return []


class LookupIndex:
    """`suffix_match` over a history that only grows, in time independent of its length:
    for each n-gram, where the tokens after its latest occurrence start (the orchestrator
    asks after every token of a run; a scan would cost the whole history each time). With
    a `memory`, an earlier output's match is taken where it is longer than the history's
    own (or the history has none)."""

    def __init__(self, max_n: int, min_n: int, memory: "OutputMemory | None" = None):
        self.max_n, self.min_n, self.memory = max_n, min_n, memory
        self.tokens: list[int] = []
        self.follows: dict[tuple[int, ...], int] = {}  # n-gram -> start of what followed it last
        self.from_memory = False  # whether the last match came from the memory

    def update(self, history: list[int]) -> None:
        """Takes in the tokens `history` has beyond those already seen (it only grows)."""
        for token in history[len(self.tokens):]:
            end = len(self.tokens)  # the n-grams ending just before this token are now followed
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self.follows[tuple(self.tokens[end - n:end])] = end
            self.tokens.append(token)

    def match(self, k: int) -> list[int]:
        """The history's own match; with a memory, an earlier output's where it is longer."""
        tokens, n = self.tokens, min(self.max_n, len(self.tokens) - 1)
        for n in range(n, self.min_n - 1, -1):
            start = self.follows.get(tuple(tokens[-n:]))
            if start is not None:
                break
        else:
            n, start = 0, None
        self.from_memory = False
        if self.memory is not None:
            _, found = self.memory.match(tokens, k, shortest=n + 1)
            if found:
                self.from_memory = True
                return found
        return tokens[start:start + k] if start is not None else []


class OutputMemory:
    """Recent requests' outputs, shared by every request: where a request's own history
    holds no match, its lookup drafts are what followed the same tokens in an earlier
    output. Agents, retries and templated reports repeat earlier outputs (SuffixDecoding,
    Oliaro et al., drafts from a suffix tree over past outputs; here the rule is the
    requests' own: the longest suffix of min_n to max_n tokens, its latest occurrence).
    Bounded: once more than `max_tokens` are held, the oldest outputs leave first."""

    def __init__(self, max_tokens: int, max_n: int, min_n: int):
        self.max_tokens, self.max_n, self.min_n = max_tokens, max_n, min_n
        self.outputs: dict[int, list[int]] = {}  # in the order added
        self.held, self.added = 0, 0
        self.follows: dict[tuple[int, ...], tuple[int, int]] = {}  # n-gram -> (output, where what followed starts)

    def add(self, tokens: list[int]) -> None:
        if len(tokens) < 2 or len(tokens) > self.max_tokens:
            return
        number, self.added = self.added, self.added + 1
        self.outputs[number] = tokens
        self.held += len(tokens)
        for key, end in self._ngrams(tokens):
            self.follows[key] = (number, end)
        while self.held > self.max_tokens:
            self._drop(next(iter(self.outputs)))

    def _drop(self, number: int) -> None:
        tokens = self.outputs.pop(number)
        self.held -= len(tokens)
        for key, _ in self._ngrams(tokens):
            if self.follows.get(key, (None,))[0] == number:  # a later output may hold it now
                del self.follows[key]

    def _ngrams(self, tokens: list[int]):
        """(n-gram, where what followed it starts) for each n-gram of min_n to max_n tokens."""
        for end in range(1, len(tokens)):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                yield tuple(tokens[end - n:end]), end

    def match(self, tokens: list[int], k: int, shortest: int = 1) -> tuple[int, list[int]]:
        """Up to k tokens that followed the longest suffix of `tokens` (of at least
        `shortest` and min_n, at most max_n tokens) in the latest output holding it:
        (the suffix's length, the drafts); (0, []) if none did."""
        for n in range(min(self.max_n, len(tokens)), max(shortest, self.min_n) - 1, -1):
            found = self.follows.get(tuple(tokens[-n:]))
            if found is not None:
                number, start = found
                return n, self.outputs[number][start:start + k]
        return 0, []
