"""The per-round K choice, against costs and acceptance it is fed (no services)."""

import math
import random

import pytest

from orchestrator.kpolicy import PROBE_SHARE, RUN_MAX, AdaptiveK, FixedK, RoundCosts, expected_tokens
from specdec.api.verifier.v1.verifier_pb2 import BatchPass


def feed(policy: AdaptiveK, alpha_accepts, draft_per_token: float, verify_base: float, verify_per_token: float,
         rounds: int = 200):
    """Runs `rounds` rounds where every draft is accepted while alpha_accepts(i) says so."""
    chosen = []
    for r in range(rounds):
        k = policy.choose()
        accepted = 0
        while accepted < k and alpha_accepts(r, accepted):
            accepted += 1
        policy.observe(k, accepted, draft_per_token * k if k else None, verify_base + verify_per_token * k)
        chosen.append(k)
    return chosen


def test_expected_tokens():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_fixed_k_is_what_was_asked():
    policy = FixedK(3)
    policy.observe(3, 0, 0.1, 1.0)
    assert policy.choose() == 3


def test_cheap_draft_and_high_acceptance_picks_a_large_k():
    policy = AdaptiveK(RoundCosts(), k_max=8, k_start=4, seed=0)
    # alpha ~0.9 (one rejection every 10 drafts), drafting 1% of a verify, verify nearly flat in K.
    chosen = feed(policy, lambda r, i: (r * 7 + i) % 10 != 0, 0.001, 0.1, 0.002)
    assert sorted(chosen[-50:])[25] >= 6


def test_speculation_that_does_not_pay_falls_back_to_the_target_alone():
    policy = AdaptiveK(RoundCosts(), k_max=8, k_start=4, seed=0)
    # Nothing is ever accepted: every draft token is pure cost.
    chosen = feed(policy, lambda r, i: False, 0.01, 0.1, 0.02)
    tail = chosen[-64:]
    assert tail.count(0) >= 56  # K = 0 but for the periodic probes
    assert max(tail) <= 1


def test_costly_verify_per_token_limits_k():
    policy = AdaptiveK(RoundCosts(), k_max=8, k_start=4, seed=0)
    # alpha ~0.6 and each extra verified token costs 20 % of a step (a CPU): a small K.
    # (Drawn at random: a fixed pattern can line up with the probe rounds.)
    rng = random.Random(2)
    chosen = feed(policy, lambda r, i: rng.random() < 0.6, 0.005, 0.1, 0.02)
    median = sorted(chosen[-50:])[25]
    assert 1 <= median <= 3


def test_alpha_estimate_follows_the_request():
    costs = RoundCosts()
    policy = AdaptiveK(costs, k_max=4, k_start=4)
    for _ in range(100):
        policy.observe(4, 2, 0.01, 0.1)  # two accepted, then a rejection: alpha = 2/3
    assert policy.alpha == pytest.approx(2 / 3, abs=0.02)
    assert costs.alpha == pytest.approx(2 / 3, abs=0.05)


def chosen_under_load(rows: int, rounds: int = 300, tail: list | None = None) -> int:
    """Median K of the last rounds when every verifier pass runs `rows` sessions drafting
    alike: a pass costs 50 ms + 2 ms per token (a GPU-like curve), a draft 2 ms per token,
    alpha ~0.8."""
    policy = AdaptiveK(RoundCosts(), k_max=8, k_start=4, seed=0)
    chosen = []
    for r in range(rounds):
        k = policy.choose()
        accepted = 0
        while accepted < k and (r * 7 + accepted) % 5 != 0:
            accepted += 1
        tokens = rows * (k + 1)
        seconds = 0.05 + 0.002 * tokens
        policy.observe(k, accepted, 0.002 * k if k else None, seconds + 0.005, BatchPass(rows=rows, tokens=tokens, seconds=seconds))
        chosen.append(k)
    if tail is not None:
        tail.extend(chosen[-100:])
    return sorted(chosen[-100:])[50]


def test_k_falls_smoothly_to_zero_as_the_verifier_fills():
    ks = [chosen_under_load(rows) for rows in (1, 4, 16, 64)]
    assert ks == sorted(ks, reverse=True), ks  # more sessions per pass: never a larger K
    assert ks[0] >= 4 and ks[-1] == 0, ks
    assert len(set(ks)) >= 3, ks  # through intermediate Ks, not one cliff


