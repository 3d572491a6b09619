"""Prometheus metrics of the three services, each on an HTTP port of its own
(`--metrics-port`). Names carry the `specdec_` prefix; the speculative-decoding counters
take vLLM's names (`spec_decode_num_drafts`, `..._num_draft_tokens`,
`..._num_accepted_tokens`, `..._num_accepted_tokens_per_pos`). The table in docs/reference.md lists
them all."""

import logging
import time
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, start_http_server

log = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                   60.0)
REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
K_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class Metrics:
    """A registry of one service's metrics, served over HTTP once `serve` is called."""

    def __init__(self):
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)  # resident memory, CPU seconds, open files

    def serve(self, host: str, port: int) -> None:
        if port:
            start_http_server(port, addr=host, registry=self.registry)
            log.info("metrics on http://%s:%d/metrics", host, port)

    def counter(self, name, doc, labels=()):
        return Counter(f"specdec_{name}", doc, list(labels), registry=self.registry)

    def gauge(self, name, doc, labels=()):
        return Gauge(f"specdec_{name}", doc, list(labels), registry=self.registry)

    def histogram(self, name, doc, buckets, labels=()):
        return Histogram(f"specdec_{name}", doc, list(labels), buckets=buckets, registry=self.registry)


class EngineMetrics(Metrics):
    """A drafter's or verifier's: its sessions and its batching engine's passes, labelled
    with the service (`service="verifier"` or `"drafter"`)."""

    def __init__(self, role: str):
        super().__init__()

        def of(make, name, doc, *args):
            return make(name, doc, *args, labels=["service"]).labels(role)

        self.passes = of(self.histogram, "batch_pass_seconds", "time of one batched forward pass", LATENCY_BUCKETS)
        self.rows = of(self.histogram, "batch_rows", "sessions (rows) in one forward pass", ROW_BUCKETS)
        self.tokens = of(self.histogram, "batch_tokens", "tokens computed by one forward pass", TOKEN_BUCKETS)
        self.evictions = of(self.counter, "kv_evictions", "sessions that gave their KV blocks back to an older "
                                                          "session (they recompute later)")
        self.prefix_tokens = of(self.counter, "kv_prefix_cached_tokens", "prompt tokens admitted with their keys "
                                "and values already in the pool (prefix caching): not computed again")
        self.feature_tokens = of(self.counter, "feature_cached_tokens", "prompt positions whose features (for "
                                 "a feature drafter) came from the verifier's feature cache: not computed again")
        self.failed_passes = of(self.counter, "failed_passes", "forward passes that raised (their sessions resync)")
        self.sessions = of(self.gauge, "open_sessions", "sessions this service holds")
        self.queue = of(self.gauge, "queue_length", "calls waiting for a forward pass")
        self.waiting = of(self.gauge, "waiting_for_memory", "sessions waiting for KV memory")
        self.kv_used = of(self.gauge, "kv_blocks_used", "KV pool blocks held by sessions")
        self.kv_total = of(self.gauge, "kv_blocks_capacity", "KV pool blocks in all")
        self.constraint_refusals = of(self.gauge, "constraint_refused_tokens",
                                      "committed tokens a session's constraint refused since the start (its "
                                      "request failed; any is a fault: the tokens were the target's picks under it)")

    def follow(self, queue: Callable[[], int], waiting: Callable[[], int], kv_used: Callable[[], int],
               kv_total: int) -> None:
        """The engine's gauges, read when scraped."""
        self.queue.set_function(queue)
        self.waiting.set_function(waiting)
        self.kv_used.set_function(kv_used)
        self.kv_total.set(kv_total)


