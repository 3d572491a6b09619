"""Load: `specdec bench load`, many concurrent streams against one deployment.

At each concurrency (default 1, 4, 8, 16, 64 streams), in one run, one variant after
the other, greedy. A cell is a closed loop held for --duration seconds: each stream
sends a request, and the next one (the next prompt of the set) as soon as it ends; at
the end of the window the requests still running are cancelled. Variants:
  target      the target alone through the same services (K = 0), batched
  fixed       speculation with the K of -k, batched
  adaptive    K chosen per round by the orchestrator from the batched costs (the default)
  unbatched   the default (K chosen per round) with batching off (--max-batch-rows 1
              on the verifier and the drafters: one session per forward pass)
  overlap     the default with --overlap (each round's successor drafted while the
              round is verified)
  llama.cpp   with --llama-cpp DIR: llama.cpp's `llama-server` on the same GGUF file, as
              many slots as the highest concurrency, every core, through its streaming
              /completion endpoint with the same token ids (its own numerics: its
              outputs are reported, not required to equal ours)
Every cell sends the same prompts: a later cell finds the answers in the deployment's
memory of outputs (it drafts them) and the prompts in the verifier's prefix cache, a
workload of repeated requests. With --unseen (and a prompt file larger than the run
sends, such as deploy/bench/unseen_prompts.txt: 800 chat questions) each cell starts after the
last prompt any earlier cell sent, so no request finds its prompt or answer there; the
report counts the requests that still repeated a prompt because the set ran out. (Sent the
same prompts, a later cell ran faster: two cells at K = 0 on one deployment, 8 to 64
streams, gave the first 87-91% of the second, with a time to first token up to 2.4x
longer; the verifier's prefix cache is what they shared.)
Per cell: aggregate committed tokens/s (every token streamed inside the window, over
the window), time to first token and inter-token latency (p50, p99), acceptance, mean
rows per verifier pass, failed requests by status code (a request the window cut is
not a failure), and how many outputs (or, for a cut request, its prefix) equal the
target's own greedy output (transformers `generate`, in this process). With
--frequency-penalty / --presence-penalty every request carries them, and the reference
applies them by their definitions. Writes
load.json, load.md and load.png (throughput and p99 inter-token latency against
concurrency) to --out."""

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from deploy.bench import harness
from deploy.bench.harness import percentile
from specdec import model_files
from specdec.runtime import modeling
from specdec.api.orchestrator.v1 import orchestrator_pb2_grpc

log = logging.getLogger("bench.load")

VARIANTS = ("target", "fixed", "adaptive", "unbatched", "overlap")


@dataclass
class Request(harness.Stream):
    """One request of a cell: the stream (times after the cell started) and its place."""
    prompt: int = 0
    sent: int = 0  # its place in the run's sequence of prompts (past the set's end: a repeat)
    error: str = ""
    complete: bool = False  # llama.cpp's: its stop event came (ours: a result came)

    @property
    def ended(self) -> float:
        return self.started + self.seconds


async def one_request(stub, req: Request, ids: list[int], max_new_tokens: int, k: int | None, t0: float,
                      penalties: dict) -> None:
    try:
        await harness.stream_async(stub, harness.request(ids, max_new_tokens=max_new_tokens, k=k, **penalties),
                                   req, t0)
        req.complete = req.result is not None
    except grpc.aio.AioRpcError as err:
        req.error = err.code().name


async def llama_request(session, url: str, req: Request, ids: list[int], max_new_tokens: int, t0: float) -> None:
    body = {"prompt": ids, "n_predict": max_new_tokens, "stream": True, "temperature": 0, "top_k": 1,
            "return_tokens": True}
    req.started = time.perf_counter() - t0
    try:
        async with session.post(f"{url}/completion", json=body) as response:
            if response.status != 200:
                req.error = f"HTTP_{response.status}"
            else:
                pending = b""
                async for data in response.content.iter_any():  # its last event is longer than a line limit
                    now = time.perf_counter() - t0
                    *lines, pending = (pending + data).split(b"\n")
                    for line in lines:
                        if line.startswith(b"data: "):
                            event = json.loads(line[6:])
                            req.tokens += event.get("tokens", [])
                            req.arrivals += [now] * len(event.get("tokens", []))
                            req.complete = req.complete or bool(event.get("stop"))
    except Exception as err:  # a broken stream is a failed request, never the benchmark's end
        req.error = type(err).__name__
    req.seconds = time.perf_counter() - t0 - req.started


