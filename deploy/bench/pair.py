"""A real pair, end to end, against llama.cpp's server: `specdec bench pair`.

The target and draft by default are the real pair (Qwen2.5-Coder 1.5B, Q4_K_M, drafted by
its 0.5B; `specdec fetch` brings them), a target several times its draft's cost: the case
speculation is for. Cells, each a fresh deployment (nothing learned or remembered from
another cell), the cells of a pass in turn and the passes in opposite orders (ABBA):
  shared, split  the deployment as `specdec up` starts it, and with the verifier on cores
                 of its own (`specdec bench split`), each with the defaults and at K = 0
                 (the target alone through the same services);
  llama.cpp      with --llama-cpp DIR: `llama-server` on the same files and every core,
                 alone and with the draft (-md, --spec-type draft-simple).
The same prompts to all (--categories of --prompts, --per-category each, through the
target's chat template, as token ids), greedy, one at a time, after one request of
another prompt to warm up. Per cell and category: the median of the requests' tokens per
second (the prompt's prefill included), and the mean accepted length (1 + accepted
drafts / rounds, as Spec-Bench reports it). Every output of ours is checked against K =
0's on the same topology. Writes pair.json and pair.md to --out."""

import argparse
import os
import statistics
import time
from pathlib import Path

from deploy.bench import harness, split
from specdec import fetch, model_files

