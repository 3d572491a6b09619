"""How many tokens to draft each round.

A request that sets num_speculative_tokens gets exactly that K. Otherwise K is chosen
each round to maximise committed tokens per second,

    E(alpha, K) / (t_draft(K) + t_pass(R (K+1)) + t_call),   E = (1 - alpha^(K+1)) / (1 - alpha),

Leviathan's expected tokens per round over the round's measured time: the drafter call,
the verifier's batched forward pass when each of its R rows verifies K+1 tokens, and
what a verifier call takes beyond its pass (network, waiting for the pass). The verifier
reports every pass (rows, tokens, seconds), so the price of K follows the load: as more
sessions share a pass, each extra draft token lengthens every session's pass, and K
falls smoothly to 0 (the target alone) where speculation stops paying; at one stream it
is the unbatched rule. Costs belong to the deployment and are shared by all requests
(RoundCosts); alpha belongs to the request, starting from the deployment's average.

Where the history holds a prompt-lookup match (the drafters' rule, specdec.lookup), the
orchestrator drafts the round itself from the match: its drafts cost no drafter call and
pass far more or far less often than the model's, so those rounds have an acceptance of
their own, and K is chosen among the tokens the match offers (SuffixDecoding's split,
per round), up to what the request's own lookup drafts have earned. Where a lookup
round does not pay, the round is the model's, as if there were no match.

K = 0 is the target alone, and it runs as the target alone would: a run of steps in one
verifier call (Decode), with no call per token. Its price is what runs measured per
token, so speculation must beat the target alone as the deployment serves it; or the
pass of one token per row where that is less (RoundCosts.step)."""

import math
import random
from dataclasses import dataclass, field

from specdec.api.verifier.v1.verifier_pb2 import BatchPass  # a verifier pass as the verifier reports it

