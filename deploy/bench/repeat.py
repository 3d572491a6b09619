"""Repeated work: `specdec bench repeat`.

Agents, retries and report generators send requests that repeat each other: the same
template with other values. This replays such a workload through one deployment as
`specdec up` starts it: requests from a few templates (the built-in ones, or --templates),
in order, one at a time, each sent with the defaults and then at K = 0 (the target alone
on the same deployment; sent second, so the defaults never draft from the output of the
same request), greedy. Every pair of outputs must be equal. Reports the speedup per
request, over the first tenth of the requests (before the deployment has seen much) and
over the rest, and the same run with the memory of earlier outputs off
(`--lookup-memory-tokens 0`) when --compare-memory-off is given. Writes repeat.json
and repeat.md to --out.

The speedup is taken after each request's first token: the defaults' tokens per second
from their first streamed chunk to the end over K = 0's. The K = 0 request, sent second
with the same prompt, finds that prompt in the verifier's prefix cache and skips its
prefill; whole-request times would charge that prefill to the defaults alone (a
10-token chat answer, measured: 209 ms in all against K = 0's 152 ms, yet 1.15x after
the first token). The whole-request time ratio is reported beside it. Right before the
K = 0 request, a one-token request of the same words reversed gives its steps a prefill
to follow, as the defaults' steps follow theirs. --control sends the first of each pair
at K = 0 too: what the pair's order alone makes of the ratio (on 2 cores, 32 unseen chat
prompts x 48 tokens, one run: a median 1.02x, the middle half 0.98-1.13x), to read the
defaults' figures against."""

import argparse
import statistics
from pathlib import Path

from deploy.bench import harness

# {name} {city} {lname}: the values of the fill; one template a line in --templates.
TEMPLATES = (
    "Write a JSON object for a customer named {name} who lives in {city}, with the keys name, city, country, "
    "loyalty_level and notes. Reply with the JSON only.",
    "Write a short status report for the {city} warehouse run by {name}, with the sections Summary, Stock, Issues "
    "and Next steps.",
    "Write a Python function get_{lname}_orders(db) that returns all orders of the customer {name} from the orders "
    "table, with a docstring.",
    "Draft a polite email from {name} to the {city} office asking to move the quarterly review to next week.",
)
FILLS = (("Alice", "Lisbon"), ("Bruno", "Oslo"), ("Chen", "Kyoto"), ("Dara", "Lima"), ("Emil", "Accra"),
         ("Fatima", "Quebec"), ("Goran", "Perth"), ("Hana", "Riga"), ("Ivo", "Cusco"), ("Jun", "Turin"))


