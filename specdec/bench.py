"""Side-by-side benchmark: `specdec bench` (or `python -m specdec.bench`).

On one prompt set, in one run, interleaved per prompt:
  target       the target alone (transformers `generate`, greedy)
  assisted     transformers' assisted generation with the same draft (its defaults)
  inprocess    our speculative round (the orchestrator's loop, the drafter's proposer,
               the verifier's acceptance) in this process, no gRPC
  grpc         the full `specdec up` path: three processes over gRPC, K fixed (-k)
  adaptive     the same services, K chosen by the orchestrator each round
  overlap      `specdec up --overlap`: K fixed, each round drafted while the last one
               is verified
  ngram        `specdec up` with the prompt-lookup drafter (--ngram)

Per variant: tokens/s (median and spread over prompts x repeats), time to first token,
inter-token latency percentiles (gaps between streamed chunks), acceptance overall and
per draft position, mean accepted length, network time per round (gRPC round time minus
the in-process round time), and the Leviathan bound E / (K c + v) from the measured
acceptance, the draft cost c and the verify cost v (a K+1-token target pass over one
target step), with the fraction of it reached. Every variant's tokens are checked
against the target alone. Writes bench.json, bench.md and bench.png to --out.

The benchmark is a harness over all three parts, so it imports their modules; the
services themselves still meet only through the protos."""

import argparse
import asyncio
import json
import logging
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
import torch

from specdec import launch, modeling
from specdec.common.v1 import common_pb2
from specdec.engine import Engine
from specdec.orchestrator.v1 import orchestrator_pb2 as pb, orchestrator_pb2_grpc
from specdec.verifier.v1 import verifier_pb2

log = logging.getLogger("bench")

DEFAULT_PROMPTS = Path(__file__).parent / "bench_prompts.txt"
IN_PROCESS_KV_BYTES = 256 << 20
VARIANTS = ("target", "assisted", "inprocess", "grpc", "adaptive", "overlap", "ngram")


@dataclass
class Run:
    """One generation: its tokens, when each arrived (s after the call), and rounds."""
    variant: str
    prompt: int
    tokens: list[int]
    wall_s: float
    arrivals: list[float]
    rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    lookaheads: int = 0
    lookahead_hits: int = 0
    draft_s: float = 0.0  # waiting on the drafter, summed over rounds
    verify_s: float = 0.0  # waiting on the verifier

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.wall_s


class _Clock:
    """A transformers streamer that only notes when tokens arrive."""

    def __init__(self):
        self.started, self.arrivals, self.prompt_seen = time.perf_counter(), [], False

    def put(self, value):
        if not self.prompt_seen:  # generate() first puts the prompt
            self.prompt_seen = True
            return
        now = time.perf_counter() - self.started
        self.arrivals += [now] * value.numel()

    def end(self):
        pass


def run_hf(variant: str, index: int, target, ids: list[int], max_new_tokens: int, assistant=None) -> Run:
    clock = _Clock()
    out = target.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          do_sample=False, max_new_tokens=max_new_tokens, streamer=clock,
                          assistant_model=assistant)
    wall = time.perf_counter() - clock.started
    return Run(variant, index, out[0, len(ids):].tolist(), wall, clock.arrivals)


class _LocalDrafter:
    """The drafter's proposer behind the interface of the orchestrator's DrafterLink."""

    def __init__(self, proposer, params):
        self.proposer, self.params, self.seq = proposer, params, proposer.new_sequence()

    async def propose(self, history, k, committed=None):
        self.seq.sync(0, history)
        drafted = [draft async for draft in self.proposer.propose(self.seq, k, self.params)]
        return [t for t, _ in drafted], [q for _, q in drafted if q is not None]

    def close(self):
        self.proposer.release(self.seq)


class _LocalVerifier:
    """The verifier's round behind the interface of the orchestrator's VerifierLink."""

    def __init__(self, engine: Engine, params):
        from verifier_service.acceptance import verify

        self.verify_round, self.params, self.engine = verify, params, engine
        self.seq, self.synced = engine.new_sequence(), 0

    async def verify(self, history, drafts, qs):
        request = verifier_pb2.VerifyRequest(start=self.synced, new_tokens=history[self.synced:],
                                             draft_tokens=drafts, draft_probs=qs, sampling=self.params)
        self.synced = len(history)
        accepted, token, done = await self.verify_round(self.seq, request)
        return accepted, token, done

    def close(self):
        self.engine.release(self.seq)


