"""The speculative loop on its own, with both services replaced by deterministic fakes:
the output is the target's, and with overlap every draft the verifier sees was drafted
for exactly the history it is verified against (drafts made ahead are used only for the
round they were made for)."""

import asyncio

import pytest

from orchestrator.links import Step, Verdict
from orchestrator.rounds import speculate
from orchestrator.stats import Stats
from verifier_service.runs import Offers

VOCAB = 50


def target_next(history: list[int]) -> int:
    return (sum(history) * 31 + len(history)) % VOCAB


def draft_next(history: list[int]) -> int:
    # Wrong at about one position in four, unevenly: rounds pass whole sometimes, and
    # fail sometimes.
    token = target_next(history)
    return (token + 1) % VOCAB if sum((i + 1) * x for i, x in enumerate(history)) % 4 == 0 else token


class FakeDrafter:
    lookup_from_memory = False
    lookup_rule = None
    drafts_by_model = True

    def __init__(self):
        self.drafted_for: dict[tuple, list[int]] = {}  # a history -> the drafts made after it
        self.calls = 0

    def lookup_drafts(self, history, k):
        return []

    async def propose(self, history, k, committed=None):
        self.calls += 1
        await asyncio.sleep(0)
        out = []
        for _ in range(k):
            out.append(draft_next(history + out))
        for i in range(len(out)):
            self.drafted_for[tuple(history + out[:i])] = out[i:]
        return out, []


class FakeVerifier:
    features = None

    def __init__(self, drafter: FakeDrafter):
        self.drafter = drafter
        self.offered_passes = 0  # passes that checked offered drafts

    async def verify(self, history, drafts, qs):
        await asyncio.sleep(0)
        if drafts:
            assert drafts == self.drafter.drafted_for[tuple(history)][:len(drafts)], "drafts made for another history"
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == target_next(history + drafts[:accepted]):
            accepted += 1
        return Verdict(accepted, target_next(history + drafts[:accepted]), None)

    async def decode(self, history, max_tokens, stop, draft_forced=False, draft_lookup=None, offers=None):
        """A run; with `offers`, each pass checks the latest offer's drafts after the committed
        history (the verifier's own rule, runs.Offers), as the real run does."""
        history, end, latest = list(history), len(history) + max_tokens, Offers()
        while len(history) < end:
            await asyncio.sleep(0)
            while offers is not None and not offers.empty():
                if (offer := offers.get_nowait()) is not None:
                    latest.offer(offer)
            drafts, _ = latest.after(history, len(history), [])
            drafts = drafts[:end - len(history) - 1]
            if drafts:
                assert drafts == self.drafter.drafted_for[tuple(history)][:len(drafts)], "drafts of another history"
                self.offered_passes += 1
            accepted = 0
            while accepted < len(drafts) and drafts[accepted] == target_next(history + drafts[:accepted]):
                accepted += 1
            for token in drafts[:accepted]:
                history.append(token)
                yield Step(token, None)
                if token in stop:
                    return
            history.append(target_next(history))
            yield Step(history[-1], None, offered=(len(drafts), accepted) if drafts else None)
            if history[-1] in stop:
                return


class Cycle:
    """K per round from a fixed cycle, zeros included; K = 0 decodes runs of 1 to 3 steps."""

    probes_beside_runs = False
    forced_in_rounds = False

    def __init__(self, ks, beside=0, run=None, offer=0):
        self.ks, self.round, self.k_max = ks, 0, max(ks)
        self.offer = offer  # model drafts offered to each pass of a run
        self.runs = []  # tokens of each run of the target alone
        self.probed = []  # and whether a probe went beside it
        self.answered = []  # and answered before the run ended
        self.beside, self.run = beside, run  # drafts asked for beside each run; its fixed length
        self.besides = []  # (k, accepted) of each probe beside a run

    def choose(self, matched=0):
        self.round += 1
        self.by_lookup = matched > 0  # a round at a match drafts by lookup, as FixedK's
        return self.ks[(self.round - 1) % len(self.ks)]

    @property
    def lookup_k_max(self):
        return self.k_max

    def lookup_pays(self, matched):
        return False

    def observe(self, *args):
        pass

    def run_length(self, budget):
        return min(budget, self.run or 1 + self.round % 3)

    def beside_run(self):
        return self.beside

    def run_model_drafts(self, overlap=False):
        return self.offer

    def observe_run(self, tokens, seconds, passes, steps_s=None, probed=False, answered=False):
        assert 0 <= steps_s <= seconds  # the steps after the first token
        assert probed or not answered
        self.runs.append(tokens)
        self.probed.append(probed)
        self.answered.append(answered)

    def observe_beside(self, k, accepted, draft_s, lookup=False):
        self.besides.append((k, accepted, lookup) if lookup else (k, accepted))