def test_probes_thin_out_as_passes_fill():
    """With 64 sessions per pass, a session probes a K other than 0 far less often than
    one in 16 rounds: the deployment as a whole still probes about as often."""
    tail = []
    assert chosen_under_load(64, rounds=600, tail=tail) == 0
    assert tail.count(0) >= 98, tail


@pytest.mark.parametrize("min_gain", [0.0, 0.1])
def test_a_near_tie_keeps_the_target_alone(min_gain):
    """K = 1 promises ~7% more than K = 0 here: without a margin it is taken, with the
    default margin the target alone is kept (probes aside)."""
    policy = AdaptiveK(RoundCosts(), k_max=4, k_start=2, seed=0, min_gain=min_gain)
    rng = random.Random(1)
    for r in range(400):
        k = policy.choose()
        accepted = min(k, 1) if rng.random() < 0.25 else 0  # alpha ~0.25
        policy.observe(k, accepted, 0.002 * k if k else None, 0.1 + 0.015 * k)
    tail = [policy.choose() for _ in range(64)]
    if min_gain:
        assert tail.count(0) >= 56, tail
    else:
        assert tail.count(1) >= 56, tail


@pytest.mark.parametrize("alpha", [0.0, 0.17, 0.3])
def test_poor_drafts_cost_a_fresh_deployment_almost_nothing(alpha):
    """A fresh deployment on a CPU-like curve (each verified token +30% of a step, a draft
    step 10% of one) and drafts that rarely pass: the first requests never run a long
    round, and commit tokens at >= 97% of the rate of K = 0 (the learning rounds and the
    probes are all they pay). The first rounds used to try K = 4."""
    costs, rng = RoundCosts(), random.Random(0)
    step = 0.05
    for request in range(3):
        policy = AdaptiveK(costs, k_max=8, k_start=4, seed=request)
        tokens, seconds = 0, 0.0
        while tokens < 64:
            k = policy.choose()
            assert k <= 1
            accepted = 0
            while accepted < k and rng.random() < alpha:
                accepted += 1
            draft = 0.1 * step * k if k else None
            pass_s = step * (1 + 0.3 * k)
            policy.observe(k, accepted, draft, pass_s + 0.002, BatchPass(rows=1, tokens=k + 1, seconds=pass_s))
            tokens += accepted + 1
            seconds += (draft or 0.0) + pass_s + 0.002
        assert tokens / seconds >= 0.97 / (step + 0.002), (request, tokens / seconds * (step + 0.002))


@pytest.mark.parametrize("alpha", [0.0, 0.3])
def test_the_target_alone_is_priced_as_it_runs(alpha):
    """K = 0 decodes in runs with no call per token (17 ms a step, 0.3 ms beyond it),
    while a speculative round pays a 5 ms call: on a CPU-like curve with poor drafts, a
    fresh deployment's requests keep >= 97% of the runs' rate, probes included. A run
    lasts until the next probe, and probes that find the target alone best come ever
    later."""
    costs, rng = RoundCosts(), random.Random(0)
    step, call, beyond = 0.017, 0.005, 0.0003
    for request in range(3):
        policy = AdaptiveK(costs, k_max=8, k_start=4, seed=request)
        tokens, seconds, runs = 0, 0.0, []
        while tokens < 128:
            k = policy.choose()
            if k == 0:
                n = policy.run_length(128 - tokens)
                runs.append(n)
                policy.observe_run(n, n * (step + beyond), [BatchPass(rows=1, tokens=1, seconds=step)] * n)
                tokens, seconds = tokens + n, seconds + n * (step + beyond)
                continue
            accepted = 0
            while accepted < k and rng.random() < alpha:
                accepted += 1
            draft, pass_s = 0.1 * step * k, step * (1 + 0.1 * k)
            policy.observe(k, accepted, draft, pass_s + call, BatchPass(rows=1, tokens=k + 1, seconds=pass_s))
            tokens, seconds = tokens + accepted + 1, seconds + draft + pass_s + call
        assert max(runs) == RUN_MAX  # runs go to the next probe, and probes come later as they fail
        assert tokens / seconds >= 0.97 / (step + beyond), (request, tokens / seconds * (step + beyond))


def test_runs_end_at_the_budget_and_at_the_next_probe():
    policy = AdaptiveK(RoundCosts(), k_max=4, k_start=4, probe_every=16)
    assert policy.choose() == 0  # K = 0 is learned first
    assert policy.run_length(100) == 15 and policy.run_length(4) == 4
    policy.observe_run(15, 0.3, [])
    assert policy.rounds == 15
    assert FixedK(0).run_length(100) == 32 and FixedK(0).run_length(5) == 5 and FixedK(3).run_length(100) == 1