PAIR = ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct")
OURS = [(topology, variant) for topology in split.TOPOLOGIES for variant in split.VARIANTS]
LLAMA = [("llama.cpp", "alone"), ("llama.cpp", "with the draft")]


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = harness.model_flags(parser or harness.parser_for("pair", __doc__), "pair-out")
    parser.set_defaults(target=PAIR[0], draft=PAIR[1])
    parser.add_argument("--prompts", type=Path, default=harness.PROMPTS)
    parser.add_argument("--categories", default="chat,code,repetitive",
                        help="the prompt file's categories to run (repetitive: copying tasks)")
    parser.add_argument("--per-category", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--passes", type=int, default=2, help="passes over the cells, in alternate orders")
    parser.add_argument("--topologies", default=",".join(split.TOPOLOGIES))
    parser.add_argument("--llama-cpp", metavar="DIR", help="llama.cpp's bin directory: llama-server's cells")
    parser.add_argument("--llama-draft-max", type=int, default=3, help="llama-server's --spec-draft-n-max (drafts a round)")
    return parser


def summary_of(calls: list[tuple[str, int, float, int, int]]) -> dict:
    """Per category, from (category, tokens, seconds, accepted, rounds) of each request."""
    out = {}
    for category in dict.fromkeys(c for c, *_ in calls):
        mine = [c for c in calls if c[0] == category]
        rounds = sum(r for *_, r in mine)
        out[category] = {"tok_s": statistics.median(n / s for _, n, s, _, _ in mine),
                         "accept_length": 1 + sum(a for *_, a, _ in mine) / rounds if rounds else None}
    return out


def ours(args, topology: str, variant: str, prompts: list[tuple[str, list[int]]], warm: list[int]) -> dict:
    k = 0 if variant == "K = 0" else None
    with harness.running(split.deployment(args, topology), log_dir=harness.log_dir(args)) as (services,):
        with harness.orchestrator(services) as stub:
            harness.stream(stub, harness.request(ids=warm, max_new_tokens=args.max_new_tokens, k=k))
            streams = [harness.stream(stub, harness.request(ids=ids, max_new_tokens=args.max_new_tokens, k=k))
                       for _, ids in prompts]
    calls = [(category, len(s.tokens), s.seconds, s.stats.accepted_tokens, s.stats.rounds)
             for (category, _), s in zip(prompts, streams)]
    return {"tokens": [s.tokens for s in streams], "by_category": summary_of(calls)}


def llama(args, variant: str, prompts: list[tuple[str, list[int]]], warm: list[int]) -> dict:
    extra = [] if variant == "alone" else [
        "-md", harness.gguf_of(args.draft), "--spec-type", "draft-simple", "--spec-draft-n-max", str(args.llama_draft_max)]
    calls, tokens = [], []
    with harness.llama_server(args.llama_cpp, args.target, extra=extra) as url:
        harness.llama_completion(url, warm, args.max_new_tokens)
        for category, ids in prompts:
            started = time.perf_counter()
            answer = harness.llama_completion(url, ids, args.max_new_tokens, return_tokens=True)
            seconds = time.perf_counter() - started
            drafted, accepted = answer.get("timings", {}).get("draft_n", 0), answer.get("timings", {}).get(
                "draft_n_accepted", 0)
            # llama.cpp reports drafts, not rounds: a round of --draft-max drafts, at best
            rounds = -(-drafted // args.llama_draft_max) if drafted else 0
            calls.append((category, len(answer["tokens"]), seconds, accepted, rounds))
            tokens.append(answer["tokens"])
    return {"tokens": tokens, "by_category": summary_of(calls)}


def markdown(rows: list[dict], summary: dict, meta: dict) -> str:
    categories = meta["categories"]
    lines = [f"{meta['target']} verified, {meta['draft']} drafting; {meta['per_category']} prompts a category x "
             f"{meta['max_new_tokens']} new tokens, greedy, one stream, {meta['cores']} cores; a fresh deployment "
             f"a cell, {meta['passes']} passes (ABBA)", "",
             "| pass | cell | " + " | ".join(f"{c} tok/s | {c} accepted length" for c in categories) + " |",
             "|---|---|" + "---|---|" * len(categories)]
    for r in rows:
        cells = [f"{r['by_category'][c]['tok_s']:.1f} | " + (
            f"{r['by_category'][c]['accept_length']:.2f}" if r['by_category'][c]['accept_length'] else "-")
            for c in categories]
        lines.append(f"| {r['pass']} | {r['topology']}, {r['variant']} | " + " | ".join(cells) + " |")
    lines += ["", "Medians of the passes: tokens per second; over K = 0 of the same topology; over llama.cpp's "
                  "best cell (alone or with the draft) of the category", "",
              "| cell | " + " | ".join(categories) + " | same output as K = 0 |",
              "|---|" + "---|" * len(categories) + "---|"]
    for cell, s in summary.items():
        parts = [f"{v['tok_s']:.1f} tok/s, {harness.ratio(v['over_k0'])}, {harness.ratio(v['over_llama'])}"
                 for v in (s["by_category"][c] for c in categories)]
        lines.append(f"| {cell} | " + " | ".join(parts) + f" | {s.get('same', '-')} |")
    return "\n".join(lines) + "\n"


def main_with(args) -> int:
    topologies = [t.strip() for t in args.topologies.split(",") if t.strip()]
    categories = [c.strip() for c in args.categories.split(",") if c.strip()]
    if set(topologies) - set(split.TOPOLOGIES) or args.per_category < 1 or args.passes < 1:
        raise SystemExit(f"--topologies: some of {', '.join(split.TOPOLOGIES)}; --per-category, --passes >= 1")
    fetch.fetch_all((args.target, args.draft), lambda line: print(line, flush=True))
    tokenizer = model_files.load_tokenizer(args.target)
    every = harness.read_prompts(args.prompts)
    chosen = {c: [p for p in every if p.category == c][:args.per_category] for c in categories}
    if missing := [c for c, ps in chosen.items() if not ps]:
        raise SystemExit(f"--categories: {', '.join(missing)} not in {args.prompts}")
    prompts = [(c, p.encode(tokenizer)) for c, ps in chosen.items() for p in ps]
    warm = next(p for p in every if p.category not in categories or p not in chosen[p.category]).encode(tokenizer)
    cells = [c for c in OURS if c[0] in topologies] + (LLAMA if args.llama_cpp else [])
    rows = []
    for i in range(args.passes):
        for topology, variant in (cells if i % 2 == 0 else cells[::-1]):
            measured = llama(args, variant, prompts, warm) if topology == "llama.cpp" else \
                ours(args, topology, variant, prompts, warm)
            row = {"pass": i + 1, "topology": topology, "variant": variant, **measured}
            rows.append(row)
            print(f"pass {row['pass']}, {topology}, {variant}: " + ", ".join(
                f"{c} {v['tok_s']:.1f} tok/s" for c, v in row["by_category"].items()), flush=True)
    summary = {}
    for topology, variant in cells:
        mine = [r for r in rows if (r["topology"], r["variant"]) == (topology, variant)]
        summary[f"{topology}, {variant}"] = {"topology": topology, "rows": mine, "by_category": {c: {
            "tok_s": statistics.median(r["by_category"][c]["tok_s"] for r in mine),
            "accept_length": statistics.median(r["by_category"][c]["accept_length"] or 0 for r in mine)}
            for c in categories}}
    for key, s in summary.items():
        base = summary.get(f"{s['topology']}, K = 0")
        if base is not None:  # ours: each output against K = 0's of the same pass and topology
            pairs = [(a, b) for r, z in zip(s["rows"], base["rows"]) for a, b in zip(r["tokens"], z["tokens"])]
            s["same"] = f"{sum(a == b for a, b in pairs)}/{len(pairs)}"
        for c, v in s["by_category"].items():
            v["over_k0"] = v["tok_s"] / base["by_category"][c]["tok_s"] if base else None
            best = max((summary[f"llama.cpp, {lv}"]["by_category"][c]["tok_s"] for _, lv in LLAMA
                        if f"llama.cpp, {lv}" in summary), default=None)
            v["over_llama"] = v["tok_s"] / best if best else None
    for s in summary.values():
        del s["rows"]
    meta = {"target": args.target, "draft": args.draft, "categories": categories, "per_category": args.per_category,
            "max_new_tokens": args.max_new_tokens, "passes": args.passes, "cores": len(os.sched_getaffinity(0))}
    harness.write_report(args.out, "pair", {"meta": meta, "rows": rows, "summary": summary},
                         markdown(rows, summary, meta))
    differ = [k for k, s in summary.items() if "same" in s and s["same"].split("/")[0] != s["same"].split("/")[1]]
    return harness.failed_if(bool(differ), f"outputs differ from K = 0's: {', '.join(differ)}")
