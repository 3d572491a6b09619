"""How many tokens to draft each round.

A request that sets num_speculative_tokens gets exactly that K. Otherwise K is chosen
each round to maximise committed tokens per second,

    E(alpha, K) / (t_draft(K) + t_verify(K)),   E = (1 - alpha^(K+1)) / (1 - alpha),

Leviathan's expected tokens per round over the round's measured time: the drafter and
verifier calls as the orchestrator sees them, network included. K = 0 (the target
alone) wins when speculation does not pay. Call costs belong to the deployment and are
shared by all requests (RoundCosts); alpha belongs to the request, starting from the
deployment's running average."""

import random
from dataclasses import dataclass, field


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens one round commits when each draft is accepted with probability alpha."""
    if alpha >= 1.0:
        return k + 1.0
    return (1 - alpha ** (k + 1)) / (1 - alpha)


@dataclass
class _Line:
    """Running averages of a cost per K, read as a line in K (least squares over the Ks
    seen; flat when only one K was seen)."""
    decay: float = 0.9
    by_k: dict[int, float] = field(default_factory=dict)

    def add(self, k: int, seconds: float) -> None:
        old = self.by_k.get(k)
        self.by_k[k] = seconds if old is None else self.decay * old + (1 - self.decay) * seconds

    def __call__(self, k: int) -> float | None:
        if not self.by_k:
            return None
        if k in self.by_k:
            return self.by_k[k]
        ks = list(self.by_k)
        if len(ks) == 1:
            return self.by_k[ks[0]]
        mean_k = sum(ks) / len(ks)
        mean_t = sum(self.by_k.values()) / len(ks)
        slope = sum((x - mean_k) * (self.by_k[x] - mean_t) for x in ks) / sum((x - mean_k) ** 2 for x in ks)
        return max(0.0, mean_t + max(0.0, slope) * (k - mean_k))


class RoundCosts:
    """What rounds cost on this deployment, from every request's rounds."""

    def __init__(self, alpha_prior: float = 0.5, decay: float = 0.99):
        self.draft, self.verify = _Line(), _Line()
        self.decay = decay
        self.accepted, self.tested = alpha_prior, 1.0  # decayed counts over all rounds

    @property
    def alpha(self) -> float:
        return self.accepted / self.tested

    def observe(self, k: int, draft_s: float | None, verify_s: float, accepted: int, tested: int) -> None:
        if draft_s is not None and k > 0:
            self.draft.add(k, draft_s)
        self.verify.add(k, verify_s)
        if tested:
            self.accepted = self.decay * self.accepted + accepted
            self.tested = self.decay * self.tested + tested


class FixedK:
    """The K a request asked for."""

    def __init__(self, k: int):
        self.k = k

    def choose(self) -> int:
        return self.k

    def observe(self, k: int, accepted: int, draft_s: float | None, verify_s: float) -> None:
        pass


class AdaptiveK:
    """K per round from measured acceptance and costs. Until both costs are known for a
    few Ks it tries them (the deployment's first rounds); later, one round in
    `probe_every` tries a neighbour of the best K so that estimates stay current."""

    def __init__(self, costs: RoundCosts, k_max: int, k_start: int, probe_every: int = 16,
                 prior_weight: float = 4.0, seed: int | None = None):
        self.costs, self.k_max, self.k_start = costs, k_max, min(k_start, k_max)
        self.probe_every, self.prior_weight = probe_every, prior_weight
        self.accepted, self.tested, self.rounds = 0, 0, 0
        self.rng = random.Random(seed)

    @property
    def alpha(self) -> float:
        # Rounds stop at the first rejection: accepted drafts are successes, and a round
        # that rejected one adds one failure (the geometric model's estimate).
        prior = self.costs.alpha
        return (self.accepted + self.prior_weight * prior) / (self.tested + self.prior_weight)

    def speed(self, k: int) -> float | None:
        """Predicted committed tokens per second with K = k (None: not yet known)."""
        verify = self.costs.verify(k)
        draft = self.costs.draft(k) if k > 0 else 0.0
        if verify is None or draft is None:
            return None
        return expected_tokens(self.alpha, k) / max(draft + verify, 1e-6)

    def choose(self) -> int:
        self.rounds += 1
        # Learn the costs of K = 0, a middle K and the starting K before trusting them.
        for k in (self.k_start, 0, max(1, self.k_start // 2)):
            if len(self.costs.verify.by_k) < 3 and k not in self.costs.verify.by_k:
                return k
        speeds = {k: self.speed(k) for k in range(self.k_max + 1)}
        known = {k: s for k, s in speeds.items() if s is not None}
        best = max(known, key=known.get) if known else self.k_start
        if self.rounds % self.probe_every == 0:
            neighbour = best + self.rng.choice((-1, 1)) if best > 0 else 1
            return min(self.k_max, neighbour)
        return best

    def observe(self, k: int, accepted: int, draft_s: float | None, verify_s: float) -> None:
        tested = accepted + (1 if accepted < k else 0) if k > 0 else 0
        self.accepted += accepted
        self.tested += tested
        self.costs.observe(k, draft_s, verify_s, accepted, tested)