def lookup_deployment(lookup_alpha: float, rounds: int = 300, seed: int = 0, match: int = 8,
                      lookup_k_max: int | None = None):
    """A CPU-like deployment where model drafts never pay (alpha 0.1) and every third
    round the history holds a `match`-token lookup match whose drafts pass with
    lookup_alpha; a lookup draft costs only the drafter call (1 ms). -> (policy, K chosen
    at matches)"""
    costs, rng = RoundCosts(), random.Random(seed)
    step, call = 0.017, 0.002
    policy = AdaptiveK(costs, k_max=8, k_start=4, seed=seed, lookup_k_max=lookup_k_max)
    at_matches = []
    for r in range(rounds):
        matched = match if r % 3 == 0 else 0
        k = policy.choose(matched)
        if k == 0:
            policy.observe_run(1, step, [BatchPass(rows=1, tokens=1, seconds=step)])
            continue
        lookup = policy.by_lookup
        alpha = lookup_alpha if lookup else 0.1
        accepted = 0
        while accepted < k and rng.random() < alpha:
            accepted += 1
        draft = 0.001 if lookup else 0.1 * step * k
        pass_s = step * (1 + 0.05 * k)
        policy.observe(k, accepted, draft, pass_s + call, BatchPass(rows=1, tokens=k + 1, seconds=pass_s),
                       lookup=lookup)
        if lookup:
            at_matches.append(k)
    return policy, at_matches


def test_lookup_rounds_are_chosen_where_the_match_pays():
    """Model drafts that never pay leave K = 0 for plain rounds, while a long lookup match
    whose drafts pass gets a long round: the two sources keep their own acceptance."""
    policy, at_matches = lookup_deployment(0.9)
    assert sorted(at_matches[-30:])[15] >= 4
    assert policy.lookup_alpha > 0.8 and policy.alpha < 0.3
    assert policy.choose(0) == 0 or policy.rounds % policy.probe_period() == 0
    assert policy.lookup_pays(8) and not policy.lookup_pays(0)


def test_a_long_match_that_passes_drafts_past_the_models_k():
    """Lookup drafts cost no drafting: where a 24-token match passes, the round goes as
    far as the pass's price and the acceptance pay, up to lookup_k_max, not the model's K."""
    _, capped = lookup_deployment(0.97, match=24)
    _, free = lookup_deployment(0.97, match=24, lookup_k_max=16)
    assert max(capped) <= 8
    assert sorted(free[-30:])[15] > 8 and max(free) <= 16


def test_lookup_rounds_that_fail_fall_back_to_the_target_alone():
    policy, at_matches = lookup_deployment(0.05)
    assert at_matches[0] == 1  # the deployment's first lookup round tries one draft
    assert max(at_matches[1:]) <= 1 and len(at_matches) <= 10  # then probes only, of 100 matches
    assert not policy.lookup_pays(8)


def greedy_request(costs: RoundCosts, alpha: float, rng: random.Random, tokens: int = 600, probe_s: float = 0.0):
    """One greedy request on a CPU-like curve, where a probe beside a run adds `probe_s`
    to the run's steps. -> (K chosen each round, and for each probe beside a run the
    round it was asked for at)"""
    step, call = 0.017, 0.005
    policy = AdaptiveK(costs, k_max=4, k_start=4, seed=0, probes_beside_runs=True)
    ks, besides, done = [], [], 0
    while done < tokens:
        k = policy.choose()
        ks.append(k)
        if k == 0:
            probe_k, n = policy.beside_run(), policy.run_length(tokens - done)
            steps_s = (n - 1) * step + (probe_s if probe_k else 0.0)
            policy.observe_run(n, step + steps_s, [BatchPass(rows=1, tokens=1, seconds=step)] * n,
                               steps_s=steps_s, probed=bool(probe_k), answered=bool(probe_k))
            if probe_k:
                besides.append(len(ks) - 1)
                accepted = 0
                while accepted < probe_k and accepted < n and rng.random() < alpha:
                    accepted += 1
                policy.observe_beside(probe_k, accepted, 0.1 * step * probe_k)
            done += n
            continue
        accepted = 0
        while accepted < k and rng.random() < alpha:
            accepted += 1
        pass_s = step * (1 + 0.1 * k)
        policy.observe(k, accepted, 0.1 * step * k, pass_s + call, BatchPass(rows=1, tokens=k + 1, seconds=pass_s))
        done += accepted + 1
    return ks, besides


