"""Shared prefixes: `specdec bench prefix`. Requests that share long prompt prefixes (system prompts, documents) over several
verifier replicas: the orchestrator's prefix routing against round-robin, in one run,
on the same replicas (each routing gets prefixes of its own, so neither finds the
other's blocks cached). Each replica's KV pool holds about 3 of the 5 prefixes, as a
busy replica holds a share of what its users send. For each routing: the prefixes'
cold requests (no replica holds them), then rounds of follow-ups (a prefix, a new
question), the prefixes interleaved, one request at a time; each request's time to its
first token (the target alone: the prefill and the call). Writes prefix.json and
prefix.md to --out."""

import argparse
import random
import statistics
import sys

from deploy.bench import harness
from deploy.launch import HOST, Service, free_port

ROUTINGS = ("prefix", "round-robin")


def ttft(stub, ids: list[int]) -> float:
    """Seconds from the call to its first token (the target alone, so that the time is the
    prefill's and the call's, not a drafter's)."""
    call = harness.stream(stub, harness.request(ids, max_new_tokens=4, k=0), timeout=600, first_only=True)
    if not call.arrivals:
        raise RuntimeError("no token came")
    return call.arrivals[0]


def run(args) -> dict:
    rng = random.Random(0)
    tokens = lambda n: [rng.randrange(1000, 40000) for _ in range(n)]  # noqa: E731
    python = [sys.executable, "-m"]
    verifiers = [Service(f"verifier-{i}", free_port(), []) for i in range(args.replicas)]
    for v in verifiers:
        v.argv = [*python, "verifier_service", "--host", HOST, "--port", str(v.port), "--model", args.target,
                  "--device", args.device, "--dtype", args.dtype, "--threads", str(args.threads), "--kv-cache-bytes", args.kv_cache_bytes]
    results = {}
    with harness.running(verifiers, log_dir=harness.log_dir(args), timeout_s=600):
        for routing in ROUTINGS:
            o = Service(f"orchestrator-{routing}", free_port(), [])
            o.argv = [*python, "orchestrator", "--host", HOST, "--port", str(o.port), "--admin-port", str(free_port()),
                      "--verifiers", ",".join(v.address for v in verifiers), "--drafters", "",
                      "--tokenizer", args.target, "--verifier-routing", routing]
            with harness.running([o], log_dir=harness.log_dir(args), timeout_s=600), harness.orchestrator([o]) as stub:
                ttft(stub, tokens(8))  # the first call pays the connections
                prefixes = [tokens(args.prefix_tokens) for _ in range(args.prefixes)]
                cold = [ttft(stub, prefix + tokens(16)) for prefix in prefixes]
                follow = [ttft(stub, prefix + tokens(16)) for _ in range(args.rounds) for prefix in prefixes]
            c, f = statistics.median(cold), statistics.median(follow)
            results[routing] = {"cold_s": cold, "follow_up_s": follow, "median_ratio": f / c,
                                "mean_ratio": statistics.mean(follow) / c}
            print(f"{routing:>12}: cold TTFT median {c * 1e3:.0f} ms; follow-ups median {f * 1e3:.0f} ms "
                  f"({f / c:.2f}x cold), mean {statistics.mean(follow) * 1e3:.0f} ms "
                  f"({statistics.mean(follow) / c:.2f}x), slowest {max(follow) * 1e3:.0f} ms", flush=True)
    return results


def markdown(results: dict, meta: dict) -> str:
    lines = [f"target `{meta['target']}`, {meta['replicas']} verifier replicas, {meta['prefixes']} prefixes of "
             f"{meta['prefix_tokens']} tokens, {meta['rounds']} follow-ups each, one request at a time", "",
             "| routing | cold TTFT median ms | follow-up TTFT median ms | median / cold | mean / cold |",
             "|---|---|---|---|---|"]
    for routing, r in results.items():
        lines.append(f"| {routing} | {statistics.median(r['cold_s']) * 1e3:.0f} | "
                     f"{statistics.median(r['follow_up_s']) * 1e3:.0f} | {r['median_ratio']:.2f}x | "
                     f"{r['mean_ratio']:.2f}x |")
    return "\n".join(lines) + "\n"


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = harness.model_flags(parser or harness.parser_for("prefix", __doc__), "prefix-out", quantize=False,
                                 draft=False)
    parser.add_argument("--replicas", type=int, default=2, help="verifier replicas")
    parser.add_argument("--threads", type=int, default=1, help="threads of each replica's passes")
    parser.add_argument("--prefix-tokens", type=int, default=1000)
    parser.add_argument("--prefixes", type=int, default=5, help="prefixes per routing (one cold request each)")
    parser.add_argument("--rounds", type=int, default=4, help="follow-ups per prefix")
    parser.add_argument("--kv-cache-bytes", default="160MiB", help="each replica's KV pool")
    return parser


def main_with(args) -> int:
    results = run(args)
    meta = {key: getattr(args, key) for key in ("target", "replicas", "threads", "prefix_tokens", "prefixes",
                                                 "rounds", "kv_cache_bytes")}
    harness.write_report(args.out, "prefix", {"meta": meta, "results": results}, markdown(results, meta))
    return 0