def run_inprocess(index: int, target: Engine, proposer, ids: list[int], max_new_tokens: int, k: int, eos) -> Run:
    from orchestrator.speculation import Stats, speculate

    params = common_pb2.SamplingParams(top_p=1.0)
    stats, tokens, arrivals = Stats(), [], []

    async def go():
        drafter, verifier = _LocalDrafter(proposer, params), _LocalVerifier(target, params)
        started = time.perf_counter()
        async for new in speculate(ids, max_new_tokens, k, set(eos), drafter, verifier, stats):
            tokens.extend(new)
            arrivals.extend([time.perf_counter() - started] * len(new))
        wall = time.perf_counter() - started
        drafter.close()
        verifier.close()
        return wall

    wall = asyncio.run(go())
    return Run("inprocess", index, tokens, wall, arrivals, stats.rounds, stats.draft_tokens,
               stats.accepted_tokens, list(stats.accepted_per_position), draft_s=stats.draft_s,
               verify_s=stats.verify_s)


def run_grpc(variant: str, index: int, stub, ids: list[int], max_new_tokens: int, k: int | None) -> Run:
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), max_new_tokens=max_new_tokens)
    if k is not None:  # None: the orchestrator chooses K per round
        request.num_speculative_tokens = k
    tokens, arrivals, result = [], [], None
    started = time.perf_counter()
    for message in stub.Generate(request, timeout=1200):
        if message.HasField("chunk"):
            tokens.extend(message.chunk.token_ids)
            arrivals.extend([time.perf_counter() - started] * len(message.chunk.token_ids))
        else:
            result = message.result
    wall = time.perf_counter() - started
    stats = result.stats
    return Run(variant, index, tokens, wall, arrivals, stats.rounds, stats.draft_tokens, stats.accepted_tokens,
               list(stats.accepted_per_position), stats.lookaheads, stats.lookahead_hits, stats.draft_seconds,
               stats.verify_seconds)


def step_costs(target: Engine, draft: Engine, ids: list[int], k: int, repeats: int = 15) -> dict:
    """Seconds for one cached step of each model and for a (k+1)-token target pass, at
    the end of the prompt, timed alternately so load drifts hit all three alike."""
    seqs = {"target": target.new_sequence(), "draft": draft.new_sequence()}
    for seq in seqs.values():
        seq.sync(0, ids)
        seq.engine.forward_now(seq, 1)
    times = {"target_step": [], "draft_step": [], "verify": []}
    for _ in range(repeats):
        for name, seq, extra in (("target_step", seqs["target"], 1), ("draft_step", seqs["draft"], 1),
                                 ("verify", seqs["target"], k + 1)):
            seq.extend(ids[:extra])
            _, done = seq.engine.forward_now(seq, extra)
            times[name].append(done.seconds)
            seq.sync(0, ids)  # roll back to the prompt
    for seq in seqs.values():
        seq.engine.release(seq)
    return {name: statistics.median(values) for name, values in times.items()}