def test_greedy_probes_go_beside_runs():
    """A greedy request whose target alone is best probes without a round: choose() says
    K = 0 and beside_run() asks for drafts to check against the run. Poor drafts then cost
    no round at all: even the deployment's first measure of K = 1 is drafts beside its
    second run; a later request whose drafts pass turns speculation on from what the runs
    told alone."""
    costs, rng = RoundCosts(alpha_prior=0.2), random.Random(0)
    ks, besides = greedy_request(costs, 0.2, rng)
    assert max(ks) == 0 and besides[0] == 1 and len(besides) >= 2
    ks, besides = greedy_request(costs, 0.95, rng)
    first = next(i for i, k in enumerate(ks) if k > 0)
    assert ks[0] == 0 and besides and besides[0] < first  # turned on by a probe beside a run
    assert sorted(ks[-20:])[10] >= 3  # long rounds


def test_a_new_request_starts_from_the_deployments_probe_wait():
    """Probes that found the target alone best make the next wait longer for the whole
    deployment: a short request after them runs as the target alone, no run cut for a
    probe; where drafts pay again, probes come every `probe_every` rounds again."""
    costs, rng = RoundCosts(alpha_prior=0.2), random.Random(0)
    greedy_request(costs, 0.2, rng)
    assert costs.backoff == 8
    ks, besides = greedy_request(costs, 0.2, rng, tokens=48)
    assert ks == [0, 0] and besides == []  # one run to 32 (RUN_MAX), one to the end
    greedy_request(costs, 0.95, rng)  # drafts that pass turn speculation on
    assert costs.backoff == 1


def test_runs_measure_what_a_probe_beside_them_costs():
    """The steps (after its first token) of a run whose probe answered, beyond an
    unprobed run's, are the probe's cost: none known before an unprobed run, never below
    0. A run that outlasted its probe measures nothing, nor is it an unprobed run."""
    costs, step = RoundCosts(), 0.005
    costs.observe_run(16, 16 * step, [], steps_s=15 * step + 0.037, probed=True, answered=True)
    assert costs.probe_cost is None and costs.run_step is None
    costs.observe_run(16, 16 * step + 0.004, [], steps_s=15 * step)
    costs.observe_run(1, 0.009, [], steps_s=0.0)  # a one-token run has no steps after its first
    assert costs.run_step == pytest.approx(step)
    costs.observe_run(16, 16 * step, [], steps_s=15 * step + 0.002, probed=True)  # the probe did not answer
    assert costs.probe_cost is None and costs.run_step == pytest.approx(step)
    costs.observe_run(16, 16 * step, [], steps_s=15 * step + 0.037, probed=True, answered=True)
    assert costs.probe_cost == pytest.approx(0.037)
    assert costs.run_step == pytest.approx(step)  # probed runs are not the unprobed step
    costs.observe_run(16, 16 * step, [], steps_s=14 * step, probed=True, answered=True)  # faster: noise, not a gain
    assert costs.probe_cost == pytest.approx(0.037 / 2)  # the mean of the first few
    for _ in range(20):
        costs.observe_run(16, 16 * step, [], steps_s=15 * step + 0.010, probed=True, answered=True)
    assert costs.probe_cost == pytest.approx(0.010, rel=0.01)  # then a running average


def test_probes_beside_runs_wait_until_they_take_a_small_share_of_the_runs():
    """Where the drafter shares the verifier's cores, a probe slows the run beside it
    (measured on 2 cores: 37 ms over a 16-step run of 5.5 ms steps). Probes then come no
    more often than to take PROBE_SHARE of the target alone's time, so a short request
    after the warm-up makes none; where they cost nothing, every `probe_every` rounds."""
    step = 0.017
    for probe_s, period in ((0.0, 16), (2 * step, round(2 / PROBE_SHARE))):
        costs, rng = RoundCosts(alpha_prior=0.2), random.Random(0)
        costs.observe_run(24, 24 * step, [BatchPass(rows=1, tokens=1, seconds=step)] * 24, steps_s=23 * step)
        costs.observe_run(24, 24 * step, [BatchPass(rows=1, tokens=1, seconds=step)] * 24,
                          steps_s=23 * step + probe_s, probed=True, answered=True)
        costs.observe(1, 0.1 * step, 1.1 * step + 0.005, 0, 0, BatchPass(rows=1, tokens=2, seconds=1.1 * step))
        policy = AdaptiveK(costs, k_max=4, k_start=4, probes_beside_runs=True)
        assert period <= policy.probe_period() <= period + 1  # (rounded up)
        period = policy.probe_period()
        ks, besides = greedy_request(costs, 0.2, rng, tokens=48, probe_s=probe_s)
        # Free probes: at rounds 16 and 32 (where the first found the target alone best, the wait doubled).
        assert max(ks) == 0 and besides == ([] if probe_s else [1, 2])
        costs.rows = 4.0  # a probe slows every row of the passes it shares
        assert policy.probe_period() == 4 * period * (1 if probe_s else costs.backoff)
        # Rounds that probe (a request that samples) are priced by what the rounds measure.
        assert AdaptiveK(costs, k_max=4, k_start=4).probe_period() == 4 * 16 * costs.backoff