class OrchestratorMetrics(Metrics):
    def __init__(self):
        super().__init__()
        c, h = self.counter, self.histogram
        self.requests = c("requests", "finished requests by outcome (ok, error, cancelled) and gRPC status code",
                          ["outcome", "code"])
        self.in_flight = self.gauge("requests_in_flight", "requests being generated now")
        self.lookup_memory = self.gauge("lookup_memory_tokens",
                                        "tokens of earlier outputs held for lookup drafts (--lookup-memory-tokens)")
        self.lookup_rounds = c("lookup_rounds", "rounds drafted by prompt lookup, by where the match was: the "
                                                "request's own history, or earlier requests' outputs (memory)",
                               ["source"])
        self.lookup_accepted = c("lookup_accepted_tokens", "accepted drafts of lookup rounds, by source", ["source"])
        self.prompt_tokens = c("prompt_tokens", "prompt tokens of started requests")
        self.feature_bytes = c("feature_bytes", "the target's features a feature drafter drafts from, as they "
                                                "came from the verifier and went on to drafters", ["direction"])
        self.generation_tokens = c("generation_tokens", "tokens generated")
        self.ttft = h("time_to_first_token_seconds", "from the request to its first token", LATENCY_BUCKETS)
        self.itl = h("inter_token_latency_seconds", "between two tokens of a request (a chunk of n tokens counts n "
                                                    "gaps of its time / n)", LATENCY_BUCKETS)
        self.e2e = h("request_latency_seconds", "from the request to its Result", REQUEST_BUCKETS)
        self.drafts = c("spec_decode_num_drafts", "rounds that verified at least one draft token (vLLM's name)")
        self.draft_tokens = c("spec_decode_num_draft_tokens", "draft tokens sent to the verifier (vLLM's name)")
        self.accepted = c("spec_decode_num_accepted_tokens", "draft tokens the verifier accepted (vLLM's name)")
        self.accepted_per_pos = c("spec_decode_num_accepted_tokens_per_pos",
                                  "accepted draft tokens by their position in the round, from 0 (vLLM's name)",
                                  ["position"])
        self.rounds = c("rounds", "speculative rounds (one verifier call each)")
        self.undrafted = c("rounds_without_drafter", "rounds that wanted drafts but had no drafter (verifier alone)")
        self.k = h("num_speculative_tokens", "K chosen per round", K_BUCKETS)
        self.resyncs = c("resyncs", "sessions resent whole to a service that lost them", ["service"])
        self.failovers = c("drafter_failovers", "requests moved off a failed drafter replica")
        self.drafter_call = h("drafter_call_seconds", "Propose calls as the orchestrator sees them", LATENCY_BUCKETS)
        self.verifier_call = h("verifier_call_seconds", "Verify calls as the orchestrator sees them", LATENCY_BUCKETS)
        self.replicas = self.gauge("drafter_replicas", "drafter replicas in the pool", ["healthy"])
        self.scaling = c("autoscaler_decisions", "pool sizes the autoscaler chose", ["pool", "direction"])
        self.verifier_sessions = self.gauge("verifier_sessions", "requests paired with each verifier replica now",
                                            ["replica"])
        self.verifier_free_blocks = self.gauge("verifier_free_kv_blocks",
                                               "KV blocks each verifier replica could hand out after its last pass",
                                               ["replica"])
        self.verifier_routed = c("verifier_routed", "sessions paired with a verifier replica, by rule (prefix: it "
                                                    "holds the prompt's longest cached prefix; load: the least "
                                                    "loaded)", ["replica", "rule"])
        self.verifier_moves = c("verifier_moves", "sessions moved to another verifier replica (theirs failed or "
                                                  "left the set)")

    def round(self, k: int, drafted: int, accepted: int, draft_s: float | None, verify_s: float) -> None:
        self.rounds.inc()
        self.k.observe(k)
        self.verifier_call.observe(verify_s)
        if draft_s is not None:
            self.drafter_call.observe(draft_s)
        if k > 0 and drafted == 0:
            self.undrafted.inc()
        if drafted:
            self.drafts.inc()
            self.draft_tokens.inc(drafted)
            self.accepted.inc(accepted)
            for position in range(accepted):
                self.accepted_per_pos.labels(str(position)).inc()

    def tokens(self, started: float, last: float | None, n: int) -> float | None:
        """A chunk of n tokens committed now; -> the time of the request's latest token.
        The first chunk gives the time to first token; a later chunk of n tokens counts as
        n gaps of its wait / n (they were produced by one round)."""
        if n == 0:
            return last
        now = time.monotonic()
        self.generation_tokens.inc(n)
        if last is None:
            self.ttft.observe(now - started)
        else:
            for _ in range(n):
                self.itl.observe((now - last) / n)
        return now

    def finished(self, outcome: str, code: str, stats) -> None:
        self.requests.labels(outcome, code).inc()
        self.resyncs.labels("verifier").inc(stats.resyncs - stats.drafter_resyncs)
        self.resyncs.labels("drafter").inc(stats.drafter_resyncs)
        self.failovers.inc(stats.drafter_failovers)
        self.lookup_rounds.labels("memory").inc(stats.memory_rounds)
        self.lookup_rounds.labels("history").inc(stats.lookup_rounds - stats.memory_rounds)
        self.lookup_accepted.labels("memory").inc(stats.memory_accepted)
        self.lookup_accepted.labels("history").inc(stats.lookup_accepted - stats.memory_accepted)
        self.feature_bytes.labels("from_verifier").inc(stats.feature_bytes)
        self.feature_bytes.labels("to_drafters").inc(stats.feature_bytes_sent)