# The most steps one run of the target alone decodes: a call's timeout covers its run,
# and between runs the policy looks again.
RUN_MAX = 32
# The most of the target alone's time that probes beside its runs may take (AdaptiveK):
# where the drafter shares the verifier's cores, each probe slows the run it is beside.
PROBE_SHARE = 0.02


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens one round commits when each draft is accepted with probability alpha."""
    if alpha >= 1.0:
        return k + 1.0
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def _running(old: float | None, sample: float, n: int, weight: float) -> float:
    """The n-th sample into an average: the mean of the first ones, then a running
    average that weighs the newest by `weight` (once 1/n falls below it)."""
    return sample if old is None else old + max(weight, 1 / n) * (sample - old)


@dataclass
class _Curve:
    """Running averages of a cost at the points x seen (K, or tokens in a pass): exact
    where seen, linear between neighbours, and beyond the ends the least-squares slope
    over all points (never negative; flat with one point). A point is the mean of its
    first samples, then weighs each new one by 1 - decay: started from its first sample
    alone, a stall there (a warm-up beside a process still starting) kept two thirds of
    its weight through the warm-up's five rounds, and a point the policy then avoids is
    not measured again."""
    decay: float = 0.9
    at: dict[int, float] = field(default_factory=dict)
    seen: dict[int, int] = field(default_factory=dict)

    def add(self, x: int, seconds: float) -> None:
        self.seen[x] = n = self.seen.get(x, 0) + 1
        self.at[x] = _running(self.at.get(x), seconds, n, 1 - self.decay)

    def __call__(self, x: float) -> float | None:
        if not self.at:
            return None
        xs = sorted(self.at)
        if xs[0] <= x <= xs[-1]:
            hi = next(i for i, v in enumerate(xs) if v >= x)
            if xs[hi] == x:
                return self.at[x]
            a, b = xs[hi - 1], xs[hi]
            return self.at[a] + (self.at[b] - self.at[a]) * (x - a) / (b - a)
        end = xs[0] if x < xs[0] else xs[-1]
        return max(0.0, self.at[end] + self.slope() * (x - end))

    def slope(self) -> float:
        if len(self.at) < 2:
            return 0.0
        mean_x = sum(self.at) / len(self.at)
        mean_t = sum(self.at.values()) / len(self.at)
        slope = (sum((x - mean_x) * (t - mean_t) for x, t in self.at.items())
                 / sum((x - mean_x) ** 2 for x in self.at))
        return max(0.0, slope)


class RoundCosts:
    """What rounds cost on this deployment, from every request's rounds: drafter calls
    by K; the verifier's batched pass by the tokens it computes, with the rows a pass
    runs and what a call takes beyond its pass (network, waiting for a pass)."""

    def __init__(self, alpha_prior: float = 0.5, decay: float = 0.99):
        self.draft, self.batch_pass = _Curve(), _Curve()
        self.draft.add(0, 0.0)  # drafting nothing costs nothing: one K seen gives a slope
        self.decay = decay
        self.rows, self.overhead = 1.0, 0.0  # running averages
        self.tried: set[int] = set()  # K = 0 once a run measured it; K > 0 once the model drafted it
        self.accepted, self.tested = alpha_prior, 1.0  # decayed counts over all rounds
        self.plain: float | None = None  # seconds per token of the target alone, in runs
        # Rounds drafted by prompt lookup: their drafter calls by K, and their acceptance.
        self.lookup_draft = _Curve()
        self.lookup_draft.add(0, 0.0)
        self.lookup_accepted, self.lookup_tested = alpha_prior, 1.0
        self.lookup_tried = False
        # How many times `probe_every` rounds a probe waits while probes find the target
        # alone best (AdaptiveK): the deployment's, so that a new request starts from it.
        self.backoff = 1
        # A run's seconds per step after its first token, without a probe beside it; and
        # the seconds a probe that answered beside a run added to its steps (running averages).
        self.run_step: float | None = None
        self.probe_cost: float | None = None
        self.probes_measured = 0

    @property
    def lookup_alpha(self) -> float:
        return self.lookup_accepted / self.lookup_tested

    @property
    def alpha(self) -> float:
        return self.accepted / self.tested

    def describe(self) -> str:
        passes = ", ".join(f"{t}: {s * 1e3:.0f}" for t, s in sorted(self.batch_pass.at.items()))
        drafts = ", ".join(f"{k}: {s * 1e3:.0f}" for k, s in sorted(self.draft.at.items()))
        plain = "?" if self.plain is None else f"{self.plain * 1e3:.0f}"
        probe = "?" if self.probe_cost is None else f"{self.probe_cost * 1e3:.0f}"
        return (f"alpha {self.alpha:.2f}, rows {self.rows:.1f}, call beyond pass {self.overhead * 1e3:.0f} ms, "
                f"target alone {plain} ms per token, a probe beside a run {probe} ms, "
                f"pass ms by tokens {{{passes}}}, drafter call ms by K {{{drafts}}}")

    def step(self) -> float:
        """Seconds per token of the target alone: what runs measured, or the pass of one
        token per row where that is less. Priced like verify(k), as if every row ran K = 0:
        a run's steps measured while other sessions speculate share their passes with those
        sessions' drafts (and, on shared cores, the CPU with their drafter), and pricing
        K = 0 at that would make speculation look better the more sessions speculate
        (measured at 16 streams: docs/benchmarks.md#figures-behind-the-code)."""
        batch_pass = self.batch_pass(max(1.0, self.rows))
        return self.plain if batch_pass is None else min(self.plain, batch_pass)

    def verify(self, k: int) -> float | None:
        """A verifier call at K = k when every row of a pass drafts k (SmartSpec's goodput
        view: one session's larger K makes every session's pass longer)."""
        seconds = self.batch_pass(max(1.0, self.rows) * (k + 1))
        return None if seconds is None else seconds + self.overhead

    def observe_drafts(self, k: int, draft_s: float | None, accepted: int, tested: int,
                       lookup: bool = False) -> None:
        """A round's drafts, or drafts checked beside a run: what the drafter took for k, and
        how many of them the target accepted (`tested`: accepted plus the rejection, if any)."""
        if lookup:
            self.lookup_tried = True
            if draft_s is not None:
                self.lookup_draft.add(k, draft_s)
            self.lookup_accepted = self.decay * self.lookup_accepted + accepted
            self.lookup_tested = self.decay * self.lookup_tested + tested
            return  # the model's acceptance is the model's rounds'
        if draft_s is not None and k > 0:
            self.draft.add(k, draft_s)
        if tested:
            self.accepted = self.decay * self.accepted + accepted
            self.tested = self.decay * self.tested + tested

    def observe(self, k: int, draft_s: float | None, verify_s: float, accepted: int, tested: int,
                batch_pass: BatchPass | None = None, lookup: bool = False) -> None:
        self.observe_drafts(k, draft_s, accepted, tested, lookup)
        if batch_pass is None or batch_pass.rows < 1:  # a verifier that does not say: the call is the pass
            batch_pass = BatchPass(rows=1, tokens=k + 1, seconds=verify_s)
        if not lookup:  # a lookup round prices the pass, not the drafter's model at this K
            self.tried.add(k)
        self.batch_pass.add(batch_pass.tokens, batch_pass.seconds)
        self.rows = 0.9 * self.rows + 0.1 * batch_pass.rows
        self.overhead = 0.9 * self.overhead + 0.1 * max(0.0, verify_s - batch_pass.seconds)

    def observe_run(self, tokens: int, seconds: float, passes: list[BatchPass], steps_s: float | None = None,
                    probed: bool = False, answered: bool = False) -> None:
        """A run of the target alone: `tokens` steps in `seconds`, through `passes`;
        `steps_s` of them after its first token, with the drafter probed beside it or not,
        and whether the probe answered before the run ended. The steps of a run whose probe
        answered, beyond an unprobed run's, are what a probe costs. A probe still working
        at the run's end measures nothing: its drafter step in flight finishes after the
        run, on whatever comes next (measured: docs/benchmarks.md#figures-behind-the-code)."""
        self.tried.add(0)
        per_token = seconds / tokens
        self.plain = per_token if self.plain is None else 0.9 * self.plain + 0.1 * per_token
        if steps_s is not None and tokens > 1:
            if not probed:
                per_step = steps_s / (tokens - 1)
                self.run_step = per_step if self.run_step is None else 0.9 * self.run_step + 0.1 * per_step
            elif answered and self.run_step is not None:
                # The first few probes' mean, then a running average: each is noisy.
                extra = max(0.0, steps_s - (tokens - 1) * self.run_step)
                self.probes_measured += 1
                self.probe_cost = _running(self.probe_cost, extra, self.probes_measured, 0.2)
        for batch_pass in passes:
            if batch_pass.rows >= 1:
                self.batch_pass.add(batch_pass.tokens, batch_pass.seconds)
                self.rows = 0.9 * self.rows + 0.1 * batch_pass.rows


class FixedK:
    """The K a request asked for."""

    def __init__(self, k: int):
        self.k = self.k_max = self.lookup_k_max = k
        # A constraint's forced tokens: drafts of its rounds (it never runs the target alone
        # while K > 0, where the verifier would draft them itself).
        self.forced_in_rounds = k > 0
        self.probes_beside_runs = False  # the K asked for is all it runs: no probes
        self.by_lookup = False

    def choose(self, matched: int = 0) -> int:
        self.by_lookup = matched > 0  # where the drafters would draft by lookup, so does the round
        return self.k

    def lookup_pays(self, matched: int) -> bool:
        return False

    def run_lookup_drafts(self, checks: bool = False) -> int:
        return self.k  # under a constraint, what the request asked for (K = 0: the target alone)

    def run_model_drafts(self, overlap: bool = False) -> int:
        return 0  # the K asked for is all it runs

    def run_length(self, budget: int) -> int:
        """Steps of the target alone in one call, when a round drafts nothing."""
        return min(budget, RUN_MAX if self.k == 0 else 1)

    def beside_run(self) -> int:
        return 0

    def observe_run(self, tokens: int, seconds: float, passes: list[BatchPass], steps_s: float | None = None,
                    probed: bool = False, answered: bool = False) -> None:
        pass

    def observe_beside(self, k: int, accepted: int, draft_s: float | None, lookup: bool = False) -> None:
        pass

    def observe(self, k: int, accepted: int, draft_s: float | None, verify_s: float,
                batch_pass: BatchPass | None = None, lookup: bool = False) -> None:
        pass


class AdaptiveK:
    """K per round from measured acceptance and costs. A deployment's first rounds learn
    the costs cheapest first: K = 0, then K = 1 (in a greedy request, drafts beside a run:
    no round), and `k_start` only once K = 1 promised more than K = 0 (poor drafts never
    pay for a long first round). Later, one round in
    `probe_every` tries a neighbour of the best K so that estimates stay current; while
    the probes find the target alone best, each waits twice as long as the last (up to
    `max_backoff` times), so poor drafts cost ever less. That wait is the deployment's
    (RoundCosts.backoff), as its costs and acceptance are: a new request starts from what
    earlier requests' probes found, not from a probe every `probe_every` rounds, and a
    short request on a deployment whose drafts do not pay runs as the target alone
    throughout (each probe cuts a run and puts the drafter's work beside it).

    With `probes_beside_runs` (greedy requests), a probe made while the target alone is
    best is no round: its drafts are asked for beside the next run, and the run's tokens
    say how many a round would have accepted (a greedy round accepts a draft iff it is the
    target's choice). The drafter's time is off the run's path, but a drafter on the
    verifier's cores slows the run's steps: runs measure by how much, and probes wait long
    enough to take at most PROBE_SHARE of the target alone's time.
    Their runs also check, token by token, the next token of any lookup match against the
    target's, so their lookup acceptance is their own before a lookup round is tried.

    Speculation must promise `min_gain` more than the target alone before it is chosen:
    the model does not see everything a draft costs (a drafter on the verifier's cores
    takes CPU from every session's pass; a late row holds the next pass back), and at a
    near tie it measured slower (docs/benchmarks.md#figures-behind-the-code).

    A lookup round may draft up to `lookup_k_max` (default k_max) of the match's tokens:
    they cost no drafting, so only the pass's price and the acceptance bound K (an answer
    that copies its prompt accepts long runs)."""

    def __init__(self, costs: RoundCosts, k_max: int, k_start: int, probe_every: int = 16,
                 prior_weight: float = 4.0, seed: int | None = None, min_gain: float = 0.1,
                 probes_beside_runs: bool = False, lookup_k_max: int | None = None):
        self.costs, self.k_max, self.k_start = costs, k_max, min(k_start, k_max)
        self.lookup_k_max = max(k_max, lookup_k_max or 0)
        # A constraint's forced tokens are drafted by the verifier within the runs of the
        # target alone (a pass checks them with the run's next token, no round trip): a
        # round of them alone costs a call more, and measured slower (docs/benchmarks.md#figures-behind-the-code).
        self.forced_in_rounds = False
        self.probes_beside_runs, self.probe_k = probes_beside_runs, 0
        self.probe_every, self.prior_weight, self.min_gain = probe_every, prior_weight, min_gain
        self.accepted, self.tested, self.rounds = 0, 0, 0
        self.lookup_accepted, self.lookup_tested = 0, 0
        self.rng = random.Random(seed)
        self.max_backoff = 8
        self.by_lookup = False  # whether the K chosen last drafts by lookup (else by the model)

    @property
    def alpha(self) -> float:
        # Rounds stop at the first rejection: accepted drafts are successes, and a round
        # that rejected one adds one failure (the geometric model's estimate).
        prior = self.costs.alpha
        return (self.accepted + self.prior_weight * prior) / (self.tested + self.prior_weight)

    def speed(self, k: int) -> float | None:
        """Predicted committed tokens per second with K = k (None: not yet known)."""
        if k == 0 and self.costs.plain is not None:
            return 1.0 / max(self.costs.step(), 1e-6)
        verify = self.costs.verify(k)
        draft = self.costs.draft(k) if k > 0 else 0.0
        if verify is None or draft is None:
            return None
        return expected_tokens(self.alpha, k) / max(draft + verify, 1e-6)

    @property
    def lookup_alpha(self) -> float:
        prior = self.costs.lookup_alpha
        return (self.lookup_accepted + self.prior_weight * prior) / (self.lookup_tested + self.prior_weight)

    def lookup_speed(self, k: int, call: bool = True) -> float | None:
        """Predicted tokens per second, per row of the pass, where one row drafts k of its
        lookup match: in a lookup round (`call`: it pays its drafter call and what a verifier
        call takes beyond its pass), or within a run (no call). Matches come to a few rows
        at a time, so their price is what they add to the pass they join (the usual rows,
        one token each, and this row's k drafts), not a pass where every row drafts k, as a
        model round's is: on a CPU under load each token of a pass costs nearly what a row
        does (docs/benchmarks.md#figures-behind-the-code). At one row the two prices are the same."""
        rows = max(1.0, self.costs.rows)
        seconds, draft = self.costs.batch_pass(rows + k), self.costs.lookup_draft(k) if call else 0.0
        if seconds is None or draft is None:
            return None
        if call:
            seconds += draft + self.costs.overhead
        return (rows - 1 + expected_tokens(self.lookup_alpha, k)) / rows / max(seconds, 1e-6)

    def _lookup_k(self, matched: int) -> int:
        """The best K for a round drafted by lookup (0: the target alone). How much an
        output copies its context is the request's own (a chat answer rarely does, an edit
        of a text mostly does): a greedy request first learns it from its runs' checks,
        another tries its first match. Either way K grows with what the request's own
        lookup drafts have passed, at most twice that (one draft before any): the
        deployment's acceptance comes from other requests (a copying one drives it near 1),
        and a long round that fails costs a chat request several steps (docs/benchmarks.md#figures-behind-the-code)."""
        reach = min(matched, max(1, 2 * self.lookup_accepted))
        if self.probes_beside_runs:
            if self.lookup_tested == 0:
                return 0  # its runs check its matches first, at no cost
        elif not self.costs.lookup_tried or self.lookup_tested == 0:
            return min(reach, self.k_start)
        speeds = {k: self.lookup_speed(k) for k in range(1, min(reach, self.lookup_k_max) + 1)}
        known = {k: v for k, v in speeds.items() if v is not None}
        base = self.speed(0)
        if not known or base is None:
            return min(reach, self.k_start)
        best = max(known, key=known.get)
        return best if known[best] >= (1 + self.min_gain) * base else 0

    def lookup_pays(self, matched: int) -> bool:
        """Whether a lookup round would now beat the target alone (a run stops for it)."""
        return matched > 0 and self._lookup_k(matched) > 0

    def run_lookup_drafts(self, checks: bool = False) -> int:
        """The most lookup drafts one pass of a run of the target alone may check (0: none).
        The verifier drafts them itself, so they cost no call, only a longer pass: priced
        as a lookup round's drafts are, by what they add to the pass they join, at the
        request's lookup acceptance (lookup_speed), the most that still beat the pass of
        one token per row. Within that bound the verifier drafts one before any passed,
        then up to twice as many as its last lookup drafts kept: a copy's drafts pass in
        runs, which a bound from the request's own passes so far would cut short for the
        whole run; unpriced, they cost more than they saved under load (docs/benchmarks.md#figures-behind-the-code).
        A request whose runs do not check its matches for free (`checks`: a greedy one's
        do, see _target_alone) drafts one a pass until its first lookup pass says what they
        get: priced on the deployment's acceptance alone, a request of another kind than
        the deployment's last ones never learned its own (structured work at one stream:
        1.31x K = 0 in one run of two, its lookup drafts all but never tried)."""
        plain = self.costs.batch_pass(max(1.0, self.costs.rows))
        if plain is None:
            return 0
        floor = (1 + self.min_gain) / max(plain, 1e-6)
        priced = max((k for k in range(1, self.lookup_k_max + 1) if self.lookup_speed(k, call=False) >= floor),
                     default=0)
        return max(priced, 1) if self.lookup_tested == 0 and not checks else priced

    def run_model_drafts(self, overlap: bool = False) -> int:
        """Drafts of the model to offer each pass of a run of the target alone, after the
        drafter's guess of the token the pass in flight decides (0: none; the run gets its
        probe, if one is due). Only with `overlap`: the deployment says its drafters have
        cores of their own (an offer costs the verifier a message to read, beside its
        passes). An offer is used where its guess holds (alpha), and then commits
        expected_tokens(alpha, k) at the price of a pass of k more tokens; where it fails,
        the pass is the usual one. What the drafter's call costs the run is what a probe
        beside a run was measured to add to its steps (none until one has), and offers
        must beat the pass of one token per row by min_gain. The pass's price beyond the
        tokens seen in passes is not extrapolated: k grows one past them at a time. Greedy
        requests only: the guesses checked against the run's tokens are their acceptance."""
        rows = max(1.0, self.costs.rows)
        plain = self.costs.batch_pass(rows)
        if not overlap or not self.probes_beside_runs or self.k_max < 1 or plain is None:
            return 0
        cost = self.costs.probe_cost or 0.0
        a, seen = self.alpha, max(self.costs.batch_pass.at)
        best, best_speed = 0, (1 + self.min_gain) / max(plain, 1e-6)
        for k in range(1, min(self.k_max, max(1, math.floor(seen - rows) + 1)) + 1):
            seconds = a * self.costs.batch_pass(rows + k) + (1 - a) * plain + cost
            speed = (rows - 1 + a * expected_tokens(a, k) + 1 - a) / rows / max(seconds, 1e-6)
            if speed > best_speed:
                best, best_speed = k, speed
        return best

    def choose(self, matched: int = 0) -> int:
        """K for the next round; `matched`: the tokens a lookup match offers, 0 if none.
        Where a lookup round pays, the round drafts by lookup (`by_lookup`); elsewhere the
        model's K is chosen as if there were no match: a short match in a chat answer (or
        in earlier requests' outputs) mostly predicts wrong, and must not keep the model
        from drafting."""
        self.rounds += 1
        self.by_lookup = False
        if matched and 0 in self.costs.tried:
            k = self._lookup_k(matched)
            if k == 0 and not self.probes_beside_runs and self.rounds % self.probe_period() == 0:
                k = 1  # keep this request's lookup acceptance current (greedy requests check it for free)
            if k > 0:
                self.by_lookup = True
                return k
        tried = self.costs.tried
        if 0 not in tried:
            return 0
        if self.k_max >= 1 and 1 not in tried:  # a greedy request learns K = 1 beside a run, at no round's cost
            return self._probe(1)
        speeds = {k: self.speed(k) for k in range(self.k_max + 1)}
        known = {k: s for k, s in speeds.items() if s is not None}
        if self.k_start not in tried and known.get(1, 0.0) > known.get(0, 0.0):
            return self.k_start
        best = max(known, key=known.get) if known else 0
        if best > 0 and 0 in known and known[best] < (1 + self.min_gain) * known[0]:
            best = 0
        if best > 0:
            self.costs.backoff = 1
        if self.rounds % self.probe_period() == 0:
            if best == 0:  # each probe that finds the target alone still best waits longer for the next
                self.costs.backoff = min(self.max_backoff, 2 * self.costs.backoff)
                return self._probe(min(self.k_max, 1))
            return min(self.k_max, best + self.rng.choice((-1, 1)))
        return best

    def _probe(self, k: int) -> int:
        """A probe at K = k while the target alone is best: a round, or drafts beside the
        next run (then this round is that run)."""
        if not self.probes_beside_runs:
            return k
        self.probe_k = k
        return 0

    def beside_run(self) -> int:
        """Drafts to ask for beside the run that starts now (0: none)."""
        k, self.probe_k = self.probe_k, 0
        return k

    def probe_period(self) -> int:
        # Probes cost every session of a pass (a late row holds the pass back); the costs are
        # shared, so with R rows per pass one probe in R rounds per session keeps them current.
        period = self.probe_every * self.costs.backoff
        if self.probes_beside_runs and self.costs.run_step:
            # A probe beside a run slows that run's steps (and those of the rows it shares
            # passes with) where the drafter shares the verifier's cores: probes wait long
            # enough that they take at most PROBE_SHARE of the time (docs/benchmarks.md#figures-behind-the-code). Until a
            # probe has answered beside a run, one is priced at a drafter call of one draft:
            # the CPU it would take from the steps. Probes that the runs outlast say nothing
            # of their cost.
            cost = self.costs.probe_cost if self.costs.probe_cost is not None else self.costs.draft(1)
            if cost:
                period = max(period, math.ceil(cost / (PROBE_SHARE * self.costs.run_step)))
        return period * max(1, round(self.costs.rows))

    def run_length(self, budget: int) -> int:
        """Steps of the target alone in one call after choose() said K = 0: up to the
        next probe (each step counts as a round)."""
        period = self.probe_period()
        return max(1, min(budget, RUN_MAX, period - self.rounds % period))

    def observe_run(self, tokens: int, seconds: float, passes: list[BatchPass], steps_s: float | None = None,
                    probed: bool = False, answered: bool = False) -> None:
        self.rounds += tokens - 1  # choose() counted the first
        self.costs.observe_run(tokens, seconds, passes, steps_s, probed, answered)

    def observe(self, k: int, accepted: int, draft_s: float | None, verify_s: float,
                batch_pass: BatchPass | None = None, lookup: bool = False) -> None:
        tested = self._count(k, accepted, lookup)
        self.costs.observe(k, draft_s, verify_s, accepted, tested, batch_pass, lookup)

    def observe_beside(self, k: int, accepted: int, draft_s: float | None, lookup: bool = False) -> None:
        """Drafts asked for beside a run, checked against its tokens: the acceptance a round
        would have had, and the drafter's time; no verifier cost (there was no round)."""
        tested = self._count(k, accepted, lookup)
        self.costs.observe_drafts(k, draft_s, accepted, tested, lookup)
        if not lookup:  # the drafter's cost and acceptance at k, measured; its pass is priced from the curve
            self.costs.tried.add(k)

    def _count(self, k: int, accepted: int, lookup: bool) -> int:
        tested = accepted + (1 if accepted < k else 0) if k > 0 else 0
        if lookup:
            self.lookup_accepted += accepted
            self.lookup_tested += tested
        else:
            self.accepted += accepted
            self.tested += tested
        return tested