def run(prompt, max_new, policy, overlap=False, drafter=None):
    drafter = drafter or FakeDrafter()
    stats = Stats()

    async def go():
        out = []
        async for commit in speculate(prompt, max_new, policy, set(), drafter, FakeVerifier(drafter), stats,
                                      overlap):
            out.extend(commit.tokens)
        return out

    return asyncio.run(go()), stats, drafter


def reference(prompt, max_new):
    history = list(prompt)
    for _ in range(max_new):
        history.append(target_next(history))
    return history[len(prompt):]


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("ks", [[2], [3, 0, 2, 0, 0, 1], [1, 4]])
def test_output_is_the_targets_and_drafts_match_their_history(overlap, ks):
    prompt = [3, 1, 4, 1, 5]
    policy = Cycle(ks)
    out, stats, _ = run(prompt, 60, policy, overlap)
    assert out == reference(prompt, 60)
    if 0 in ks:
        assert max(policy.runs) > 1
    assert 0 < stats.accepted_tokens < stats.draft_tokens
    if overlap:
        assert 0 < stats.lookahead_hits < stats.lookaheads
    else:
        assert stats.lookaheads == 0


def test_a_used_lookahead_saves_the_drafter_call():
    prompt = [2, 7, 1, 8]
    _, plain_stats, plain = run(prompt, 60, Cycle([2]), overlap=False)
    _, stats, overlapped = run(prompt, 60, Cycle([2]), overlap=True)
    # The same rounds; each that drafts either used drafts made ahead or called the
    # drafter itself, and each look-ahead is one more call.
    assert stats.rounds == plain_stats.rounds and stats.lookahead_hits > 0
    assert overlapped.calls == plain.calls - stats.lookahead_hits + stats.lookaheads


def would_accept(history, k):
    """How many of k drafts after `history` a round would accept."""
    drafts, accepted = [], 0
    for _ in range(k):
        drafts.append(draft_next(history + drafts))
    while accepted < k and drafts[accepted] == target_next(history + drafts[:accepted]):
        accepted += 1
    return accepted


def test_probes_beside_runs_learn_what_rounds_would_have_accepted():
    prompt = [3, 1, 4, 1, 5]
    policy = Cycle([0], beside=2, run=4)
    out, stats, drafter = run(prompt, 60, policy, overlap=False)
    assert out == reference(prompt, 60)
    assert stats.rounds_by_k == {0: 60} and stats.draft_tokens == 0  # no round verified a draft
    # Each run's probe drafted after the history the run started from.
    starts = [len(prompt) + 4 * i for i in range(15)]
    history = prompt + out
    assert policy.besides == [(2, would_accept(history[:n], 2)) for n in starts]
    assert stats.probes_beside_runs == 15 == drafter.calls
    assert {0, 1} <= {a for _, a in policy.besides}  # drafts missed, and drafts a round would have kept
    # The policy learns what its runs' probes cost them: each answered within its run.
    assert policy.probed == policy.answered == [True] * 15
    unprobed = Cycle([0], run=4)
    run(prompt, 8, unprobed)
    assert unprobed.probed == unprobed.answered == [False, False]


class SlowDrafter(FakeDrafter):
    async def propose(self, history, k, committed=None):
        self.calls += 1
        await asyncio.sleep(3600)


def test_a_probe_the_drafter_answers_after_its_run_is_dropped():
    prompt = [2, 7, 1, 8]
    policy = Cycle([0], beside=2, run=4)
    out, stats, drafter = run(prompt, 20, policy, drafter=SlowDrafter())
    assert out == reference(prompt, 20)
    assert drafter.calls == 5 and policy.besides == [] and stats.probes_beside_runs == 0
    # Each run had a probe beside it, and none answered: what they cost is not measured.
    assert policy.probed == [True] * 5 and policy.answered == [False] * 5


