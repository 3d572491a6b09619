"""Drafter autoscaling from the load the orchestrator measures: requests paired with a
drafter. Grows the pool when replicas carry more than the target load, shrinks it when
they are idle; never more often than once per cool-down."""

import asyncio
import logging
import math
import time
from dataclasses import dataclass

from orchestrator.pool import DrafterPool

log = logging.getLogger("orchestrator.autoscale")


@dataclass
class Policy:
    min_replicas: int
    max_replicas: int
    target_sessions: float  # sessions per replica the pool is sized for
    cooldown_s: float

    def __post_init__(self):
        if not 0 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"need 0 <= min replicas ({self.min_replicas}) <= max ({self.max_replicas})")
        if self.target_sessions <= 0:
            raise ValueError("the target load per replica must be > 0")

    def desired(self, sessions: int) -> int:
        return min(self.max_replicas, max(self.min_replicas, math.ceil(sessions / self.target_sessions)))


class Autoscaler:
    def __init__(self, policy: Policy, pool: DrafterPool, source, interval_s: float = 2.0):
        self.policy, self.pool, self.source, self.interval_s = policy, pool, source, interval_s
        self.last_change = -math.inf
        self.last_decision = ""

    async def step(self) -> None:
        sessions = sum(r.sessions for r in self.pool.replicas.values())
        current = len(self.pool.replicas)
        want = self.policy.desired(sessions)
        if want == current or time.monotonic() - self.last_change < self.policy.cooldown_s:
            return
        self.last_decision = (f"{time.strftime('%H:%M:%S')} {current} -> {want} drafters: {sessions} sessions, "
                              f"target {self.policy.target_sessions:g} per replica")
        log.info("autoscale: %s", self.last_decision)
        self.last_change = time.monotonic()
        await self.source.scale(want)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.step()
            except Exception as err:  # keep scaling decisions alive across a failed call
                log.warning("autoscale step failed: %s", err)
