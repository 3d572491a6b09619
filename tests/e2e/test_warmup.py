"""The orchestrator's warm-up against the tiny pair's real services: it fills the
deployment's costs (runs of the target alone with and without a probe beside them,
rounds of 1 and k_start drafts) and none of their acceptance, closes its sessions, and
a fresh request then needs no probe."""

import asyncio

from orchestrator import warmup
from orchestrator.kpolicy import AdaptiveK, RoundCosts
from orchestrator.pool import DrafterPool
from orchestrator.verifiers import VerifierPool
from specdec import model_files

K_START = 3


async def warm(cluster, target_dir, drafter_name: str, costs: RoundCosts) -> None:
    verifier, drafter = cluster.roles["verifier"], cluster.roles[drafter_name]
    tokenizer = model_files.load_tokenizer(str(target_dir))
    verifiers = VerifierPool([verifier.address], model_files.vocab_fingerprint(tokenizer), str(target_dir))
    info = await verifiers.start(60)
    drafters = DrafterPool([drafter.address], info.vocab_fingerprint, info.model_name)
    for replica in drafters.replicas.values():
        await drafters.check(replica, wait_s=60)
    try:
        await warmup.measure_costs(costs, verifiers, drafters, tokenizer, set(info.eos_token_ids), K_START,
                                   drafter_timeout_s=30, verifier_timeout_s=30)
    finally:
        await drafters.close()
        for replica in verifiers.replicas.values():
            replica.watcher.cancel()
            await replica.channel.close()


def test_the_warm_up_measures_costs_and_no_acceptance(tiny_cluster, tiny_pair):
    target_dir, _, _ = tiny_pair
    before = {name: tiny_cluster.sessions(tiny_cluster.roles[name]) for name in ("verifier", "model-drafter")}
    costs = RoundCosts()
    asyncio.run(warm(tiny_cluster, target_dir, "model-drafter", costs))

    assert costs.tried == {0, 1, K_START}
    assert costs.plain is not None and costs.plain > 0
    # A run without a probe and runs with a probe beside them: what a probe costs a run.
    assert costs.run_step is not None and costs.run_step > 0
    # The tiny drafter answers a probe within a few of the run's 24 steps (measured: a call
    # of 6-7 ms against 2 ms steps), so what a probe costs is measured, not priced.
    assert costs.probes_measured >= 1 and costs.probe_cost is not None and costs.probe_cost >= 0
    assert {1, K_START} <= set(costs.draft.at) and all(s > 0 for k, s in costs.draft.at.items() if k)
    assert {1, 2, K_START + 1} <= set(costs.batch_pass.at)
    # Its drafts' acceptance is the warm-up text's, not the workload's: the prior stays.
    assert (costs.accepted, costs.tested) == (0.5, 1.0)
    assert (costs.lookup_accepted, costs.lookup_tested, costs.lookup_tried) == (0.5, 1.0, False)
    for name, held in before.items():
        assert tiny_cluster.sessions(tiny_cluster.roles[name]) <= held, f"the warm-up left a session on {name}"

    # A first request starts from what the warm-up measured: no K = 0 to try first and no
    # K = 1 probe beside its runs (without the warm-up, the second choice is that probe).
    policy = AdaptiveK(costs, k_max=8, k_start=K_START, probes_beside_runs=True)
    assert all(policy.speed(k) is not None for k in (0, 1, K_START))
    for _ in range(2):
        if policy.choose() == 0:
            assert policy.beside_run() == 0
            policy.observe_run(4, 4 * costs.plain, [])
    cold = AdaptiveK(RoundCosts(), k_max=8, k_start=K_START, probes_beside_runs=True)
    assert cold.choose() == 0 and cold.beside_run() == 0
    cold.observe_run(4, 0.02, [])
    assert cold.choose() == 0 and cold.beside_run() == 1


def test_the_warm_up_with_a_lookup_drafter_measures_the_model_rounds_it_can(tiny_cluster, tiny_pair):
    """An n-gram drafter has no model: asked for model drafts it sends none, and the
    warm-up measures only the target alone, never a K it did not see."""
    target_dir, _, _ = tiny_pair
    costs = RoundCosts()
    asyncio.run(warm(tiny_cluster, target_dir, "ngram-drafter", costs))
    assert costs.tried == {0} and costs.plain is not None and costs.probe_cost is not None
    assert set(costs.draft.at) == {0}  # only the curve's own starting point
    assert (costs.accepted, costs.tested) == (0.5, 1.0)