class CheckingDrafter(FakeDrafter):
    """Offers a lookup match after every 3rd token of history: right after a history of
    even length, one token off after an odd one."""

    def lookup_drafts(self, history, k):
        if len(history) % 3:
            return []
        token = target_next(history)
        return [token if len(history) % 2 == 0 else (token + 1) % VOCAB] * k


def test_greedy_runs_check_the_lookup_next_token():
    prompt = [3, 1, 4, 1, 5, 9]
    policy = Cycle([0], run=8)
    policy.probes_beside_runs, policy.k_max = True, 4
    out, stats, drafter = run(prompt, 40, policy, drafter=CheckingDrafter())
    assert out == reference(prompt, 40)
    # One check per token produced after a history holding a match, the last one excepted
    # (nothing comes after it), each a hit exactly where the match was right.
    lengths = [n for n in range(len(prompt), len(prompt) + 40) if n % 3 == 0]
    assert policy.besides == [(1, int(n % 2 == 0), True) for n in lengths]
    assert stats.lookups_checked == len(lengths) and drafter.calls == 0


class LookupDrafter(FakeDrafter):
    """Offers a lookup match after every 5th token of history."""

    def lookup_drafts(self, history, k):
        drafts = [0] * min(k, 3) if len(history) % 5 == 0 else []
        if drafts:
            self.drafted_for[tuple(history)] = drafts  # what the verifier may see for this history
        return drafts


class LookupPolicy(Cycle):
    """K = 0 in runs of up to 8 steps, K = 3 wherever a lookup match is offered."""

    def __init__(self):
        super().__init__([0])
        self.k_max, self.lookups = 3, []

    def choose(self, matched=0):
        self.round += 1
        self.by_lookup = matched > 0
        return 3 if matched else 0

    def lookup_pays(self, matched):
        return matched > 0

    def run_length(self, budget):
        return min(budget, 8)

    def observe(self, k, accepted, draft_s, verify_s, batch_pass=None, lookup=False):
        self.lookups.append(lookup)


def test_a_run_stops_where_a_lookup_round_pays_and_the_output_is_the_targets():
    prompt = [3, 1, 4, 1, 5, 9, 2]
    policy = LookupPolicy()
    out, stats, drafter = run(prompt, 60, policy, drafter=LookupDrafter())
    assert out == reference(prompt, 60)
    assert stats.runs_cut > 0 and stats.lookup_rounds == sum(policy.lookups) > 0
    assert max(policy.runs) <= 5  # cut at the next match, well before its 8 steps
    assert drafter.calls == 0  # a lookup round is the verifier's pass alone: no drafter call
    assert stats.memory_rounds == 0 and stats.lookup_accepted <= 3 * stats.lookup_rounds


def test_lookup_rounds_drafted_from_earlier_outputs_are_counted_apart():
    drafter = LookupDrafter()
    drafter.lookup_from_memory = True  # every match found in the memory of earlier outputs
    out, stats, _ = run([3, 1, 4, 1, 5, 9, 2], 60, LookupPolicy(), drafter=drafter)
    assert out == reference([3, 1, 4, 1, 5, 9, 2], 60)
    assert stats.memory_rounds == stats.lookup_rounds > 0 and stats.memory_accepted == stats.lookup_accepted


class OutgrownDrafter(LookupDrafter):
    """A hybrid drafter whose model the history outgrows at its first call (as past its
    model's positions): no model drafts from then on; its lookup rule still holds."""

    def __init__(self):
        super().__init__()
        self.drafts_by_model = True

    async def propose(self, history, k, committed=None):
        self.calls += 1
        self.drafts_by_model = False
        return [], []


def test_a_request_the_drafters_model_outgrew_goes_on_with_lookup_rounds_and_runs():
    prompt = [3, 1, 4, 1, 5, 9, 2]
    policy = Cycle([2])  # K = 2 every round: by lookup at a match, else by the model
    out, stats, drafter = run(prompt, 60, policy, drafter=OutgrownDrafter())
    assert out == reference(prompt, 60)
    assert drafter.calls == 1  # no model round once it could not draft
    assert stats.lookup_rounds > 0 and sum(policy.runs) > 30  # the rest: lookup rounds and runs of the target alone