def test_a_lookup_round_does_not_stand_in_for_the_models_first_round():
    """A fresh deployment's first model round is K = 1 even after a lookup round of one
    draft: that round priced the pass, not the drafter's model, and taking it for K = 1
    priced the model's drafts at nothing and sent the first request to a K = 4 round
    (measured: a 50 ms drafter call and a rejection for one token)."""
    costs, step = RoundCosts(), 0.007
    policy = AdaptiveK(costs, k_max=8, k_start=4, probes_beside_runs=False)
    assert policy.choose() == 0
    policy.observe_run(4, 4 * step, [BatchPass(rows=1, tokens=1, seconds=step)] * 4)
    policy.observe(1, 1, None, 0.012, BatchPass(rows=1, tokens=2, seconds=0.0065), lookup=True)
    assert costs.tried == {0}
    assert policy.choose() == 1 and not policy.by_lookup
    policy.observe(1, 0, 0.045, 0.012, BatchPass(rows=1, tokens=2, seconds=0.0065))
    assert policy.choose() == 0  # a costly drafter call: no K = 4 round


def test_probes_are_rounds_without_probes_beside_runs():
    for greedy in (False, True):
        costs = RoundCosts(alpha_prior=0.0)  # a deployment of its own: a probe that fails makes the next wait
        policy = AdaptiveK(costs, k_max=4, k_start=4, probe_every=4, probes_beside_runs=greedy)
        costs.tried |= {0, 1}
        costs.plain = 0.017
        costs.observe(1, 0.002, 0.025, 0, 1, BatchPass(rows=1, tokens=2, seconds=0.02))
        chosen = [policy.choose() for _ in range(4)]
        assert chosen[:3] == [0, 0, 0]
        assert (chosen[3], policy.beside_run()) == ((0, 1) if greedy else (1, 0))
        assert policy.beside_run() == 0  # asked for once


def test_greedy_requests_learn_their_lookup_acceptance_from_their_runs():
    """A greedy request tries no lookup round before its runs have checked its matches
    (each token against the lookup's next one); checks that pass turn lookup rounds on,
    checks that fail keep them off, whatever the deployment saw before."""
    costs, step = RoundCosts(), 0.017
    costs.observe_run(16, 16 * step, [BatchPass(rows=1, tokens=1, seconds=step)] * 16)
    costs.observe(1, 0.002, 0.021, 0, 1, BatchPass(rows=1, tokens=2, seconds=0.019))
    copying = AdaptiveK(costs, k_max=8, k_start=4, probes_beside_runs=True)
    copying.choose(8)
    assert not copying.by_lookup and not copying.lookup_pays(8)  # no evidence of its own yet: the model's K
    for _ in range(3):
        copying.observe_beside(1, 1, None, lookup=True)
    assert copying.lookup_pays(8) and copying.choose(8) >= 4 and copying.by_lookup
    fresh = AdaptiveK(costs, k_max=8, k_start=4, probes_beside_runs=True)
    assert not fresh.lookup_pays(8)
    for _ in range(4):
        fresh.observe_beside(1, 0, None, lookup=True)
    fresh.choose(8)
    assert not fresh.lookup_pays(8) and not fresh.by_lookup
    # A request that is not greedy still tries its first match, with one draft.
    sampled = AdaptiveK(costs, k_max=8, k_start=4)
    assert sampled.choose(8) == 1 and sampled.by_lookup


