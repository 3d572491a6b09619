"""Autoscaling of a replica pool (drafters, or verifiers) from the load the orchestrator
measures: requests paired with a replica, and for verifiers also the sessions their
passes left waiting for KV memory. Grows the pool as soon as replicas carry more than
the target load; shrinks it only to the highest size wanted over the last cool-down (so
a momentary dip between requests does not drop replicas), and changes it at most once
per cool-down."""

import asyncio
import logging
import math
import time
from collections import deque
from dataclasses import dataclass

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
    def __init__(self, policy: Policy, pool, source, interval_s: float = 1.0, metrics=None, what: str = "drafters"):
        self.policy, self.pool, self.source, self.interval_s, self.what = policy, pool, source, interval_s, what
        self.metrics = metrics  # specdec.metrics.OrchestratorMetrics, or None
        self.target = len(pool.replicas)  # the size last asked for (replicas may still be starting)
        self.wanted: deque[tuple[float, int]] = deque()  # (time, desired) over the last cool-down
        self.last_change = -math.inf
        self.last_decision = ""

    async def step(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        sessions = sum(r.sessions + getattr(r, "waiting", 0) for r in self.pool.replicas.values())
        self.wanted.append((now, self.policy.desired(sessions)))
        while self.wanted[0][0] < now - self.policy.cooldown_s:
            self.wanted.popleft()
        want = max(d for _, d in self.wanted)
        if want == self.target or now - self.last_change < self.policy.cooldown_s:
            return
        self.last_decision = (f"{time.strftime('%H:%M:%S')} {self.target} -> {want} {self.what}: {sessions} "
                              f"sessions, target {self.policy.target_sessions:g} per replica")
        log.info("autoscale: %s", self.last_decision)
        if self.metrics is not None:
            self.metrics.scaling.labels(self.what, "up" if want > self.target else "down").inc()
        self.last_change = now
        self.target = await self.source.scale(want)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.step()
            except Exception as err:  # keep scaling decisions alive across a failed call
                log.warning("autoscale step failed: %s", err)
