"""Requests that share long prompt prefixes (system prompts, documents) over several
verifier replicas: the orchestrator's prefix routing against round-robin, in one run,
on the same replicas (each routing gets prefixes of its own, so neither finds the
other's blocks cached). Each replica's KV pool holds about 3 of the 5 prefixes, as a
busy replica holds a share of what its users send. For each routing: the prefixes'
cold requests (no replica holds them), then rounds of follow-ups (a prefix, a new
question), the prefixes interleaved, one request at a time; each request's time to its
first token (the target alone: the prefill and the call).

    python -m deploy.bench_prefix [--target smollm2-135m-instruct] [--replicas 2]
        [--prefix-tokens 1000] [--prefixes 5] [--rounds 4] [--kv-cache-bytes 160MiB] [--out DIR]
"""

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import grpc

from deploy.launch import HOST, Service, free_port, start, stop, wait_serving
from specdec import modeling
from specdec.orchestrator.v1 import orchestrator_pb2 as pb, orchestrator_pb2_grpc

ROUTINGS = ("prefix", "round-robin")


def ttft(stub, ids: list[int]) -> float:
    """Seconds from the call to its first token (the target alone, so that the time is the
    prefill's and the call's, not a drafter's)."""
    started = time.perf_counter()
    call = stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), max_new_tokens=4,
                                            num_speculative_tokens=0), timeout=600)
    for event in call:
        if event.HasField("chunk") and event.chunk.token_ids:
            seconds = time.perf_counter() - started
            call.cancel()
            return seconds
    raise RuntimeError("no token came")


def run(args) -> dict:
    rng = random.Random(0)
    tokens = lambda n: [rng.randrange(1000, 40000) for _ in range(n)]  # noqa: E731
    python = [sys.executable, "-m"]
    verifiers = [Service(f"verifier-{i}", free_port(), []) for i in range(args.replicas)]
    for v in verifiers:
        v.argv = [*python, "verifier_service", "--host", HOST, "--port", str(v.port), "--model", args.target,
                  "--threads", str(args.threads), "--kv-cache-bytes", args.kv_cache_bytes]
    results = {}
    try:
        start(verifiers)
        wait_serving(verifiers, 600)
        for routing in ROUTINGS:
            o = Service(f"orchestrator-{routing}", free_port(), [])
            o.argv = [*python, "orchestrator", "--host", HOST, "--port", str(o.port), "--admin-port", str(free_port()),
                      "--verifiers", ",".join(v.address for v in verifiers), "--drafters", "",
                      "--tokenizer", args.target, "--verifier-routing", routing]
            try:
                start([o])
                wait_serving([o], 600)
                with grpc.insecure_channel(o.address) as channel:
                    stub = orchestrator_pb2_grpc.OrchestratorServiceStub(channel)
                    ttft(stub, tokens(8))  # the first call pays the connections
                    prefixes = [tokens(args.prefix_tokens) for _ in range(args.prefixes)]
                    cold = [ttft(stub, prefix + tokens(16)) for prefix in prefixes]
                    follow = [ttft(stub, prefix + tokens(16)) for _ in range(args.rounds) for prefix in prefixes]
            finally:
                stop([o])
            c, f = statistics.median(cold), statistics.median(follow)
            results[routing] = {"cold_s": cold, "follow_up_s": follow, "median_ratio": f / c,
                                "mean_ratio": statistics.mean(follow) / c}
            print(f"{routing:>12}: cold TTFT median {c * 1e3:.0f} ms; follow-ups median {f * 1e3:.0f} ms "
                  f"({f / c:.2f}x cold), mean {statistics.mean(follow) * 1e3:.0f} ms "
                  f"({statistics.mean(follow) / c:.2f}x), slowest {max(follow) * 1e3:.0f} ms", flush=True)
    finally:
        stop(verifiers)
    return results


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m deploy.bench_prefix", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=modeling.DEFAULT_TARGET)
    parser.add_argument("--replicas", type=int, default=2, help="verifier replicas")
    parser.add_argument("--threads", type=int, default=1, help="threads of each replica's passes")
    parser.add_argument("--prefix-tokens", type=int, default=1000)
    parser.add_argument("--prefixes", type=int, default=5, help="prefixes per routing (one cold request each)")
    parser.add_argument("--rounds", type=int, default=4, help="follow-ups per prefix")
    parser.add_argument("--kv-cache-bytes", default="160MiB", help="each replica's KV pool")
    parser.add_argument("--out", type=Path, default=None, help="directory for bench-prefix.json")
    args = parser.parse_args(argv)
    results = run(args)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench-prefix.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                                "results": results}, indent=2))


if __name__ == "__main__":
    main()
