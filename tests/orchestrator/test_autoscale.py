"""The autoscaling policy and its decisions, with a stand-in for the Ray controller."""

import asyncio

import pytest

from orchestrator.autoscale import Autoscaler, Policy


def test_desired_replicas_follow_the_load():
    policy = Policy(min_replicas=1, max_replicas=4, target_sessions=2, cooldown_s=0)
    assert policy.desired(0) == 1      # idle: down to the minimum
    assert policy.desired(3) == 2      # 3 sessions at 2 per replica
    assert policy.desired(4) == 2
    assert policy.desired(50) == 4     # capped


def test_bad_policies_are_refused():
    with pytest.raises(ValueError):
        Policy(min_replicas=3, max_replicas=2, target_sessions=1, cooldown_s=0)
    with pytest.raises(ValueError):
        Policy(min_replicas=1, max_replicas=2, target_sessions=0, cooldown_s=0)


class Replica:
    def __init__(self, sessions):
        self.sessions = sessions


class Pool:
    def __init__(self, *sessions):
        self.replicas = {str(i): Replica(s) for i, s in enumerate(sessions)}


class Source:
    def __init__(self):
        self.calls = []

    async def scale(self, n):
        self.calls.append(n)
        return n


def steps(scaler, *times):
    for t in times:
        asyncio.run(scaler.step(now=t))


def test_grows_at_once_and_shrinks_after_a_quiet_cooldown():
    pool, source = Pool(3, 3), Source()
    scaler = Autoscaler(Policy(1, 4, target_sessions=2, cooldown_s=10), pool, source)
    steps(scaler, 100)                    # 6 sessions on 2 replicas: 3 wanted
    assert source.calls == [3] and "2 -> 3 drafters: 6 sessions" in scaler.last_decision
    pool.replicas = Pool(0, 0, 0).replicas
    steps(scaler, 105)                    # idle, but the busy sample is within the cool-down
    assert source.calls == [3]
    steps(scaler, 111)                    # idle for a whole cool-down: down to the minimum
    assert source.calls == [3, 1] and "3 -> 1 drafters: 0 sessions" in scaler.last_decision


def test_a_dip_between_requests_does_not_shrink_the_pool():
    pool, source = Pool(2, 2), Source()
    scaler = Autoscaler(Policy(1, 4, target_sessions=2, cooldown_s=10), pool, source)
    steps(scaler, 0, 5)                   # 4 sessions on 2 replicas: the right size
    pool.replicas = Pool(1, 0).replicas   # a momentary dip
    steps(scaler, 6, 9)
    pool.replicas = Pool(2, 2).replicas
    steps(scaler, 12)
    assert source.calls == []


def test_no_decision_when_the_size_is_right():
    pool, source = Pool(2, 1), Source()
    scaler = Autoscaler(Policy(1, 4, target_sessions=2, cooldown_s=0), pool, source)
    steps(scaler, 0)
    assert source.calls == [] and scaler.last_decision == ""


def test_verifiers_are_sized_by_their_sessions_and_those_waiting_for_kv_memory():
    from orchestrator.verifiers import VerifierPool, VerifierReplica

    pool, source = VerifierPool([], "fp", "tok"), Source()
    for i, (sessions, waiting) in enumerate([(16, 10), (16, 0)]):
        pool.replicas[f"v{i}"] = VerifierReplica(f"v{i}", None, None, sessions=sessions, waiting=waiting)
    scaler = Autoscaler(Policy(1, 4, target_sessions=16, cooldown_s=10), pool, source, what="verifiers")
    steps(scaler, 100)                    # 32 sessions, 10 more waiting for blocks: 3 replicas
    assert source.calls == [3] and "2 -> 3 verifiers: 42 sessions" in scaler.last_decision
