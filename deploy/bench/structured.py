"""Structured work: `specdec bench structured`.

Prompts that ask for JSON against a schema (deploy/bench/structured_prompts.jsonl: 16 field
extractions from a sentence, 16 function calls from a tool list, each with its schema,
its strings bounded to 48 characters and its lists to 5 items; none is a template of
another), through one deployment as `specdec up` starts it, one
at a time, greedy, each output constrained by its schema. Each prompt is sent
  defaults       the deployment's defaults (K per round; the grammar's forced tokens drafted)
  k0             K = 0: the target alone under the same constraint (must equal the defaults)
  k0-free        K = 0 without the constraint: what the constraint costs the target alone
in that order (the defaults first, so they never draft from this prompt's own output
kept in the deployment's memory; a later prompt may draft from an earlier one's, as any
deployment would). First a one-token request of the prompt puts it in the verifier's
prefix cache, so that each of the three finds it there (sent cold, the defaults alone
would pay its prefill, and whole-request times would charge it to them); before each of
the three, a one-token request of the prompt's words in reverse gives its steps a
prefill of about that size to follow, as a new request's steps have (the repeat
benchmark's reason). With --llama-cpp DIR, the same token ids through llama.cpp's `llama-server` on
the same GGUF with its `json_schema`, the same client loop (its numerics: its outputs are
checked against the schema, not against ours).

With --concurrency N (N > 1), then under load: every prompt from N clients at once, one
fresh deployment per pass (the deployment keeps outputs for lookup drafts: a pass must
not draft from another pass's outputs), the defaults and K = 0 under the schema
alternated --load-runs times; tokens per second over each pass's wall clock, and whether
each output equals the sequential K = 0 one.

Reports, per task and over all: the speedup of the defaults over K = 0 (tokens per
second after the first token, as bench-repeat; and whole-request time), the cost of the
constraint at K = 0 (seconds per token after the first, constrained over free), how many
outputs are valid JSON under their schema, how many equal K = 0's token for token, and
how many K = 0 outputs equal the target's own transformers `generate` under the same
schema (its whole mask applied each step: a check that shares none of the services'
picking code; --no-reference skips it).
Writes structured.json and structured.md to --out."""

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema

from deploy.bench import harness
from deploy.bench.harness import ratio as _x
from deploy.bench.load import reference_outputs
from specdec import model_files
from specdec.api.common.v1 import common_pb2
from specdec.api.orchestrator.v1 import orchestrator_pb2 as pb