def alpha_from_accepted(mean_accepted: float, k: int) -> float:
    """The per-token acceptance rate alpha for which a round of k drafts accepts
    `mean_accepted` on average: sum_{i=1..k} alpha^i (Leviathan's i.i.d. model)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(mid ** i for i in range(1, k + 1)) < mean_accepted:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def bound(alpha: float, k: int, c: float, v: float) -> float:
    """Leviathan's walltime factor with the measured verify cost: E / (K c + v)."""
    expected = k + 1 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return expected / (k * c + v)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def summarize(runs: list[Run], reference: dict[int, list[int]], k: int, costs: dict) -> dict:
    by_variant = {}
    for variant in VARIANTS:
        mine = [r for r in runs if r.variant == variant]
        if not mine:
            continue
        rates = [r.tokens_per_s for r in mine]
        gaps = [b - a for r in mine for a, b in zip(r.arrivals, r.arrivals[1:]) if b > a]
        row = {
            "runs": len(mine),
            "tokens": sum(len(r.tokens) for r in mine),
            "tokens_per_s_median": statistics.median(rates),
            "tokens_per_s_min": min(rates), "tokens_per_s_max": max(rates),
            "ttft_s_median": statistics.median(r.arrivals[0] for r in mine if r.arrivals),
            "itl_s_p50": percentile(gaps, 50), "itl_s_p90": percentile(gaps, 90), "itl_s_p99": percentile(gaps, 99),
            "same_tokens_as_target": all(r.tokens == reference[r.prompt] for r in mine),
        }
        rounds = sum(r.rounds for r in mine)
        if rounds:
            drafted = sum(r.draft_tokens for r in mine)
            accepted = sum(r.accepted_tokens for r in mine)
            per_position = [0] * max(len(r.accepted_per_position) for r in mine)
            for r in mine:
                for i, n in enumerate(r.accepted_per_position):
                    per_position[i] += n
            row.update({
                "rounds": rounds,
                "draft_tokens": drafted,
                "acceptance": accepted / drafted if drafted else 0.0,
                "acceptance_per_position": [n / rounds for n in per_position],
                "mean_accepted_length": accepted / rounds,
                "tokens_per_round": sum(len(r.tokens) for r in mine) / rounds,
                "round_s": sum(r.wall_s for r in mine) / rounds,
                "drafter_s_per_round": sum(r.draft_s for r in mine) / rounds,
                "verifier_s_per_round": sum(r.verify_s for r in mine) / rounds,
            })
        lookaheads = sum(r.lookaheads for r in mine)
        if lookaheads:
            row.update({"lookaheads": lookaheads, "lookahead_hits": sum(r.lookahead_hits for r in mine)})
        by_variant[variant] = row
    target_rate = by_variant["target"]["tokens_per_s_median"]
    for variant, row in by_variant.items():
        # Speedup per prompt and repeat against the target run next to it, then the median.
        pairs = [(r, t) for r in runs if r.variant == variant
                 for t in runs if t.variant == "target" and t.prompt == r.prompt]
        row["speedup_median"] = statistics.median(r.tokens_per_s / t.tokens_per_s for r, t in pairs) if pairs \
            else row["tokens_per_s_median"] / target_rate
    c = costs["draft_step"] / costs["target_step"]
    v = costs["verify"] / costs["target_step"]
    for variant in ("inprocess", "grpc", "overlap"):
        row = by_variant.get(variant)
        if row and "rounds" in row:
            alpha = alpha_from_accepted(row["mean_accepted_length"], k)
            row.update({"alpha": alpha, "bound": bound(alpha, k, c, v)})
            row["fraction_of_bound"] = row["speedup_median"] / row["bound"]
    if "grpc" in by_variant and "inprocess" in by_variant and "round_s" in by_variant["grpc"]:
        by_variant["grpc"]["network_s_per_round"] = by_variant["grpc"]["round_s"] - by_variant["inprocess"]["round_s"]
    return {"k": k, "costs_s": costs, "c": c, "verify_cost": v, "variants": by_variant}


