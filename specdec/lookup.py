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