def test_a_request_drafts_by_lookup_as_far_as_its_own_lookup_drafts_have_passed():
    """The deployment's lookup acceptance, near 1 after copying requests, does not buy a
    fresh request a long first lookup round: one passing check allows 2 drafts, and each
    round that passes doubles the reach."""
    costs, step = RoundCosts(), 0.017
    costs.observe_run(16, 16 * step, [BatchPass(rows=1, tokens=1, seconds=step)] * 16)
    for _ in range(50):  # copying requests: long lookup rounds that pass whole, at a low price
        costs.observe(12, 0.0, 0.03, 12, 12, BatchPass(rows=1, tokens=13, seconds=0.029), lookup=True)
    request = AdaptiveK(costs, k_max=8, k_start=4, probes_beside_runs=True, lookup_k_max=16)
    request.observe_beside(1, 1, None, lookup=True)
    assert request.choose(16) == 2
    request.observe(2, 2, 0.0, 0.02, BatchPass(rows=1, tokens=3, seconds=0.019), lookup=True)
    assert request.choose(16) == 6
    request.observe(6, 6, 0.0, 0.025, BatchPass(rows=1, tokens=7, seconds=0.024), lookup=True)
    assert request.choose(16) == 16


def test_a_match_that_does_not_pay_leaves_the_round_to_the_model():
    """A request whose lookup matches fail (a chat answer's short matches) drafts with the
    model at its matches, as it would without them; one whose matches pass drafts them."""
    costs, step = RoundCosts(alpha_prior=0.9), 0.017
    costs.observe_run(16, 16 * step, [BatchPass(rows=1, tokens=1, seconds=step)] * 16)
    for k in (1, 4) * 10:  # model rounds that pass whole
        costs.observe(k, 0.001 * k, 0.019 + 0.001 * k, k, k, BatchPass(rows=1, tokens=k + 1, seconds=0.018 + 0.001 * k))
    failing = AdaptiveK(costs, k_max=8, k_start=4, probes_beside_runs=True)
    for _ in range(4):
        failing.observe_beside(1, 0, None, lookup=True)
    assert failing.choose(8) >= 2 and not failing.by_lookup
    assert failing.choose(0) >= 2 and not failing.by_lookup
    copying = AdaptiveK(costs, k_max=8, k_start=4, probes_beside_runs=True, lookup_k_max=16)
    for _ in range(4):
        copying.observe_beside(1, 1, None, lookup=True)
    assert copying.choose(8) >= 2 and copying.by_lookup


def test_the_target_alone_is_priced_as_if_every_row_ran_it():
    """16 sessions a pass, most of them speculating at K = 1: their passes hold about 30
    tokens, so a run's steps take 60 ms a token (its passes, and the drafter beside them
    on the same cores), though a pass of 16 tokens, every row at K = 0, takes 36 ms.
    Priced at the runs' 60 ms, K = 1 (alpha 0.37, a 10 ms drafter call) looked 15% faster
    and kept everyone speculating; priced as every row at K = 0, it is not."""
    costs = RoundCosts()
    for _ in range(20):  # every row at K = 0
        costs.observe_run(8, 8 * 0.036, [BatchPass(rows=16, tokens=16, seconds=0.036)] * 8)
    for _ in range(40):  # most rows at K = 1
        costs.observe_run(8, 8 * 0.060, [BatchPass(rows=16, tokens=30, seconds=0.050)] * 8)
    policy = AdaptiveK(costs, k_max=4, k_start=2, seed=0)
    for i in range(40):
        policy.observe(1, int(i % 8 < 3), 0.010, 0.052, BatchPass(rows=16, tokens=30, seconds=0.050))
    assert costs.plain == pytest.approx(0.060, rel=0.3)  # what the runs measured
    assert policy.speed(1) > 1.1 / costs.plain  # so K = 1 looked the better ...
    chosen = [policy.choose() for _ in range(64)]
    assert chosen.count(0) >= 60, chosen  # ... but K = 0 is (probes aside)


def test_a_stall_in_a_costs_first_sample_does_not_outweigh_the_next():
    """A warm-up on 2 cores measured a pass of 5 tokens at 52 ms where it takes 11 ms (the
    step 10 ms, not 6: something else was starting), and the deployment hardly drafted
    after it: a cost started from its first sample and weighed each later one by 0.1, so
    the stall kept two thirds of its weight through the warm-up's five rounds, and K = 4
    rounds, priced at it, were not run again to correct it. A cost's first samples now
    count alike, and later ones still move it."""
    costs = RoundCosts()
    for seconds in (0.052, 0.011, 0.011, 0.011, 0.011):
        costs.observe(4, 0.018, seconds, 0, 0, BatchPass(rows=1, tokens=5, seconds=seconds))
    assert costs.verify(4) == pytest.approx(0.0192)  # their mean (it was 37.9 ms)
    for _ in range(30):
        costs.observe(4, 0.018, 0.011, 0, 0, BatchPass(rows=1, tokens=5, seconds=0.011))
    assert costs.verify(4) == pytest.approx(0.011, rel=0.05)


