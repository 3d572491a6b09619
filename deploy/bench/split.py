"""The drafter on cores of its own, beside the deployment that shares them: `specdec bench split`.

The design's own case is a drafter on a node of its own beside the target's; `specdec up`
on one machine shares its cores among all three services, the worst case for it. Both
here, on this machine's cores:
  shared  `specdec up` as it starts: the verifier's passes on every core, the drafter's
          on one at a lower priority, the orchestrator anywhere;
  split   the verifier pinned to every core but the last, with a thread each; the
          drafter and the orchestrator pinned to the last (on 2 cores: the verifier on
          core 0 with 1 thread, the drafter and the orchestrator on core 1).
Each with the defaults and at K = 0 (every request's num_speculative_tokens 0: the target
alone, through the same services), and with --overlap the defaults with the orchestrator's
--overlap too (each round's successor drafted while the round is verified: on cores of its
own the drafter would otherwise wait out every pass), each cell a fresh deployment (nothing learned or
remembered from another cell), the cells of a pass in turn and the passes in opposite
orders (ABBA), so that a drift of the machine's speed falls on all alike. One stream:
--requests unseen chat prompts, greedy, one at a time, after one request of another
prompt to warm up. Per cell: tokens per second over whole requests (the prompt's prefill
included) and after their first token; per topology, each variant over K = 0. Every
output is checked against K = 0's on the same topology. Writes split.json and split.md
to --out."""

import argparse
import os
import statistics
from pathlib import Path

from deploy.bench import harness

TOPOLOGIES = ("shared", "split")
VARIANTS = ("defaults", "K = 0")


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = harness.model_flags(parser or harness.parser_for("split", __doc__), "split-out")
    parser.add_argument("--prompts", type=Path, default=harness.UNSEEN_PROMPTS,
                        help="one chat prompt a line (the unseen set by default)")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--passes", type=int, default=2, help="passes over the four cells, in alternate orders")
    parser.add_argument("--topologies", default=",".join(TOPOLOGIES))
    parser.add_argument("--overlap", action="store_true", help="a third variant: the defaults with --overlap")
    return parser


def deployment(args, topology: str, overlap: bool = False):
    """The services of one cell's deployment, placed as `topology` places them."""
    cores = sorted(os.sched_getaffinity(0))
    if topology == "shared" or len(cores) < 2:
        return harness.plan(args, overlap=overlap)
    verifier_cores = tuple(cores[:-1])
    services = harness.plan(args, overlap=overlap, verifier_flags=["--threads", str(len(verifier_cores))])
    for service in services:
        service.cpus = verifier_cores if service.name == "verifier" else (cores[-1],)
        service.nice = 0  # the drafter's core is not the verifier's: nothing to yield to
    return services


def cell(args, topology: str, variant: str, prompts: list[str], warm: str) -> dict:
    k = 0 if variant == "K = 0" else None
    with harness.running(deployment(args, topology, variant == "overlap"), log_dir=harness.log_dir(args)) as (
            services,):
        with harness.orchestrator(services) as stub:
            harness.stream(stub, harness.request(chat=warm, max_new_tokens=args.max_new_tokens, k=k))
            calls = [harness.stream(stub, harness.request(chat=p, max_new_tokens=args.max_new_tokens, k=k))
                     for p in prompts]
    tokens = sum(len(c.tokens) for c in calls)
    after = [c.after_first() for c in calls]
    stats = [c.stats for c in calls]
    drafted = sum(s.draft_tokens for s in stats)
    # The time the rounds waited on the drafter and on the verifier (a run's steps
    # included), a token: where a token's time goes.
    per_token = {f"{part}_ms_a_token": 1e3 * sum(getattr(s, f"{part}_seconds") for s in stats) / tokens
                 for part in ("draft", "verify")}
    return {"tokens": [c.tokens for c in calls], "tok_s": tokens / sum(c.seconds for c in calls),
            "tok_s_after_first": sum(n for n, _ in after) / sum(s for _, s in after),
            "drafted": drafted, "accepted": sum(s.accepted_tokens for s in stats),
            **per_token, "lookaheads": sum(s.lookaheads for s in stats),
            "lookahead_hits": sum(s.lookahead_hits for s in stats),
            "offers": sum(s.run_offers for s in stats), "offered_accepted": sum(s.offered_accepted for s in stats)}