def markdown(summary: dict, meta: dict) -> str:
    lines = [f"target `{meta['target']}`, draft `{meta['draft']}`, K={summary['k']}, "
             f"{meta['prompts']} prompts x {meta['repeats']} repeats x {meta['max_new_tokens']} new tokens, "
             f"device {meta['device']}",
             "",
             f"c = {summary['c']:.3f} (draft step {summary['costs_s']['draft_step'] * 1e3:.1f} ms, target step "
             f"{summary['costs_s']['target_step'] * 1e3:.1f} ms); verify of K+1 tokens = {summary['verify_cost']:.2f}x "
             f"a target step ({summary['costs_s']['verify'] * 1e3:.1f} ms)",
             "",
             "| variant | tok/s median (min-max) | speedup | TTFT ms | ITL p50/p90/p99 ms | acceptance | "
             "accepted/round | per position | network ms/round | bound | of bound | same tokens |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, row in summary["variants"].items():
        def opt(key, fmt):
            return fmt.format(row[key]) if key in row else "-"
        per_position = " ".join(f"{a:.2f}" for a in row.get("acceptance_per_position", [])) or "-"
        network = f"{row['network_s_per_round'] * 1e3:.1f}" if "network_s_per_round" in row else "-"
        lines.append(
            f"| {name} | {row['tokens_per_s_median']:.1f} ({row['tokens_per_s_min']:.1f}-{row['tokens_per_s_max']:.1f}) "
            f"| {row['speedup_median']:.2f}x | {row['ttft_s_median'] * 1e3:.0f} | {row['itl_s_p50'] * 1e3:.0f}/"
            f"{row['itl_s_p90'] * 1e3:.0f}/{row['itl_s_p99'] * 1e3:.0f} | {opt('acceptance', '{:.2f}')} | "
            f"{opt('mean_accepted_length', '{:.2f}')} | {per_position} | {network} | {opt('bound', '{:.2f}x')} | "
            f"{opt('fraction_of_bound', '{:.0%}')} | {row['same_tokens_as_target']} |")
    costs = summary["costs_s"]
    lines += ["", "Where a round's time goes, ms per round (model: the same steps timed alone; the rest of a call is "
                  "the service, the network and waiting for the cores):", "",
              "| variant | round | drafter calls | of which K draft steps | verifier calls | of which the verify pass "
              "| orchestrator and client |", "|---|---|---|---|---|---|---|"]
    for name, row in summary["variants"].items():
        if name not in ("inprocess", "grpc", "overlap") or "drafter_s_per_round" not in row:
            continue  # the model draft at the fixed K only: the step costs were timed for it
        drafter, verifier = row["drafter_s_per_round"], row["verifier_s_per_round"]
        steps = row["draft_tokens"] / row["rounds"] * costs["draft_step"]
        lines.append(f"| {name} | {row['round_s'] * 1e3:.1f} | {drafter * 1e3:.1f} | {steps * 1e3:.1f} | "
                     f"{verifier * 1e3:.1f} | {costs['verify'] * 1e3:.1f} | "
                     f"{(row['round_s'] - drafter - verifier) * 1e3:.1f} |")
    for name, row in summary["variants"].items():
        if "lookaheads" in row:
            lines += ["", f"{name}: {row['lookahead_hits']} of {row['lookaheads']} rounds drafted ahead were used "
                          f"({row['lookahead_hits'] / row['lookaheads']:.0%}); the others were drafted again"]
    return "\n".join(lines) + "\n"


def chart(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = summary["variants"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    names = list(variants)
    left.bar(names, [variants[n]["speedup_median"] for n in names], color="tab:blue")
    left.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    left.set_ylabel("speedup over the target alone (median)")
    left.set_title("Speedup per variant")
    left.tick_params(axis="x", labelrotation=30)
    for name in names:
        if "acceptance_per_position" in variants[name]:
            per = variants[name]["acceptance_per_position"]
            right.plot(range(1, len(per) + 1), per, marker="o", label=name)
    right.set_xlabel("draft position")
    right.xaxis.get_major_locator().set_params(integer=True)
    right.set_ylabel("fraction of rounds accepting it")
    right.set_ylim(0, 1)
    right.set_title("Acceptance per draft position")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="specdec bench", description=__doc__,
                                               formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=modeling.DEFAULT_TARGET)
    parser.add_argument("--draft", default=modeling.DEFAULT_DRAFT)
    parser.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS, help="a text file, one prompt per line")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("-k", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"some of {','.join(VARIANTS)}")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    parser.add_argument("--dtype", default="float32", choices=sorted(modeling.DTYPES))
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    return parser


def run(args) -> dict:
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        raise SystemExit(f"--variants: unknown {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    if "target" not in variants:
        variants.insert(0, "target")  # every variant is checked against it
    prompts = [line.strip() for line in args.prompts.read_text().splitlines() if line.strip()]
    target, tokenizer = modeling.load_model(args.target, args.dtype, device)
    from drafter_service.proposers import ModelProposer

    # Two copies of the draft: transformers' assisted generation needs the full output
    # head; our drafter cuts it to the draft vocabulary, as the drafter service does.
    draft, _ = modeling.load_model(args.draft, args.dtype, device)
    proposer_model, _ = modeling.load_model(args.draft, args.dtype, device)
    output_ids = modeling.restrict_output(proposer_model, args.draft)
    proposer = ModelProposer(Engine(proposer_model, IN_PROCESS_KV_BYTES), tokenizer, args.draft, output_ids=output_ids)
    # The in-process round runs the target through the engine the verifier uses, which
    # makes the model its own: `generate` gets another copy.
    target_engine = Engine(modeling.load_model(args.target, args.dtype, device)[0], IN_PROCESS_KV_BYTES)
    eos = modeling.eos_token_ids(target, tokenizer)
    encoded = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False) for p in prompts]
    deployments = {}
    if "grpc" in variants or "adaptive" in variants:
        deployments["grpc"] = launch.plan(args.target, args.draft, 1, launch.free_port(), args.dtype, device)
    if "overlap" in variants:
        deployments["overlap"] = launch.plan(args.target, args.draft, 1, launch.free_port(), args.dtype, device,
                                             overlap=True)
    if "ngram" in variants:
        deployments["ngram"] = launch.plan(args.target, "ngram", 1, launch.free_port(), args.dtype, device)
    for services in deployments.values():
        launch.start(services)
    try:
        for services in deployments.values():
            launch.wait_serving(services, 900)
        channels = {name: grpc.insecure_channel(services[-1].address) for name, services in deployments.items()}
        stubs = {name: orchestrator_pb2_grpc.OrchestratorServiceStub(ch) for name, ch in channels.items()}
        if "grpc" in stubs:
            stubs["adaptive"] = stubs["grpc"]
        with torch.inference_mode():
            warm = encoded[0][:16]  # first calls pay one-off costs: keep them out of the figures
            run_hf("target", -1, target, warm, 4)
            for name, stub in stubs.items():
                run_grpc(name, -1, stub, warm, 4, None if name == "adaptive" else args.k)
            runs = []
            for repeat in range(args.repeats):
                for index, ids in enumerate(encoded):
                    for variant in variants:
                        if variant == "target":
                            run = run_hf(variant, index, target, ids, args.max_new_tokens)
                        elif variant == "assisted":
                            run = run_hf(variant, index, target, ids, args.max_new_tokens, assistant=draft)
                        elif variant == "inprocess":
                            run = run_inprocess(index, target_engine, proposer, ids, args.max_new_tokens, args.k,
                                                eos)
                        else:
                            k = None if variant == "adaptive" else args.k
                            run = run_grpc(variant, index, stubs[variant], ids, args.max_new_tokens, k)
                        runs.append(run)
                        log.info("repeat %d prompt %d %-9s %5.1f tok/s (%d tokens)", repeat, index, variant,
                                 run.tokens_per_s, len(run.tokens))
            costs = step_costs(target_engine, proposer.engine, encoded[0], args.k)
        for channel in channels.values():
            channel.close()
    finally:
        for services in deployments.values():
            launch.stop(services)
    reference = {r.prompt: r.tokens for r in runs if r.variant == "target"}
    summary = summarize(runs, reference, args.k, costs)
    meta = {"target": args.target, "draft": args.draft, "prompts": len(prompts), "repeats": args.repeats,
            "max_new_tokens": args.max_new_tokens, "device": device, "dtype": args.dtype,
            "command": " ".join(sys.argv)}
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"meta": meta, "summary": summary, "runs": [asdict(r) for r in runs]}
    (args.out / "bench.json").write_text(json.dumps(report, indent=1) + "\n")
    (args.out / "bench.md").write_text(markdown(summary, meta))
    chart(summary, args.out / "bench.png")
    return report


def main_with(args) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    report = run(args)
    print((args.out / "bench.md").read_text())
    if not all(row["same_tokens_as_target"] for row in report["summary"]["variants"].values()):
        print("some variant produced different tokens from the target alone", file=sys.stderr)
        return 1
    return 0


def main(argv=None) -> None:
    raise SystemExit(main_with(build_parser().parse_args(argv)))


if __name__ == "__main__":
    main()