def test_until_a_probe_answers_one_is_priced_at_a_drafter_call():
    """Probes that their runs outlast say nothing of what a probe costs (on 2 cores, a
    warm-up whose probes did not answer measured 0 ms, and a fresh request then probed at
    round 16). Until one answers, a probe beside a run is priced at the drafter's call of
    one draft: here 10 ms against 5.5 ms steps, one probe in about 90 steps, so a
    48-token request makes none. One that answers at no cost to its run (a drafter on a
    node of its own) brings back a probe every `probe_every` rounds."""
    step, draft = 0.0055, 0.010
    costs, rng = RoundCosts(alpha_prior=0.2), random.Random(0)
    costs.observe_run(24, 24 * step, [BatchPass(rows=1, tokens=1, seconds=step)] * 24, steps_s=23 * step)
    for _ in range(2):  # probes still working when their runs ended
        costs.observe_run(24, 24 * step, [BatchPass(rows=1, tokens=1, seconds=step)] * 24, steps_s=23 * step,
                          probed=True)
    policy = AdaptiveK(costs, k_max=4, k_start=4, probes_beside_runs=True)
    assert policy.probe_period() == 16  # no drafter call measured yet: nothing to price a probe by
    costs.observe(1, draft, 1.1 * step + 0.002, 0, 0, BatchPass(rows=1, tokens=2, seconds=1.1 * step))
    assert costs.probe_cost is None
    assert policy.probe_period() == math.ceil(draft / (PROBE_SHARE * step))
    ks, besides = greedy_request(costs, 0.2, rng, tokens=48)
    assert max(ks) == 0 and besides == []
    costs.observe_run(24, 24 * step, [BatchPass(rows=1, tokens=1, seconds=step)] * 24, steps_s=23 * step,
                      probed=True, answered=True)
    assert costs.probe_cost == 0.0 and policy.probe_period() == 16 * costs.backoff


def _run_costs(rows: int, pass_s) -> RoundCosts:
    """A deployment whose passes of R rows took pass_s(tokens) at 1, 2 and 3 tokens a row."""
    costs = RoundCosts()
    for per_row in (1, 2, 3) * 4:
        tokens = rows * per_row
        costs.observe_run(8, 8 * pass_s(tokens), [BatchPass(rows=rows, tokens=tokens, seconds=pass_s(tokens))] * 8)
    costs.rows = rows
    return costs


@pytest.mark.parametrize("rows, pays", [(1, True), (8, False)])
def test_lookup_drafts_within_runs_are_priced_by_the_load(rows, pays):
    """A pass's lookup drafts (the verifier's, within a run) that pass half the time: at one
    row a pass of 2 tokens costs 1.15 of one, so a draft pays; on a curve where, past 8
    tokens, a pass's cost grows nearly with its tokens (16 tokens 1.8x 8), at 8 rows none is
    drafted."""
    def pass_s(tokens):  # 5 ms for one token, 0.75 ms a token more, then 4.5 ms a token past 8
        return 0.005 + 0.00075 * (min(tokens, 8) - 1) + 0.0045 * max(0, tokens - 8)

    policy = AdaptiveK(_run_costs(rows, pass_s), k_max=4, k_start=2, probes_beside_runs=True, lookup_k_max=16)
    for i in range(40):  # what its passes' lookup drafts got: half of the first drafts kept
        policy.observe_beside(1, i % 2, None, lookup=True)
    assert (policy.run_lookup_drafts() > 0) == pays


def test_lookup_drafts_within_runs_are_priced_by_what_they_add_to_the_pass_they_join():
    """The pass curve measured on 2 cores (the default target): at 8 rows one row's draft
    makes the pass 1.11x longer, while a draft in every row makes it 1.62x. Drafts that
    pass 90% of the time would pay if every row drafted (1.9 tokens a row for 1.62x), but
    one row's draft adds 0.9 tokens to 8 for 1.11x: none is drafted at 8 rows, within a
    run or in a lookup round; at one row, where a draft lengthens the pass 1.11x for the
    same 0.9 tokens, they are."""
    ms = {1: 5.86, 2: 6.48, 5: 9.17, 7: 14.52, 8: 16.08, 9: 17.9, 10: 19.15, 12: 21.86, 16: 26.06}
    for rows, pays in ((8, False), (1, True)):
        costs = RoundCosts()
        for _ in range(4):
            costs.observe_run(len(ms), sum(ms.values()) / 1e3,
                              [BatchPass(rows=rows, tokens=t, seconds=s / 1e3) for t, s in ms.items()])
        costs.rows = rows
        policy = AdaptiveK(costs, k_max=4, k_start=2, probes_beside_runs=True, lookup_k_max=16)
        for i in range(60):  # its passes' first lookup drafts: 9 in 10 kept
            policy.observe_beside(1, int(i % 10 != 0), None, lookup=True)
        assert (policy.run_lookup_drafts() > 0) == pays, rows
        assert policy.lookup_pays(16) == pays, rows