async def cell(address: str, prompts: list[list[int]], streams: int, max_new_tokens: int, k: int | None,
               duration_s: float, start: int = 0, penalties: dict | None = None) -> list[Request]:
    """`streams` closed loops for `duration_s`, sending the prompts from `start` on; the
    requests still running then are cancelled."""
    async with contextlib.AsyncExitStack() as stack:
        if address.startswith("http://"):  # llama-server
            import aiohttp

            # A connection per request: llama-server closes a stream's connection at its end.
            session = await stack.enter_async_context(
                aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)))

            def send(req, ids, t0):
                return llama_request(session, address, req, ids, max_new_tokens, t0)
        else:
            stub = orchestrator_pb2_grpc.OrchestratorServiceStub(
                await stack.enter_async_context(grpc.aio.insecure_channel(address)))

            def send(req, ids, t0):
                return one_request(stub, req, ids, max_new_tokens, k, t0, penalties or {})
        requests: list[Request] = []
        t0 = time.perf_counter()

        async def loop(stream: int):
            for n in itertools.count():
                sent = start + stream + n * streams
                req = Request(prompt=sent % len(prompts), sent=sent)
                requests.append(req)
                await send(req, prompts[req.prompt], t0)
                if req.error:
                    return

        loops = [asyncio.ensure_future(loop(i)) for i in range(streams)]
        await asyncio.sleep(duration_s)
        for task in loops:
            task.cancel()
        await asyncio.gather(*loops, return_exceptions=True)
        for req in requests:
            if not req.complete and not req.error:
                req.error = "CUT"  # still running when the window closed
        return requests


def summarize(requests: list[Request], window_s: float, reference: dict[int, list[int]],
              alone: dict[int, list[int]]) -> dict:
    done = [r for r in requests if r.complete]
    seen = [r for r in requests if r.complete or r.error == "CUT"]  # cut ones count up to the cut
    gaps = [b - a for r in seen for a, b in zip(r.arrivals, r.arrivals[1:]) if b > a]
    drafted = sum(r.stats.draft_tokens for r in done)
    rounds = sum(r.stats.rounds for r in done)
    errors: dict[str, int] = {}
    for r in requests:
        if r.error and r.error != "CUT":
            errors[r.error] = errors.get(r.error, 0) + 1
    return {
        "requests": len(done), "cut": sum(r.error == "CUT" for r in requests), "failed": sum(errors.values()),
        "errors": errors, "window_s": window_s,
        "tokens": sum(sum(t <= window_s for t in r.arrivals) for r in seen),
        "tokens_per_s": sum(sum(t <= window_s for t in r.arrivals) for r in seen) / window_s,
        "ttft_s_p50": percentile([r.arrivals[0] - r.started for r in seen if r.arrivals], 50),
        "ttft_s_p99": percentile([r.arrivals[0] - r.started for r in seen if r.arrivals], 99),
        "itl_s_p50": percentile(gaps, 50), "itl_s_p99": percentile(gaps, 99),
        "latency_s_p99": percentile([r.ended - r.started for r in done], 99),
        "acceptance": sum(r.stats.accepted_tokens for r in done) / drafted if drafted else None,
        "draft_tokens_per_round": drafted / rounds if rounds else 0.0,
        "mean_batch_rows": sum(r.stats.mean_batch_rows * r.stats.rounds for r in done) / rounds if rounds else 0.0,
        # A round's parts as the orchestrator waited on them, each call included.
        "draft_ms_per_round": sum(r.stats.draft_seconds for r in done) * 1e3 / rounds if rounds else 0.0,
        "verify_ms_per_round": sum(r.stats.verify_seconds for r in done) * 1e3 / rounds if rounds else 0.0,
        "checked": sum(r.prompt in reference for r in seen),
        "same_as_target": sum(r.tokens == reference[r.prompt][:len(r.tokens)] for r in seen if r.prompt in reference),
        "same_as_alone": sum(r.tokens == alone[r.prompt][:len(r.tokens)] for r in seen if r.prompt in alone),
        "checked_alone": sum(r.prompt in alone for r in seen),
        "prompts_sent": sorted({r.prompt for r in requests}),
    }


