"""What rounds cost on this deployment, measured before the first request.

A fresh deployment's K policy knows no cost: its first request would learn them itself,
a run of the target alone, then a K = 1 probe whose drafter call prefills the prompt on
a cold drafter (on shared cores, beside the verifier's steps), then a first K = k_start
round. A short first request pays for all of it (measured: docs/benchmarks.md#figures-behind-the-code). So the orchestrator
measures them first, as a server warms up before it reports ready: a run of the target
alone, runs with a probe of the drafter beside them (what a probe costs a run where the
drafter shares the verifier's cores), then rounds of 1 and of k_start model drafts, on
one session of a built-in text. The deployment's RoundCosts learn what each cost, and
not what their drafts got: the warm-up's text is not the workload, whose acceptance
still starts from the prior."""

import contextlib
import logging
import time
import uuid

import grpc

from specdec.api.common.v1 import common_pb2
from orchestrator.kpolicy import FixedK, RoundCosts
from orchestrator.pool import DrafterPool
from orchestrator.links import Deadline, DrafterLink, FeatureFeed, VerifierLink
from orchestrator.rounds import speculate
from orchestrator.stats import Stats
from orchestrator.verifiers import VerifierPool

log = logging.getLogger("orchestrator")

TEXT = ("A lighthouse keeper writes the weather in a leather book each evening: the wind, the height "
        "of the waves, the ships that passed, and whether the lamp burned clean through the night.")
RUN_TOKENS = 24  # steps of the target alone measured, in one run
ROUNDS = 6  # rounds measured at each K


class _Measure(FixedK):
    """K = k in every round (the model's drafts, never lookup), whose costs go to the
    deployment's RoundCosts and whose acceptance goes nowhere. The first call at each K
    is not measured: the run's first step prefills, and so does a drafter's first call."""

    def __init__(self, k: int, costs: RoundCosts):
        super().__init__(k)
        self.costs, self.calls = costs, 0
        self.probe_k = 0  # drafts to ask for beside each run

    def choose(self, matched: int = 0) -> int:
        return self.k  # by_lookup stays False: the rounds measure the model's drafts

    def beside_run(self) -> int:
        return self.probe_k

    def observe_run(self, tokens, seconds, passes, steps_s=None, probed=False, answered=False) -> None:
        self.calls += 1
        if self.calls > 1:
            self.costs.observe_run(tokens, seconds, passes, steps_s, probed, answered)

    def observe(self, k, accepted, draft_s, verify_s, batch_pass=None, lookup=False) -> None:
        self.calls += 1
        if self.calls > 1 and k == self.k:  # a round without drafts (no drafter) measured nothing of K
            self.costs.observe(k, draft_s, verify_s, 0, 0, batch_pass)


async def measure_costs(costs: RoundCosts, verifiers: VerifierPool, drafters: DrafterPool, tokenizer,
                        eos: set[int], k_start: int, drafter_timeout_s: float, verifier_timeout_s: float) -> None:
    """Fills `costs` with a run of the target alone and rounds of 1 and k_start drafts.
    A failure leaves the rest to the first requests, as without a warm-up."""
    session_id = uuid.uuid4().hex
    stats = Stats()
    params = common_pb2.SamplingParams(temperature=0.0, top_p=1.0)
    history = list(tokenizer(TEXT)["input_ids"])
    deadline = Deadline(60.0)
    feed = FeatureFeed(drafters.feature_rule) if drafters.feature_rule is not None else None
    verifier = VerifierLink(verifiers, session_id, history, params, stats, verifier_timeout_s, retry_s=0.0,
                            deadline=deadline, features=feed)
    drafter = DrafterLink(drafters, session_id, params, stats, drafter_timeout_s, deadline=deadline, features=feed)
    started = time.monotonic()
    # (K, tokens, drafts asked for beside a run). The run's first call prefills the text
    # (not measured); the next is steps alone, then two runs of steps with a probe of one
    # draft beside them: the first probe's drafter call prefills the text and the run so
    # far, as a request's first does, the second catches up on the run since.
    phases = [(0, 1, 0), (0, RUN_TOKENS, 0), (0, RUN_TOKENS, 1), (0, RUN_TOKENS, 1)]
    phases += [(k, 2 * ROUNDS * (k + 1), 0) for k in sorted({1, k_start}) if k > 0]
    policies: dict[int, _Measure] = {}
    try:
        for k, tokens, probe_k in phases:
            policy = policies.setdefault(k, _Measure(k, costs))
            policy.probe_k = probe_k
            rounds = speculate(history, tokens, policy, eos, drafter, verifier, stats)
            async with contextlib.aclosing(rounds):
                async for commit in rounds:
                    history.extend(commit.tokens)
                    if policy.calls > ROUNDS:
                        break
        log.info("warm-up: %d tokens in %.2f s; %s", len(history), time.monotonic() - started, costs.describe())
    except grpc.aio.AioRpcError as err:
        log.warning("warm-up stopped (%s %s): the first requests will measure the costs",
                    err.code().name, err.details())
    finally:
        for close in (drafter.close, lambda: verifier.close()):
            try:
                await close()
            except grpc.aio.AioRpcError:
                pass  # the service's idle timeout releases the session
