"""`specdec top URL...`: a live terminal view of a deployment, read from its services'
Prometheus endpoints (the URLs `specdec up` prints; on Kubernetes, port-forwarded).
Throughput, acceptance overall and per draft position, K, latency percentiles, and the
load of each verifier and drafter replica (and the orchestrator's routing over the
verifier replicas), refreshed every `--interval` seconds:
rates and percentiles are over the last interval."""

import argparse
import sys
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, tuple], float]


def scrape(url: str, timeout: float = 5.0) -> Samples:
    text = urllib.request.urlopen(url, timeout=timeout).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def total(samples: Samples, name: str, **labels) -> float:
    """The sum over the samples of `name` whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


def quantile(q: float, before: Samples, now: Samples, name: str) -> float | None:
    """histogram_quantile over the interval: from the buckets' increase, linear in a bucket."""
    buckets = {}
    for (n, labels), v in now.items():
        if n == f"{name}_bucket":
            le = float(dict(labels)["le"])
            buckets[le] = buckets.get(le, 0.0) + v - before.get((n, labels), 0.0)
    if not buckets:
        return None
    bounds = sorted(buckets)
    count = buckets[bounds[-1]]
    if count <= 0:
        return None
    rank, lower, below = q * count, 0.0, 0.0
    for bound in bounds:
        if buckets[bound] >= rank:
            if bound == float("inf"):
                return lower
            inside = buckets[bound] - below
            return lower + (bound - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = bound, buckets[bound]
    return lower


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1e3:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def frame(endpoints: list[str], before: dict[str, Samples], now: dict[str, Samples], dt: float) -> str:
    """One screen, from two scrapes of every endpoint `dt` seconds apart."""
    rate = lambda url, name, **labels: (total(now[url], name, **labels) - total(before[url], name, **labels)) / dt
    lines = [f"specdec top: {len(endpoints)} endpoints, over the last {dt:.1f} s{' ' * 8}{time.strftime('%H:%M:%S')}"]
    for url in endpoints:
        s, b = now[url], before[url]
        if ("specdec_rounds_total", ()) in s:  # the orchestrator
            ok, errors = total(s, "specdec_requests_total", outcome="ok"), total(s, "specdec_requests_total",
                                                                                  outcome="error")
            lines.append(f"orchestrator {url}")
            lines.append(f"  requests   {ok:.0f} ok ({rate(url, 'specdec_requests_total', outcome='ok'):.1f}/s), "
                         f"{errors:.0f} errors, {total(s, 'specdec_requests_total', outcome='cancelled'):.0f} "
                         f"cancelled, {total(s, 'specdec_requests_in_flight'):.0f} in flight")
            lines.append(f"  tokens     {rate(url, 'specdec_generation_tokens_total'):.1f} generated/s, "
                         f"{rate(url, 'specdec_prompt_tokens_total'):.1f} prompt/s")
            drafted = rate(url, "specdec_spec_decode_num_draft_tokens_total")
            accepted = rate(url, "specdec_spec_decode_num_accepted_tokens_total")
            rounds = rate(url, "specdec_spec_decode_num_drafts_total")
            positions = sorted({int(dict(ls)["position"]) for (n, ls) in s
                                if n == "specdec_spec_decode_num_accepted_tokens_per_pos_total"})
            per_pos = "specdec_spec_decode_num_accepted_tokens_per_pos_total"
            per_position = "  ".join(f"{p}:{rate(url, per_pos, position=str(p)) / rounds:.2f}"
                                     for p in positions) if rounds else "-"
            lines.append(f"  accepted   {accepted / drafted if drafted else 0:.2f} of drafts; per round by position: "
                         f"{per_position}")
            k_count = rate(url, "specdec_num_speculative_tokens_count")
            k_mean = rate(url, "specdec_num_speculative_tokens_sum") / k_count if k_count else 0.0
            lines.append(f"  K          mean {k_mean:.2f} over {k_count * dt:.0f} rounds")
            q = lambda p, name: _ms(quantile(p, b, s, name))  # noqa: E731
            lines.append(f"  latency    first token p50 {q(0.5, 'specdec_time_to_first_token_seconds')} "
                         f"p95 {q(0.95, 'specdec_time_to_first_token_seconds')} | inter-token p50 "
                         f"{q(0.5, 'specdec_inter_token_latency_seconds')} p95 "
                         f"{q(0.95, 'specdec_inter_token_latency_seconds')} | request p50 "
                         f"{q(0.5, 'specdec_request_latency_seconds')} "
                         f"p95 {q(0.95, 'specdec_request_latency_seconds')}")
            lines.append(f"  calls      Propose p50 {q(0.5, 'specdec_drafter_call_seconds')}, Verify p50 "
                         f"{q(0.5, 'specdec_verifier_call_seconds')}")
            lines.append(f"  trouble    {rate(url, 'specdec_resyncs_total'):.2f} resyncs/s, "
                         f"{rate(url, 'specdec_drafter_failovers_total'):.2f} failovers/s, "
                         f"{rate(url, 'specdec_rounds_without_drafter_total'):.2f} undrafted rounds/s; drafters "
                         f"{total(s, 'specdec_drafter_replicas', healthy='true'):.0f} healthy, "
                         f"{total(s, 'specdec_drafter_replicas', healthy='false'):.0f} down")
            replicas = sorted({dict(ls)["replica"] for (n, ls) in s if n == "specdec_verifier_sessions"})
            for replica in replicas:
                routed = lambda rule: total(s, "specdec_verifier_routed_total", replica=replica, rule=rule)  # noqa: E731
                lines.append(f"  verifier   {replica}: {total(s, 'specdec_verifier_sessions', replica=replica):.0f} "
                             f"sessions, {total(s, 'specdec_verifier_free_kv_blocks', replica=replica):.0f} free KV "
                             f"blocks; routed {routed('prefix'):.0f} by prefix, {routed('load'):.0f} by load")
            if replicas:
                lines.append(f"  moves      {total(s, 'specdec_verifier_moves_total'):.0f} sessions moved to another "
                             f"verifier replica")
        else:  # a verifier or a drafter
            service = next((dict(ls).get("service") for (n, ls) in s if n == "specdec_open_sessions"), "?")
            passes = rate(url, "specdec_batch_rows_count")
            rows = rate(url, "specdec_batch_rows_sum") / passes if passes else 0.0
            capacity = total(s, "specdec_kv_blocks_capacity")
            kv = total(s, "specdec_kv_blocks_used") / capacity if capacity else 0.0
            lines.append(f"{service:<12} {url}")
            lines.append(f"  load       {total(s, 'specdec_open_sessions'):.0f} sessions, "
                         f"{total(s, 'specdec_queue_length'):.0f} queued, {passes:.1f} passes/s of {rows:.1f} rows, "
                         f"pass p50 {_ms(quantile(0.5, b, s, 'specdec_batch_pass_seconds'))}, KV {100 * kv:.0f}% used, "
                         f"{total(s, 'process_resident_memory_bytes') / 2 ** 20:.0f} MiB resident")
    return "\n".join(lines)


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="specdec top", description=__doc__)
    parser.add_argument("endpoints", nargs="+", help="metrics URLs (http://host:port/metrics) of the services")
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between two screens")
    parser.add_argument("--once", action="store_true", help="print one screen (after one interval) and exit")
    return parser


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    before = {url: scrape(url) for url in args.endpoints}
    started = time.monotonic()
    while True:
        time.sleep(args.interval)
        now = {url: scrape(url) for url in args.endpoints}
        screen = frame(args.endpoints, before, now, time.monotonic() - started)
        if args.once:
            print(screen)
            return
        sys.stdout.write("\x1b[H\x1b[2J" + screen + "\n")  # home, clear: redraw in place
        sys.stdout.flush()
        before, started = now, time.monotonic()


if __name__ == "__main__":
    main()
