"""Structured work: `specdec bench-structured` (or `python -m deploy.bench_structured`).

Prompts that ask for JSON against a schema (deploy/structured_prompts.jsonl: 16 field
extractions from a sentence, 16 function calls from a tool list, each with its schema;
none is a template of another), through one deployment as `specdec up` starts it, one
at a time, greedy, each output constrained by its schema. Each prompt is sent
  defaults       the deployment's defaults (K per round; the grammar's forced tokens drafted)
  k0             K = 0: the target alone under the same constraint (must equal the defaults)
  k0-free        K = 0 without the constraint: what the constraint costs the target alone
in that order (the defaults first, so they never draft from this prompt's own output
kept in the deployment's memory; a later prompt may draft from an earlier one's, as any
deployment would). Before each K = 0 request, a one-token request of the prompt's words
in reverse gives its steps a prefill to follow, as the defaults' have (bench-repeat's
reason). With --llama-cpp DIR, the same token ids through llama.cpp's `llama-server` on
the same GGUF with its `json_schema`, the same client loop (its numerics: its outputs are
checked against the schema, not against ours).

Reports, per task and over all: the speedup of the defaults over K = 0 (tokens per
second after the first token, as bench-repeat; and whole-request time), the cost of the
constraint at K = 0 (seconds per token after the first, constrained over free), how many
outputs are valid JSON under their schema, and how many equal K = 0's token for token.
Writes bench-structured.json and bench-structured.md to --out."""

import argparse
import json
import statistics
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import jsonschema

from deploy import launch
from deploy.bench_load import llama_server
from specdec import modeling
from specdec.orchestrator.v1 import orchestrator_pb2 as pb, orchestrator_pb2_grpc

PROMPTS = Path(__file__).parent / "structured_prompts.jsonl"


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


class Client:
    def __init__(self, stub, max_new_tokens: int):
        self.stub, self.max_new_tokens = stub, max_new_tokens

    def run(self, text: str, k: int | None, schema: dict | None, max_new_tokens: int | None = None) -> dict:
        """One greedy chat request: its times, output and stats."""
        request = pb.GenerateRequest(max_new_tokens=max_new_tokens or self.max_new_tokens)
        request.chat.messages.append(pb.ChatMessage(role="user", content=text))
        if k is not None:
            request.num_speculative_tokens = k
        if schema is not None:
            request.constraint.json_schema = json.dumps(schema)
        started, first, result = time.perf_counter(), None, None
        for event in self.stub.Generate(request):
            if event.HasField("chunk") and event.chunk.token_ids and first is None:
                first = (time.perf_counter(), len(event.chunk.token_ids))
            if event.HasField("result"):
                result = event.result
        ended = time.perf_counter()
        after = len(result.token_ids) - first[1] if first else 0
        return {"seconds": ended - started, "after_tokens": after, "after_s": ended - first[0] if first else 0.0,
                "tokens": list(result.token_ids), "text": result.text, "finish": pb.FinishReason.Name(result.finish_reason),
                "rounds": result.stats.rounds, "drafted": result.stats.draft_tokens,
                "accepted": result.stats.accepted_tokens}


def through_specdec(args, workload: list[dict]) -> tuple[list[dict], list[list[int]]]:
    numerics = ["--quantize", args.quantize]
    services = launch.plan(args.target, args.draft, 1, launch.free_port(), args.dtype, args.device,
                           verifier_flags=numerics, drafter_flags=numerics)
    launch.start(services, log=None if args.verbose else open(args.out / "services.log", "a"))
    tokenizer = modeling.load_tokenizer(args.target)
    try:
        launch.wait_serving(services, 600)
        with grpc.insecure_channel(services[-1].address) as channel:
            client = Client(orchestrator_pb2_grpc.OrchestratorServiceStub(channel), args.max_new_tokens)
            client.run("Say hello.", 0, {"type": "object"})  # the first request's set-up out of the figures
            rows, prompt_ids = [], []
            for i, item in enumerate(workload):
                text, schema = item["prompt"], item["schema"]
                runs = {"defaults": client.run(text, None, schema)}
                for name, constrained in (("k0", schema), ("k0-free", None)):
                    client.run(" ".join(reversed(text.split())), 0, None, 1)
                    runs[name] = client.run(text, 0, constrained)
                d, k0, free = runs["defaults"], runs["k0"], runs["k0-free"]
                row = {"request": i, "task": item["task"], "tokens": len(k0["tokens"]),
                       "same": d["tokens"] == k0["tokens"], "valid": valid(d["text"], schema),
                       "finish": d["finish"], "runs": runs,
                       "speedup": _rate(d) / _rate(k0) if _rate(k0) else None,
                       "time_speedup": k0["seconds"] / d["seconds"],
                       "constraint_cost": _per_token(k0) / _per_token(free) if _per_token(free) else None}
                rows.append(row)
                rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                         add_generation_prompt=True, tokenize=False)
                prompt_ids.append(tokenizer(rendered, add_special_tokens=False)["input_ids"])
                print(f"{i} {item['task']}: {row['tokens']} tokens, {'valid' if row['valid'] else 'INVALID'}, "
                      f"{'same' if row['same'] else 'DIFFERENT'}; after the first token "
                      f"{_x(row['speedup'])}, whole request {_x(row['time_speedup'])}; "
                      f"{d['accepted']}/{d['drafted']} drafts accepted in {d['rounds']} rounds; "
                      f"constraint at K = 0 {_x(row['constraint_cost'], 3)} a free token", flush=True)
            return rows, prompt_ids
    finally:
        launch.stop(services)


