"""The benchmarks: `specdec bench NAME [flags]` (or `python -m deploy.bench NAME`).

Each starts what it measures on loopback, prints a table and writes its figures (JSON,
Markdown, some a chart) to --out; one that checks outputs exits 1 when an output of ours
differs from what it must equal. `specdec bench NAME --help` gives a benchmark's flags."""

import importlib
import sys

# name: (module, what it measures)
BENCHMARKS = {
    "compare": ("compare", "the target alone, transformers' assisted generation and our variants, side by side"),
    "load": ("load", "many concurrent streams: batched, K fixed or load-aware, against no batching"),
    "repeat": ("repeat", "requests that repeat each other (templates): the defaults against K = 0"),
    "structured": ("structured", "JSON against a schema: the defaults against K = 0 under the same constraint"),
    "prefix": ("prefix", "shared prompt prefixes over verifier replicas: prefix routing against round-robin"),
    "engine": ("engine", "the batching engine alone: pass costs, batch invariance, prefix caching, llama-bench"),
    "paths": ("paths", "each model's path through the CPU engine: checkpoints of each family against the GGUF target"),
    "split": ("split", "the drafter on cores of its own beside the shared deployment: the defaults against K = 0"),
    "pair": ("pair", "a real pair (Qwen2.5-Coder 1.5B and 0.5B), shared and split, against llama-server's speculation"),
    "wire": ("wire", "a round's calls: unary calls against bidirectional streams, on loopback"),
    "fidelity": ("fidelity", "each numerics against the published model (float32 de-quantized)"),
}


def usage() -> str:
    width = max(map(len, BENCHMARKS))
    return "usage: specdec bench NAME [flags]\n\n" + "\n".join(
        f"  {name:<{width}}  {about}" for name, (_, about) in BENCHMARKS.items()) + "\n"


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__ + "\n\n" + usage())
        raise SystemExit(0 if argv else 2)
    name, rest = argv[0], argv[1:]
    if name not in BENCHMARKS:
        print(f"specdec bench: no benchmark {name!r}\n\n" + usage(), file=sys.stderr)
        raise SystemExit(2)
    module = importlib.import_module(f"deploy.bench.{BENCHMARKS[name][0]}")
    # Every benchmark: build_parser() and main_with(args) -> its exit status.
    raise SystemExit(module.main_with(module.build_parser().parse_args(rest)))