def workload(templates: list[str], requests: int) -> list[str]:
    """`requests` prompts: the templates in turn, each pass with the next fill."""
    out = []
    for i in range(requests):
        name, city = FILLS[(i // len(templates)) % len(FILLS)]
        out.append(templates[i % len(templates)].format(name=name, city=city, lname=name.lower()))
    return out


def replay(args, prompts: list[str], orchestrator_flags: list[str]) -> list[dict]:
    with harness.running(harness.plan(args, orchestrator_flags=orchestrator_flags), log_dir=harness.log_dir(args)
                         ) as (services,), harness.orchestrator(services) as stub:

        def generate(text: str, k: int | None, max_new_tokens: int | None = None) -> harness.Stream:
            return harness.stream(stub, harness.request(
                text=text if args.raw else None, chat=None if args.raw else text,
                max_new_tokens=max_new_tokens or args.max_new_tokens, k=k))

        generate("Say hello.", 0)  # the first request's set-up out of the figures
        rows = []
        for i, text in enumerate(prompts):
            default = generate(text, 0 if args.control else None)
            # K = 0's prompt is cached (the defaults' request just ran it): a prompt of the
            # same words in reverse order first, so its steps too start right after a
            # prefill of about that size, as a new request's do (the first passes after a
            # prefill run slower: on 2 cores 10-12 ms, then about 7, against 5.3 in steady
            # decode, some 15 ms in all over the next ten).
            generate(" ".join(reversed(text.split())), 0, 1)
            plain = generate(text, 0)
            stats = default.stats
            speedup = default.rate_after_first() / plain.rate_after_first()
            rows.append({"request": i, "tokens": len(plain.tokens), "default_s": default.seconds,
                         "k0_s": plain.seconds, "speedup": speedup, "same": default.tokens == plain.tokens,
                         "rounds": stats.rounds, "drafted": stats.draft_tokens, "accepted": stats.accepted_tokens})
            print(f"{i}: {len(plain.tokens)} tokens, K = 0 {plain.seconds * 1e3:.0f} ms, defaults "
                  f"{default.seconds * 1e3:.0f} ms; after the first token {speedup:.2f}x; {stats.rounds} rounds, "
                  f"{stats.accepted_tokens}/{stats.draft_tokens} drafts accepted", flush=True)
        return rows


def summary(rows: list[dict]) -> dict:
    first = max(1, len(rows) // 10)

    def part(part_rows):
        return {"requests": len(part_rows), "median_speedup": statistics.median(r["speedup"] for r in part_rows),
                "worst_speedup": min(r["speedup"] for r in part_rows),
                "time_speedup": sum(r["k0_s"] for r in part_rows) / sum(r["default_s"] for r in part_rows)}

    return {"first_tenth": part(rows[:first]), "rest": part(rows[first:] or rows[:first]),
            "same": sum(r["same"] for r in rows), "checked": len(rows)}


def markdown(runs: dict[str, dict], meta: dict) -> str:
    lines = [f"target `{meta['target']}`, draft `{meta['draft']}`, {meta['requests']} requests from "
             f"{meta['templates']} templates, {meta['max_new_tokens']} new tokens, greedy; each "
             + ("at K = 0 (a control: the pair's order alone)" if meta["control"] else "with the defaults")
             + ", then at K = 0 on the same deployment", "",
             "| memory of outputs | requests | median speedup after the first token | worst | total time K = 0 / "
             "defaults (K = 0's prefill cached) | same output |",
             "|---|---|---|---|---|---|"]
    for name, run in runs.items():
        s = run["summary"]
        for label, part in (("first tenth", s["first_tenth"]), ("the rest", s["rest"])):
            lines.append(f"| {name}, {label} | {part['requests']} | {part['median_speedup']:.2f}x | "
                         f"{part['worst_speedup']:.2f}x | {part['time_speedup']:.2f}x | {s['same']}/{s['checked']} |")
    return "\n".join(lines) + "\n"


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = harness.model_flags(parser or harness.parser_for("repeat", __doc__), "repeat-out")
    parser.add_argument("--templates", type=Path,
                        help="one template a line, with {name}, {city}, {lname}; \\n in a line is a line break")
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--raw", action="store_true", help="send each prompt as plain text, not a chat message")
    parser.add_argument("--compare-memory-off", action="store_true",
                        help="replay again with the orchestrator's memory of outputs off")
    parser.add_argument("--control", action="store_true",
                        help="the first of each pair at K = 0 too: what the order alone does to the ratio")
    return parser


def main_with(args) -> int:
    templates = list(TEMPLATES) if args.templates is None else [
        line.replace("\\n", "\n") for line in args.templates.read_text().splitlines() if line.strip()]
    if not templates or args.requests < 1:
        raise SystemExit("--templates: none given, or --requests < 1")
    prompts = workload(templates, args.requests)
    runs = {"on": {"rows": replay(args, prompts, [])}}
    if args.compare_memory_off:
        runs["off"] = {"rows": replay(args, prompts, ["--lookup-memory-tokens", "0"])}
    for run in runs.values():
        run["summary"] = summary(run["rows"])
    meta = {"target": args.target, "draft": args.draft, "requests": args.requests, "templates": len(templates),
            "control": args.control,
            "max_new_tokens": args.max_new_tokens}
    harness.write_report(args.out, "repeat", {"meta": meta, "runs": runs}, markdown(runs, meta))
    return harness.failed_if(any(run["summary"]["same"] != run["summary"]["checked"] for run in runs.values()),
                             "some outputs differ between the defaults and K = 0")
