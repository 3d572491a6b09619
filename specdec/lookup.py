"""Prompt lookup: the tokens that followed the latest earlier occurrence of a history's
last n tokens, for the longest n in [min_n, max_n] that occurred. The orchestrator
drafts lookup rounds by it from the history it owns, by the rule an n-gram or hybrid
drafter reports (min_n, max_n); the verifier drafts within runs of the target alone."""


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens a and b share: where a history and what was sent, drafted
    or cached for it part."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def suffix_match(tokens: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """k tokens following the latest earlier occurrence of tokens[-n:], longest n first
    (see `follow`); [] when no suffix of at least min_n tokens occurred before."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        for i in range(len(tokens) - n - 1, -1, -1):
            if tokens[i:i + n] == suffix:
                return follow(tokens, i + n, k)
    return []


def follow(tokens: list[int], start: int, k: int) -> list[int]:
    """k drafts copying tokens[start:] on, where `start` < len(tokens): a copy that reaches
    the end of the tokens goes on copying its own drafts, as the text it copies would. So
    a loop (a greedy small model's "He is tall. He is tall.") drafts k tokens, not one
    period of it (docs/benchmarks.md#figures-behind-the-code)."""
    drafts = tokens[start:start + k]
    period = len(tokens) - start
    while len(drafts) < k:
        drafts.append(drafts[-period])
    return drafts


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
        return follow(tokens, start, k) if start is not None else []


class OutputMemory:
    """Recent requests' outputs, shared by every request: where a request's own history
    holds no match, its lookup drafts follow what came after the same tokens in earlier
    outputs. Agents, retries and templated reports repeat earlier outputs (SuffixDecoding,
    Oliaro et al., drafts from a suffix tree over past outputs, scored by frequency).

    For each n-gram of min_n to max_n tokens it counts the tokens that followed it. A
    draft starts from the history's longest suffix held (of at least `shortest` tokens)
    and walks on token by token: each step takes the continuation seen most often after
    the longest n-gram that ends the drafts so far (the latest at a tie), and the walk
    stops where the product of those steps' frequencies falls below `min_score`. The
    fixed parts of a templated answer then draft far, and a part that each fill changes
    stops the walk instead of drafting the latest fill's words. Bounded: once more than
    `max_tokens` are held, the oldest outputs leave first, and their counts with them.

    It also counts what followed each `long_n`-token context, and a step takes those
    counts where the drafts so far end in one held: short n-grams recur across and within
    answers (JSON keys, a phrase said twice), so a walk on them alone strays from the
    answer it is following (docs/benchmarks.md#figures-behind-the-code), while a long context names that answer."""

    def __init__(self, max_tokens: int, max_n: int, min_n: int, min_score: float = 0.3, long_n: int = 16):
        self.max_tokens, self.max_n, self.min_n, self.min_score = max_tokens, max_n, min_n, min_score
        self.long_n = max(long_n, max_n + 1)
        self.outputs: dict[int, list[int]] = {}  # in the order added
        self.held, self.added = 0, 0
        # n-gram -> {token that followed it: times}, the latest seen last
        self.next: dict[tuple[int, ...], dict[int, int]] = {}
        self.long_next: dict[tuple[int, ...], dict[int, int]] = {}  # the same for long_n-token contexts

    def add(self, tokens: list[int]) -> None:
        if len(tokens) < 2 or len(tokens) > self.max_tokens:
            return
        number, self.added = self.added, self.added + 1
        self.outputs[number] = tokens
        self.held += len(tokens)
        for table, key, token in self._ngrams(tokens):
            counts = table.setdefault(key, {})
            counts[token] = counts.pop(token, 0) + 1  # moved to the end: the latest last
        while self.held > self.max_tokens:
            self._drop(next(iter(self.outputs)))

    def _drop(self, number: int) -> None:
        tokens = self.outputs.pop(number)
        self.held -= len(tokens)
        for table, key, token in self._ngrams(tokens):
            counts = table[key]
            counts[token] -= 1
            if not counts[token]:
                del counts[token]
                if not counts:
                    del table[key]

    def _ngrams(self, tokens: list[int]):
        """(its table, n-gram, the token that followed it) for each n-gram of min_n to
        max_n tokens, and each long_n-token context."""
        for end in range(1, len(tokens)):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                yield self.next, tuple(tokens[end - n:end]), tokens[end]
            if end >= self.long_n:
                yield self.long_next, tuple(tokens[end - self.long_n:end]), tokens[end]

    def _longest(self, tokens: list[int], shortest: int) -> int:
        """The length of the longest suffix of `tokens` held (long_n, or at least
        `shortest` and min_n up to max_n); 0 if none."""
        if len(tokens) >= self.long_n and tuple(tokens[-self.long_n:]) in self.long_next:
            return self.long_n
        for n in range(min(self.max_n, len(tokens)), max(shortest, self.min_n) - 1, -1):
            if tuple(tokens[-n:]) in self.next:
                return n
        return 0

    def match(self, tokens: list[int], k: int, shortest: int = 1) -> tuple[int, list[int]]:
        """Up to k drafts after `tokens`, walked from its longest suffix held (of at least
        `shortest` tokens): (that suffix's length, the drafts); (0, []) if none is held, or
        its first step already scores below min_score."""
        n = self._longest(tokens, shortest)
        context, drafts, score, m = list(tokens[-self.long_n:]), [], 1.0, n
        while m and len(drafts) < k:
            table = self.long_next if m == self.long_n else self.next
            counts = table[tuple(context[-m:])]
            token = max(reversed(counts), key=counts.get)  # the most frequent; at a tie, the latest
            score *= counts[token] / sum(counts.values())
            if score < self.min_score:
                break
            drafts.append(token)
            context = context[1:] + [token] if len(context) == self.long_n else context + [token]
            m = self._longest(context, self.min_n)
        return (n, drafts) if drafts else (0, [])
