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
    asks after every token of a run; a scan would cost the whole history each time)."""

    def __init__(self, max_n: int, min_n: int):
        self.max_n, self.min_n = max_n, min_n
        self.tokens: list[int] = []
        self.follows: dict[tuple[int, ...], int] = {}  # n-gram -> start of what followed it last

    def update(self, history: list[int]) -> None:
        """Takes in the tokens `history` has beyond those already seen (it only grows)."""
        for token in history[len(self.tokens):]:
            end = len(self.tokens)  # the n-grams ending just before this token are now followed
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self.follows[tuple(self.tokens[end - n:end])] = end
            self.tokens.append(token)

    def match(self, k: int) -> list[int]:
        tokens = self.tokens
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            start = self.follows.get(tuple(tokens[-n:]))
            if start is not None:
                return tokens[start:start + k]
        return []