def _x(ratio: float | None, digits: int = 2) -> str:
    return "n/a" if ratio is None else f"{ratio:.{digits}f}x"


def _rate(run: dict) -> float:
    return run["after_tokens"] / run["after_s"] if run["after_tokens"] else 0.0


def _per_token(run: dict) -> float:
    return run["after_s"] / run["after_tokens"] if run["after_tokens"] else 0.0


def through_llama_cpp(args, workload: list[dict], prompt_ids: list[list[int]]) -> list[dict]:
    process, url = llama_server(args.llama_cpp, args.target, 1, args.max_new_tokens)
    try:
        out = []
        for item, ids in zip(workload, prompt_ids):
            body = {"prompt": ids, "n_predict": args.max_new_tokens, "temperature": 0, "top_k": 1,
                    "json_schema": item["schema"], "cache_prompt": False}
            started = time.perf_counter()
            request = urllib.request.Request(f"{url}/completion", data=json.dumps(body).encode(),
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=300) as response:
                answer = json.loads(response.read())
            seconds = time.perf_counter() - started
            timings = answer.get("timings", {})
            out.append({"seconds": seconds, "tokens": timings.get("predicted_n"),
                        "decode_tokens_per_s": timings.get("predicted_per_second"),
                        "valid": valid(answer.get("content", ""), item["schema"])})
        return out
    finally:
        process.kill()


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
             "whole requests | acceptance | K = 0 ms/token | constraint's cost at K = 0 | valid JSON | same as K = 0 |"
             + (" llama.cpp total s (valid) | ours K = 0 / defaults total s |" if meta["llama_cpp"] else ""),
             "|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if meta["llama_cpp"] else "")]
    for task, p in s.items():
        line = (f"| {task} | {p['requests']} | {p['tokens']} | {_x(p['speedup'])} | {_x(p['median_speedup'])} | "
                f"{_x(p['worst_speedup'])} | {_x(p['time_speedup'])} | {p['acceptance']:.2f} | "
                f"{p['k0_ms_per_token'] or 0:.1f} | {_x(p['constraint_cost'], 3)} | {p['valid']}/{p['requests']} | "
                f"{p['same']}/{p['requests']} |")
        if meta["llama_cpp"]:
            line += (f" {p['llama_cpp_seconds']:.2f} ({p['llama_cpp_valid']}/{p['requests']}) | "
                     f"{p['k0_seconds']:.2f} / {p['defaults_seconds']:.2f} |")
        lines.append(line)
    return "\n".join(lines) + "\n"


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="specdec bench-structured", description=__doc__,
                                               formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=modeling.DEFAULT_TARGET)
    parser.add_argument("--draft", default=modeling.DEFAULT_DRAFT)
    parser.add_argument("--prompts", type=Path, default=PROMPTS, help="JSON lines: task, prompt, schema")
    parser.add_argument("--limit", type=int, help="at most this many prompts (spread over the file)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--llama-cpp", metavar="DIR", help="llama.cpp's bin directory: llama-server beside ours")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=sorted(modeling.DTYPES))
    parser.add_argument("--quantize", default="auto", choices=["auto", "gguf", "int8", "none"])
    parser.add_argument("--verbose", action="store_true", help="the services' logs on this terminal")
    parser.add_argument("--out", type=Path, default=Path("bench-structured-out"))
    return parser


def main_with(args) -> int:
    args.out.mkdir(parents=True, exist_ok=True)
    workload = read_workload(args.prompts, args.limit)
    rows, prompt_ids = through_specdec(args, workload)
    llama = through_llama_cpp(args, workload, prompt_ids) if args.llama_cpp else None
    s = summary(rows, llama)
    meta = {"target": args.target, "draft": args.draft, "requests": len(rows), "max_new_tokens": args.max_new_tokens,
            "llama_cpp": bool(llama), "command": " ".join(sys.argv)}
    (args.out / "bench-structured.json").write_text(
        json.dumps({"meta": meta, "summary": s, "rows": rows, "llama_cpp": llama}, indent=1) + "\n")
    (args.out / "bench-structured.md").write_text(markdown(s, meta))
    print((args.out / "bench-structured.md").read_text())
    if not all(r["same"] for r in rows):
        print("some outputs differ between the defaults and K = 0", file=sys.stderr)
        return 1
    return 0


def main(argv=None) -> None:
    raise SystemExit(main_with(build_parser().parse_args(argv)))


if __name__ == "__main__":
    main()