def test_lookup_drafts_within_runs_go_as_far_as_they_pay():
    """On a nearly flat pass, drafts that nearly always pass (a copy) may go as far as the
    request allows (the verifier's own rule then grows them as they pass); drafts that
    never pass (on a deployment of such requests): none; a fixed K = 0: none."""
    def flat(tokens):
        return 0.005 + 0.0001 * tokens

    copying = AdaptiveK(_run_costs(1, flat), k_max=4, k_start=2, lookup_k_max=16)
    for _ in range(20):
        copying.observe_beside(4, 4, None, lookup=True)
    assert copying.run_lookup_drafts() == 16
    failing = AdaptiveK(_run_costs(1, flat), k_max=4, k_start=2, lookup_k_max=16)
    for _ in range(20):
        failing.observe_beside(1, 0, None, lookup=True)
    assert failing.run_lookup_drafts() == 0
    assert FixedK(0).run_lookup_drafts() == 0


def test_a_request_that_cannot_check_its_matches_tries_one_lookup_draft_a_pass_until_it_knows():
    """Priced on a deployment whose lookup drafts fail, drafts would never be tried by a
    request whose runs do not check its matches (under a constraint, or sampled): it
    drafts one a pass until its first lookup pass answers; one whose runs check does not."""
    costs = _run_costs(1, lambda tokens: 0.005 + 0.00075 * (tokens - 1))
    for _ in range(40):  # the deployment's earlier requests: lookup drafts that failed
        costs.observe_drafts(1, None, 0, 1, lookup=True)
    for checks, first in ((False, 1), (True, 0)):
        request = AdaptiveK(costs, k_max=4, k_start=2, probes_beside_runs=True, lookup_k_max=16)
        assert request.run_lookup_drafts(checks) == first
        request.observe_beside(1, 0, None, lookup=True)
        assert request.run_lookup_drafts(checks) == 0


def offering_policy(probe_cost: float | None, accepted: float, greedy: bool = True) -> AdaptiveK:
    """A policy whose deployment measured the target's passes of 1 to 3 tokens (7, 8.1 and
    9.8 ms, the default target's on one core) and a probe beside a run costing probe_cost,
    and whose first drafts passed `accepted` of the time."""
    costs = RoundCosts(alpha_prior=accepted)
    for tokens, seconds in ((1, 0.0070), (2, 0.0081), (3, 0.0098)):
        costs.batch_pass.add(tokens, seconds)
    costs.probe_cost = probe_cost
    return AdaptiveK(costs, k_max=4, k_start=2, seed=0, probes_beside_runs=greedy)


def test_drafts_are_offered_to_runs_where_they_pay_beside_them():
    """With --overlap, a drafter on cores of its own (a probe costs the run nothing, or
    none measured yet) whose first drafts pass 55% of the time: offered drafts pay (a pass
    of one token more where the guess held); a drafter whose probes cost the run 2 ms, or
    whose drafts rarely pass, offers none; nor does a sampled request, nor any without
    --overlap."""
    assert offering_policy(0.0, 0.55).run_model_drafts(overlap=True) >= 1
    assert offering_policy(None, 0.55).run_model_drafts(overlap=True) >= 1
    assert offering_policy(0.002, 0.55).run_model_drafts(overlap=True) == 0
    assert offering_policy(0.0, 0.1).run_model_drafts(overlap=True) == 0
    assert offering_policy(0.0, 0.55, greedy=False).run_model_drafts(overlap=True) == 0
    assert offering_policy(0.0, 0.55).run_model_drafts() == 0
    # The pass's price is not extrapolated past the tokens passes have had: at most one more.
    assert offering_policy(0.0, 0.95).run_model_drafts(overlap=True) <= 3
    assert FixedK(0).run_model_drafts(overlap=True) == 0