def markdown(cells: dict, meta: dict) -> str:
    lines = [f"target `{meta['target']}`, draft `{meta['draft']}`, {meta['num_drafters']} drafter(s), "
             f"K={meta['k']} for `fixed`, {meta['prompts']} prompts "
             + (f"sent in order, each cell after the last ({meta['repeated']} requests repeated a prompt), "
                if meta["unseen"] else "cycled over the streams, ") +
             f"{meta['max_new_tokens']} new tokens per request, greedy, device {meta['device']}", "",
             f"the target alone per stream at {meta['lowest']} stream(s): "
             f"{meta['single_target_tokens_per_s']:.1f} tok/s",
             "",
             "| streams | variant | tok/s | x target per stream | of batched target | TTFT p50/p99 ms | "
             "ITL p50/p99 ms | latency p99 s | acceptance | drafts/round | draft/verify ms a round | rows/pass | "
             "requests (cut) | failed | same as target | same as alone |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    single = meta["single_target_tokens_per_s"]
    for streams, by_variant in cells.items():
        target = by_variant.get("target")
        for variant, row in by_variant.items():
            of_target = f"{row['tokens_per_s'] / target['tokens_per_s']:.0%}" if target else "-"
            acceptance = "-" if row["acceptance"] is None else f"{row['acceptance']:.2f}"
            failed = str(row["failed"]) + (f" {row['errors']}" if row["errors"] else "")
            lines.append(
                f"| {streams} | {variant} | {row['tokens_per_s']:.1f} | {row['tokens_per_s'] / single:.2f}x | "
                f"{of_target} | {row['ttft_s_p50'] * 1e3:.0f}/{row['ttft_s_p99'] * 1e3:.0f} | "
                f"{row['itl_s_p50'] * 1e3:.0f}/{row['itl_s_p99'] * 1e3:.0f} | {row['latency_s_p99']:.1f} | "
                f"{acceptance} | {row['draft_tokens_per_round']:.2f} | "
                f"{row['draft_ms_per_round']:.2f}/{row['verify_ms_per_round']:.2f} | {row['mean_batch_rows']:.1f} | "
                f"{row['requests']} ({row['cut']}) | {failed} | {row['same_as_target']}/{row['checked']} | "
                f"{row['same_as_alone']}/{row['checked_alone']} |")
    lines += ["", "requests: completed in the window (cut: still running when it closed, cancelled; their tokens "
                  "count up to the cut). same as target: outputs (a cut one's prefix) equal to the target's own "
                  "greedy `generate`; same as alone: equal to the same variant's output for that prompt at the "
                  "lowest concurrency (a difference is a near-tie flipped by batching). draft/verify ms a round: "
                  "what a round waited on its drafter call and its verifier call, as the orchestrator saw them."]
    return "\n".join(lines) + "\n"


def chart(cells: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    levels = list(cells)
    for variant in dict.fromkeys(v for c in levels for v in cells[c]):
        xs = [c for c in levels if variant in cells[c]]
        if not xs:
            continue
        left.plot(xs, [cells[c][variant]["tokens_per_s"] for c in xs], marker="o", label=variant)
        right.plot(xs, [cells[c][variant]["itl_s_p99"] * 1e3 for c in xs], marker="o", label=variant)
    for ax, title, ylabel in ((left, "Aggregate throughput", "committed tokens/s"),
                              (right, "p99 inter-token latency", "ms")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def reference_outputs(target: str, dtype: str, device: str, numerics: str, prompts: list[list[int]],
                      which: list[int], max_new_tokens: int, penalties: dict | None = None,
                      constraints: list | None = None):
    """The target's own greedy output (transformers `generate`, with the run's penalties,
    under each prompt's constraint where `constraints` gives one: a common_pb2.Constraint
    a prompt) per prompt, for the prompts at `which`."""
    import torch
    from transformers import LogitsProcessorList

    from specdec import grammar
    from specdec.runtime.quantize import quantize

    model, tokenizer = modeling.load_model(target, dtype, device)
    model = quantize(model, numerics)
    vocab = grammar.vocabulary(tokenizer, model.config.vocab_size, modeling.eos_token_ids(model, tokenizer)) \
        if constraints else None
    out = {}
    with torch.inference_mode():
        for i in which:
            ids = prompts[i]
            processors = [harness.penalties_processor(len(ids), **penalties)] if penalties else []
            if constraints:
                processors.append(harness.constraint_processor(vocab.guide(constraints[i], len(ids))))
            generated = model.generate(torch.tensor([ids], device=device), do_sample=False,
                                       attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=device),
                                       max_new_tokens=max_new_tokens, logits_processor=LogitsProcessorList(processors))
            out[i] = generated[0, len(ids):].tolist()
    return out


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = harness.model_flags(parser or harness.parser_for("load", __doc__), "load-out")
    parser.add_argument("--num-drafters", type=int, default=1)
    parser.add_argument("--prompts", type=Path, default=harness.PROMPTS,
                        help="a text file, one prompt per line, in categories (see the default file)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--concurrency", default="1,4,8,16,64", help="stream counts, comma-separated")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds each cell's load is held")
    parser.add_argument("-k", type=int, default=2, help="K of the fixed variant")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"some of {','.join(VARIANTS)}")
    parser.add_argument("--llama-cpp", metavar="DIR", help="llama.cpp's bin directory: add the llama.cpp variant")
    parser.add_argument("--reference-limit", type=int, default=None,
                        help="check the outputs of N of the prompts sent, spread over the run, against the target's own "
                             "generate (default: every one; the reference costs the target's whole generation again)")
    parser.add_argument("--frequency-penalty", type=float, default=0.0, help="every request's (OpenAI's)")
    parser.add_argument("--presence-penalty", type=float, default=0.0, help="every request's (OpenAI's)")
    parser.add_argument("--unseen", action="store_true",
                        help="no request is sent a prompt sent before in the run (see above)")
    return parser


def run(args) -> dict:
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if set(variants) - set(VARIANTS):
        raise SystemExit(f"--variants: unknown {sorted(set(variants) - set(VARIANTS))}")
    if "target" not in variants:
        variants.insert(0, "target")  # the yardstick of every row
    if args.llama_cpp:
        variants.append("llama.cpp")
    levels = [int(c) for c in args.concurrency.split(",")]
    tokenizer = model_files.load_tokenizer(args.target)
    prompts = [prompt.encode(tokenizer) for prompt in harness.read_prompts(args.prompts)]
    deployments = {"batched": harness.plan(args, args.num_drafters)}  # and the variants of a deployment of their own:
    if "unbatched" in variants:
        off = ["--max-batch-rows", "1"]
        deployments["unbatched"] = harness.plan(args, args.num_drafters, verifier_flags=off, drafter_flags=off)
    if "overlap" in variants:
        deployments["overlap"] = harness.plan(args, args.num_drafters, overlap=True)
    ks = {"target": 0, "fixed": args.k, "adaptive": None, "unbatched": None, "overlap": None, "llama.cpp": None}
    penalties = {name: value for name, value in (("frequency_penalty", args.frequency_penalty),
                                                 ("presence_penalty", args.presence_penalty)) if value}
    if penalties and args.llama_cpp:
        raise SystemExit("--llama-cpp: its requests carry no penalties here; run it without them")
    sent: dict[int, dict[str, list[Request]]] = {}
    start = 0  # where a cell's prompts start (--unseen: after every earlier cell's)
    with harness.running(*deployments.values(), log_dir=harness.log_dir(args)), (
            harness.llama_server(args.llama_cpp, args.target, max(levels)) if args.llama_cpp
            else contextlib.nullcontext()) as llama_url:
        address = {v: deployments[v if v in deployments else "batched"][-1].address for v in variants}
        if llama_url is not None:
            address["llama.cpp"] = llama_url
        for v in variants:  # first calls pay one-off costs: keep them out of the figures
            # (with the last prompt, which an --unseen run reaches last, if at all)
            asyncio.run(cell(address[v], prompts[-1:], 1, 4, ks[v], 2.0))
        for streams in levels:
            sent[streams] = {}
            for v in variants:
                sent[streams][v] = requests = asyncio.run(
                    cell(address[v], prompts, streams, args.max_new_tokens, ks[v], args.duration, start, penalties))
                log.info("%3d streams %-9s %d requests", streams, v, len(requests))
                if args.unseen:
                    start = 1 + max(r.sent for r in requests)
    used = sorted({r.prompt for by_variant in sent.values() for requests in by_variant.values() for r in requests})
    reference = reference_outputs(args.target, args.dtype, args.device, args.quantize, prompts,
                                  harness.spread(used, args.reference_limit), args.max_new_tokens, penalties)
    alone = {v: {r.prompt: r.tokens for r in reversed(sent[levels[0]][v]) if r.complete} for v in variants}
    cells = {streams: {v: summarize(requests, args.duration, reference, alone[v]) for v, requests in by_variant.items()}
             for streams, by_variant in sent.items()}
    single = cells[levels[0]]["target"]["tokens_per_s"] / levels[0]  # per stream, at the lowest concurrency
    meta = {"target": args.target, "draft": args.draft, "num_drafters": args.num_drafters, "k": args.k,
            "prompts": len(prompts), "unseen": args.unseen, "penalties": penalties,
            "repeated": sum(r.sent >= len(prompts) for by_variant in sent.values() for requests in by_variant.values()
                            for r in requests),
            "max_new_tokens": args.max_new_tokens, "device": args.device,
            "dtype": args.dtype, "quantize": args.quantize, "single_target_tokens_per_s": single, "lowest": levels[0]}
    report = {"meta": meta, "cells": {str(c): v for c, v in cells.items()}}
    harness.write_report(args.out, "load", report, markdown(cells, meta))
    chart(cells, args.out / "load.png")
    return report


def main_with(args) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    report = run(args)
    rows = [row for by_variant in report["cells"].values() for v, row in by_variant.items() if v != "llama.cpp"]
    return (harness.failed_if(any(row["same_as_target"] != row["checked"] for row in rows),
                              "some outputs differ from the target alone")
            or harness.failed_if(sum(row["failed"] for row in rows) > 0, "some requests failed"))