def over_target(pairs: list[tuple[dict, dict]]) -> dict:
    """A variant's cells against K = 0's of the same passes."""
    return {"speedups": [d["tok_s"] / z["tok_s"] for d, z in pairs],
            "speedup": statistics.median(d["tok_s"] / z["tok_s"] for d, z in pairs),
            "speedup_after_first": statistics.median(d["tok_s_after_first"] / z["tok_s_after_first"]
                                                     for d, z in pairs),
            "same": sum(a == b for d, z in pairs for a, b in zip(d["tokens"], z["tokens"])),
            "checked": sum(len(z["tokens"]) for _, z in pairs)}


def markdown(rows: list[dict], summary: dict, meta: dict) -> str:
    lines = [f"{meta['requests']} unseen chat prompts x {meta['max_new_tokens']} new tokens, greedy, one stream; "
             f"a fresh deployment a cell, {meta['passes']} passes (ABBA)", "",
             "| pass | topology | variant | tok/s | tok/s after the first token | drafted | accepted "
             "| waited on the drafter, ms a token | on the verifier | drafted ahead (used) | offers to runs "
             "(drafts kept) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['pass']} | {r['topology']} | {r['variant']} | {r['tok_s']:.1f} | "
                     f"{r['tok_s_after_first']:.1f} | {r['drafted']} | {r['accepted']} | "
                     f"{r['draft_ms_a_token']:.2f} | {r['verify_ms_a_token']:.2f} | "
                     f"{r['lookaheads']} ({r['lookahead_hits']}) | {r['offers']} ({r['offered_accepted']}) |")
    lines += ["", "| topology | variant | over K = 0 (median of passes) | each pass | after the first token | "
                  "same output as K = 0 |", "|---|---|---|---|---|---|"]
    for topology, by_variant in summary.items():
        for variant, v in by_variant.items():
            lines.append(f"| {topology} | {variant} | {v['speedup']:.2f}x | "
                         f"{', '.join(f'{x:.2f}' for x in v['speedups'])} | {v['speedup_after_first']:.2f}x | "
                         f"{v['same']}/{v['checked']} |")
    return "\n".join(lines) + "\n"


def main_with(args) -> int:
    topologies = [t.strip() for t in args.topologies.split(",") if t.strip()]
    if not topologies or set(topologies) - set(TOPOLOGIES) or args.requests < 1 or args.passes < 1:
        raise SystemExit(f"--topologies: some of {', '.join(TOPOLOGIES)}; --requests and --passes >= 1")
    lines = [line.strip() for line in args.prompts.read_text().splitlines() if line.strip()]
    if len(lines) < args.requests + 1:
        raise SystemExit(f"--prompts: {len(lines)} prompts, fewer than --requests + 1 (a warm-up)")
    warm, prompts = lines[-1], lines[:args.requests]
    variants = [*VARIANTS, "overlap"] if args.overlap else list(VARIANTS)
    order = [(t, v) for t in topologies for v in variants]
    rows = []
    for i in range(args.passes):
        for topology, variant in (order if i % 2 == 0 else order[::-1]):
            row = {"pass": i + 1, "topology": topology, "variant": variant,
                   **cell(args, topology, variant, prompts, warm)}
            rows.append(row)
            print(f"pass {row['pass']}, {topology}, {variant}: {row['tok_s']:.1f} tok/s "
                  f"({row['tok_s_after_first']:.1f} after the first token), {row['accepted']} of "
                  f"{row['drafted']} drafts accepted", flush=True)
    summary = {}
    for topology in topologies:
        of = {v: [r for r in rows if r["topology"] == topology and r["variant"] == v] for v in variants}
        summary[topology] = {v: over_target(list(zip(of[v], of["K = 0"]))) for v in variants if v != "K = 0"}
    meta = {"target": args.target, "draft": args.draft, "requests": args.requests,
            "max_new_tokens": args.max_new_tokens, "passes": args.passes, "cores": len(os.sched_getaffinity(0))}
    harness.write_report(args.out, "split", {"meta": meta, "rows": rows, "summary": summary},
                         markdown(rows, summary, meta))
    return harness.failed_if(any(v["same"] != v["checked"] for s in summary.values() for v in s.values()),
                             "some outputs differ from K = 0's")