class ModelAtMatches(Cycle):
    """K = 2 from the model every round, matches or not (a lookup round does not pay)."""

    def __init__(self):
        super().__init__([2])
        self.probes_beside_runs = True

    def choose(self, matched=0):
        self.round += 1
        self.by_lookup = False
        return 2


def test_a_model_round_at_a_match_asks_the_drafter_and_checks_the_match_for_free():
    """Where the policy prefers the model to a lookup match, the round is the model's (the
    drafter is asked; no lookup round), and in a greedy request the match's first token is
    checked against the round's first committed token, as a run checks it."""
    prompt = [3, 1, 4, 1, 5, 9]
    policy = ModelAtMatches()
    out, stats, drafter = run(prompt, 40, policy, drafter=CheckingDrafter())
    assert out == reference(prompt, 40)
    assert stats.lookup_rounds == 0 and drafter.calls == stats.rounds - stats.rounds_by_k.get(0, 0) > 0
    assert stats.lookups_checked == len(policy.besides) > 0
    assert {hit for _, hit, _ in policy.besides} == {0, 1}  # the match right after an even history, wrong after an odd one


def test_drafts_offered_to_runs_keep_the_output_the_targets():
    """The drafter drafts beside a run, after each committed token; a pass uses the latest
    offer's drafts only after the history they were drafted for (the fake verifier checks
    it), and each offer's first draft, checked against the token committed there, is what
    the policy learns (what a round's first draft would have got)."""
    prompt = [3, 1, 4, 1, 5]
    policy = Cycle([0], run=8, offer=2)
    drafter, stats = FakeDrafter(), Stats()
    verifier = FakeVerifier(drafter)

    async def go():
        out = []
        async for commit in speculate(prompt, 80, policy, set(), drafter, verifier, stats):
            out.extend(commit.tokens)
        return out

    out = asyncio.run(go())
    assert out == reference(prompt, 80)
    history = prompt + out
    assert stats.offered_passes == verifier.offered_passes > 0
    assert 0 < stats.offered_kept < 2 * stats.offered_passes
    # A call still out when its run ends is cancelled.
    assert stats.offers <= drafter.calls <= stats.offers + len(policy.runs) and stats.probes_beside_runs == 0
    # Every offer drafted 3 (2 and its guess); each first draft checked once its position was committed.
    checked = [(p, t) for p, t in ((len(h), d[0]) for h, d in drafter.drafted_for.items() if len(d) == 3)
               if p < len(history)]
    assert sorted(policy.besides) == sorted((1, int(history[p] == t)) for p, t in checked)
    assert {0, 1} == {a for _, a in policy.besides}
    # A run beside offers prices neither the target alone's steps nor a probe.
    assert sum(policy.runs) == 80 and all(policy.probed) and not any(policy.answered)


def test_no_offers_where_the_policy_prices_none():
    policy = Cycle([0], run=8)
    out, stats, drafter = run([3, 1, 4], 20, policy)
    assert out == reference([3, 1, 4], 20) and stats.offers == drafter.calls == 0


class FailingDrafter(FakeDrafter):
    """Its calls fail (a deadline, say) where `fails(call)`."""

    def __init__(self, fails):
        super().__init__()
        self.fails = fails

    async def propose(self, history, k, committed=None):
        self.calls += 1
        if self.fails(self.calls):
            raise RuntimeError("the drafter's call failed")
        return await super().propose(history, k, committed)


@pytest.mark.parametrize("fails", [lambda call: call % 2, lambda call: True], ids=["every other", "all"])
def test_a_failed_offer_call_is_asked_again_and_the_run_goes_on(fails):
    prompt = [3, 1, 4, 1, 5]
    policy = Cycle([0], run=8, offer=2)
    out, stats, drafter = run(prompt, 40, policy, drafter=FailingDrafter(fails))
    assert out == reference(prompt, 40)
    assert drafter.calls > stats.offers and (stats.offers > 0) == (fails(2) == 0)