def read_workload(path: Path, limit: int | None) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if limit:  # spread over the tasks
        rows = rows[::max(1, len(rows) // limit)][:limit]
    return rows


def valid(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def constrained(stub, text: str, k: int | None, schema: dict | None, max_new_tokens: int) -> dict:
    """One greedy chat request under the schema (None: free): its times, output and stats."""
    request = harness.request(chat=text, max_new_tokens=max_new_tokens, k=k)
    if schema is not None:
        request.constraint.json_schema = json.dumps(schema)
    call = harness.stream(stub, request)
    after_tokens, after_s = call.after_first()
    return {"seconds": call.seconds, "after_tokens": after_tokens, "after_s": after_s, "tokens": call.tokens,
            "text": call.result.text, "finish": pb.FinishReason.Name(call.result.finish_reason),
            "rounds": call.stats.rounds, "drafted": call.stats.draft_tokens, "accepted": call.stats.accepted_tokens}


def through_specdec(args, workload: list[dict]) -> tuple[list[dict], list[list[int]]]:
    tokenizer = model_files.load_tokenizer(args.target)
    with harness.running(harness.plan(args), log_dir=harness.log_dir(args)) as (services,), \
            harness.orchestrator(services) as stub:

        def run(text, k, schema, max_new_tokens=args.max_new_tokens):
            return constrained(stub, text, k, schema, max_new_tokens)

        run("Say hello.", 0, {"type": "object"})  # the first request's set-up out of the figures
        rows, prompt_ids = [], []
        for i, item in enumerate(workload):
            text, schema = item["prompt"], item["schema"]
            run(text, 0, None, 1)  # the prompt cached for every run of it, not for the second and third only
            runs = {}
            for name, k, constraint in (("defaults", None, schema), ("k0", 0, schema), ("k0-free", 0, None)):
                run(" ".join(reversed(text.split())), 0, None, 1)
                runs[name] = run(text, k, constraint)
            d, k0, free = runs["defaults"], runs["k0"], runs["k0-free"]
            row = {"request": i, "task": item["task"], "tokens": len(k0["tokens"]),
                   "same": d["tokens"] == k0["tokens"], "valid": valid(d["text"], schema),
                   "finish": d["finish"], "runs": runs,
                   "speedup": _rate(d) / _rate(k0) if _rate(k0) else None,
                   "time_speedup": k0["seconds"] / d["seconds"],
                   "constraint_cost": _per_token(k0) / _per_token(free) if _per_token(free) else None}
            rows.append(row)
            prompt_ids.append(harness.chat_ids(tokenizer, text))
            print(f"{i} {item['task']}: {row['tokens']} tokens, {'valid' if row['valid'] else 'INVALID'}, "
                  f"{'same' if row['same'] else 'DIFFERENT'}; after the first token "
                  f"{_x(row['speedup'])}, whole request {_x(row['time_speedup'])}; "
                  f"{d['accepted']}/{d['drafted']} drafts accepted in {d['rounds']} rounds; "
                  f"constraint at K = 0 {_x(row['constraint_cost'], 3)} a free token", flush=True)
        return rows, prompt_ids


def _rate(run: dict) -> float:
    return run["after_tokens"] / run["after_s"] if run["after_tokens"] else 0.0


def _per_token(run: dict) -> float:
    return run["after_s"] / run["after_tokens"] if run["after_tokens"] else 0.0


def under_load(args, workload: list[dict], reference: list[list[int]]) -> list[dict]:
    """Each pass: all of `workload` from `args.concurrency` clients at once, on a fresh
    deployment, the defaults and K = 0 (constrained) alternated."""
    passes = []
    for run in range(args.load_runs):
        for variant, k in (("defaults", None), ("k0", 0)):
            with harness.running(harness.plan(args), log_dir=harness.log_dir(args)) as (services,), \
                    harness.orchestrator(services) as stub:
                constrained(stub, "Say hello.", 0, {"type": "object"}, args.max_new_tokens)  # set-up
                started = time.perf_counter()
                with ThreadPoolExecutor(args.concurrency) as pool:
                    outs = list(pool.map(lambda item: constrained(stub, item["prompt"], k, item["schema"],
                                                                  args.max_new_tokens), workload))
                seconds = time.perf_counter() - started
            tokens = sum(len(o["tokens"]) for o in outs)
            passes.append({"run": run, "variant": variant, "seconds": seconds, "tokens": tokens,
                           "tokens_per_s": tokens / seconds,
                           "same": sum(o["tokens"] == ref for o, ref in zip(outs, reference)),
                           "valid": sum(valid(o["text"], item["schema"]) for o, item in zip(outs, workload)),
                           "drafted": sum(o["drafted"] for o in outs), "accepted": sum(o["accepted"] for o in outs)})
            print(f"load run {run} {variant}: {tokens} tokens in {seconds:.1f} s, {tokens / seconds:.1f} tok/s, "
                  f"{passes[-1]['same']}/{len(outs)} same as K = 0 alone", flush=True)
    return passes


def load_markdown(passes: list[dict], meta: dict) -> str:
    n = meta["requests"]
    lines = ["", f"under load: every prompt from {meta['concurrency']} clients at once, a fresh deployment per pass",
             "",
             "| run | defaults tok/s | K = 0 tok/s | defaults / K = 0 | acceptance | same as K = 0 alone | valid |",
             "|---|---|---|---|---|---|---|"]
    for run in sorted({p["run"] for p in passes}):
        d, k = (next(p for p in passes if p["run"] == run and p["variant"] == v) for v in ("defaults", "k0"))
        lines.append(f"| {run} | {d['tokens_per_s']:.1f} | {k['tokens_per_s']:.1f} | "
                     f"{_x(d['tokens_per_s'] / k['tokens_per_s'])} | {d['accepted'] / max(1, d['drafted']):.2f} | "
                     f"{d['same']}/{n}, {k['same']}/{n} | {d['valid']}/{n} |")
    return "\n".join(lines) + "\n"


def through_llama_cpp(args, workload: list[dict], prompt_ids: list[list[int]]) -> list[dict]:
    out = []
    with harness.llama_server(args.llama_cpp, args.target) as url:
        for item, ids in zip(workload, prompt_ids):
            started = time.perf_counter()
            answer = harness.llama_completion(url, ids, args.max_new_tokens, json_schema=item["schema"])
            seconds = time.perf_counter() - started
            timings = answer.get("timings", {})
            out.append({"seconds": seconds, "tokens": timings.get("predicted_n"),
                        "decode_tokens_per_s": timings.get("predicted_per_second"),
                        "valid": valid(answer.get("content", ""), item["schema"])})
    return out


def summary(rows: list[dict], llama: list[dict] | None) -> dict:
    def part(part_rows, llama_part):
        d_s = sum(r["runs"]["defaults"]["after_s"] for r in part_rows)
        k_s = sum(r["runs"]["k0"]["after_s"] for r in part_rows)
        d_n = sum(r["runs"]["defaults"]["after_tokens"] for r in part_rows)
        k_n = sum(r["runs"]["k0"]["after_tokens"] for r in part_rows)
        free = [r["runs"]["k0-free"] for r in part_rows]
        speedups = [r["speedup"] for r in part_rows if r["speedup"] is not None]  # one-token outputs have none
        out = {"requests": len(part_rows), "tokens": sum(r["tokens"] for r in part_rows),
               "speedup": (d_n / d_s) / (k_n / k_s) if d_s and k_s else None,
               "median_speedup": statistics.median(speedups) if speedups else None,
               "worst_speedup": min(speedups) if speedups else None,
               "time_speedup": sum(r["runs"]["k0"]["seconds"] for r in part_rows)
               / sum(r["runs"]["defaults"]["seconds"] for r in part_rows),
               "constraint_cost": (k_s / k_n) / (sum(f["after_s"] for f in free) / sum(f["after_tokens"] for f in free))
               if k_n and sum(f["after_tokens"] for f in free) else None,
               "acceptance": sum(r["runs"]["defaults"]["accepted"] for r in part_rows)
               / max(1, sum(r["runs"]["defaults"]["drafted"] for r in part_rows)),
               "valid": sum(r["valid"] for r in part_rows), "same": sum(r["same"] for r in part_rows),
               "target_alone": sum(r["target_alone"] for r in part_rows) if "target_alone" in part_rows[0] else None,
               "k0_ms_per_token": 1e3 * k_s / k_n if k_n else None,
               "defaults_ms_per_token": 1e3 * d_s / d_n if d_n else None}
        if llama_part:
            out["llama_cpp_valid"] = sum(x["valid"] for x in llama_part)
            out["llama_cpp_seconds"] = sum(x["seconds"] for x in llama_part)
            out["k0_seconds"] = sum(r["runs"]["k0"]["seconds"] for r in part_rows)
            out["defaults_seconds"] = sum(r["runs"]["defaults"]["seconds"] for r in part_rows)
            rates = [x["decode_tokens_per_s"] for x in llama_part if x["decode_tokens_per_s"]]
            out["llama_cpp_decode_tokens_per_s"] = statistics.median(rates) if rates else None
        return out

    tasks = sorted({r["task"] for r in rows})
    by = {task: part([r for r in rows if r["task"] == task],
                     [x for x, r in zip(llama or [], rows) if r["task"] == task]) for task in tasks}
    by["all"] = part(rows, llama)
    return by


def markdown(s: dict, meta: dict) -> str:
    lines = [f"target `{meta['target']}`, draft `{meta['draft']}`, {meta['requests']} prompts, at most "
             f"{meta['max_new_tokens']} new tokens, greedy, one at a time; each with the defaults, then at K = 0 "
             "under the same schema, then at K = 0 free", "",
             "| task | prompts | tokens | defaults / K = 0 after the first token (aggregate) | median | worst | "
             "whole requests | acceptance | K = 0 ms/token | constraint's cost at K = 0 | valid JSON | same as K = 0 | "
             "K = 0 the same as the target's own generate |"
             + (" llama.cpp total s (valid) | ours K = 0 / defaults total s |" if meta["llama_cpp"] else ""),
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if meta["llama_cpp"] else "")]
    for task, p in s.items():
        own = "not checked" if p["target_alone"] is None else f"{p['target_alone']}/{p['requests']}"
        line = (f"| {task} | {p['requests']} | {p['tokens']} | {_x(p['speedup'])} | {_x(p['median_speedup'])} | "
                f"{_x(p['worst_speedup'])} | {_x(p['time_speedup'])} | {p['acceptance']:.2f} | "
                f"{p['k0_ms_per_token'] or 0:.1f} | {_x(p['constraint_cost'], 3)} | {p['valid']}/{p['requests']} | "
                f"{p['same']}/{p['requests']} | {own} |")
        if meta["llama_cpp"]:
            line += (f" {p['llama_cpp_seconds']:.2f} ({p['llama_cpp_valid']}/{p['requests']}) | "
                     f"{p['k0_seconds']:.2f} / {p['defaults_seconds']:.2f} |")
        lines.append(line)
    return "\n".join(lines) + "\n"


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = harness.model_flags(parser or harness.parser_for("structured", __doc__), "structured-out")
    parser.add_argument("--prompts", type=Path, default=harness.STRUCTURED_PROMPTS,
                        help="JSON lines: task, prompt, schema")
    parser.add_argument("--limit", type=int, help="at most this many prompts (spread over the file)")
    parser.add_argument("--max-new-tokens", type=int, default=256,
                        help="room for every output the workload's schemas allow (their strings and lists are bounded)")
    parser.add_argument("--llama-cpp", metavar="DIR", help="llama.cpp's bin directory: llama-server beside ours")
    parser.add_argument("--no-reference", dest="reference", action="store_false",
                        help="skip checking each K = 0 output against the target's own generate under the schema")
    parser.add_argument("--concurrency", type=int, default=1,
                        help="then every prompt from this many clients at once, defaults against K = 0 (1: no load)")
    parser.add_argument("--load-runs", type=int, default=1, help="alternations of the load passes")
    return parser


def main_with(args) -> int:
    workload = read_workload(args.prompts, args.limit)
    rows, prompt_ids = through_specdec(args, workload)
    if args.reference:
        own = reference_outputs(args.target, args.dtype, args.device, args.quantize, prompt_ids,
                                list(range(len(rows))), args.max_new_tokens,
                                constraints=[common_pb2.Constraint(json_schema=json.dumps(item["schema"]))
                                             for item in workload])
        for i, row in enumerate(rows):
            row["target_alone"] = row["runs"]["k0"]["tokens"] == own[i]
    llama = through_llama_cpp(args, workload, prompt_ids) if args.llama_cpp else None
    load = under_load(args, workload, [r["runs"]["k0"]["tokens"] for r in rows]) if args.concurrency > 1 else None
    s = summary(rows, llama)
    meta = {"target": args.target, "draft": args.draft, "requests": len(rows), "max_new_tokens": args.max_new_tokens,
            "llama_cpp": bool(llama), "concurrency": args.concurrency}
    text = markdown(s, meta) + (load_markdown(load, meta) if load else "")
    harness.write_report(args.out, "structured", {"meta": meta, "summary": s, "rows": rows, "llama_cpp": llama,
                                                  "load": load}, text)
    differ = not all(r["same"] and r.get("target_alone", True) for r in rows) \
        or any(p["same"] < len(rows) for p in load or [])
    return harness.failed_if(differ, "some outputs differ between the defaults, K = 0 and the target's own generate")
