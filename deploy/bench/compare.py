"""Side by side: `specdec bench compare`.

On one prompt set, in one run, interleaved per prompt:
  target       the target alone (transformers `generate`, greedy)
  assisted     transformers' assisted generation with the same draft (its defaults)
  inprocess    our speculative round (the orchestrator's loop, the drafter's proposer,
               the verifier's acceptance) in this process, no gRPC
  grpc         the full `specdec up` path with the model draft (`--proposer model`):
               three processes over gRPC, K fixed (-k)
  adaptive     the same services (the model draft alone), K chosen by the orchestrator
               each round
  overlap      `specdec up --overlap`: K fixed, each round drafted while the last one
               is verified
  ngram        `specdec up --draft ngram`: the prompt-lookup drafter
  hybrid       `specdec up` as it starts by default (`--proposer hybrid`): prompt lookup
               when the context holds a long match, the model draft otherwise; K chosen
               each round, lookup rounds priced apart

Prompts come in categories (open chat, code, repetitive tasks whose answer copies the
prompt, plain-text continuation); speedups are reported overall and per category.
`--quantize none,int8` runs every variant under both numerics in the same run, each
against the target alone with its own numerics and the int8 ones against the fp32
target too.

Per variant: tokens/s (median and spread over prompts x repeats), time to first token,
inter-token latency percentiles (gaps between streamed chunks), acceptance overall and
per draft position, mean accepted length, network time per round (gRPC round time minus
the in-process round time), and the Leviathan bound E / (K c + v) from the measured
acceptance, the draft cost c and the verify cost v (a K+1-token target pass over one
target step), with the fraction of it reached. Every variant's tokens are checked
against the target alone. Writes compare.json, compare.md and compare.png to --out."""

import argparse
import asyncio
import contextlib
import logging
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from deploy import launch
from deploy.bench import harness
from orchestrator.links import Step, Verdict
from specdec.runtime import modeling, quantize
from specdec.api.common.v1 import common_pb2
from specdec.runtime.engine import Engine
from specdec.api.verifier.v1 import verifier_pb2

log = logging.getLogger("bench.compare")

IN_PROCESS_KV_BYTES = 256 << 20
VARIANTS = ("target", "assisted", "inprocess", "grpc", "adaptive", "overlap", "ngram", "hybrid")
PER_ROUND = ("adaptive", "hybrid")  # the variants whose K the orchestrator chooses
ROUND_VARIANTS = ("inprocess", "grpc", "overlap")  # the model draft at the fixed K: step costs explain them


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
    numerics: str = "none"  # --quantize of every model of the run
    category: str = ""

    @property
    def label(self) -> str:
        return self.variant if self.numerics == "none" else f"{self.variant}-{self.numerics}"

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
        count = len(value.tolist())  # waits for the device: the token exists now
        self.arrivals += [time.perf_counter() - self.started] * count

    def end(self):
        pass


def run_hf(variant: str, index: int, target, ids: list[int], max_new_tokens: int, assistant=None) -> Run:
    clock = _Clock()
    device = target.device
    out = target.generate(torch.tensor([ids], device=device),
                          attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=device),
                          do_sample=False, max_new_tokens=max_new_tokens, streamer=clock,
                          assistant_model=assistant)
    wall = time.perf_counter() - clock.started
    return Run(variant, index, out[0, len(ids):].tolist(), wall, clock.arrivals)


class _LocalDrafter:
    """The drafter's proposer behind the interface of the orchestrator's DrafterLink."""
    lookup_rule = None  # a model proposer: it never drafts by lookup
    drafts_by_model = True

    def __init__(self, proposer, params):
        self.proposer, self.params, self.seq = proposer, params, proposer.new_sequence()

    def lookup_drafts(self, history, k):
        return []

    async def propose(self, history, k, committed=None):
        self.seq.sync(0, history)
        drafted = [draft async for draft in self.proposer.propose(self.seq, k, self.params)]
        return [t for t, _ in drafted], [q for _, q in drafted if q is not None]

    def close(self):
        self.proposer.release(self.seq)


class _LocalVerifier:
    """The verifier's round behind the interface of the orchestrator's VerifierLink."""
    features = None  # no feature drafter here

    def __init__(self, engine: Engine, params):
        from verifier_service.passes import verify
        from verifier_service.runs import decode

        self.verify_round, self.decode_run, self.params, self.engine = verify, decode, params, engine
        self.seq, self.synced = engine.new_sequence(), 0

    async def verify(self, history, drafts, qs):
        request = verifier_pb2.VerifyRequest(start=self.synced, new_tokens=history[self.synced:],
                                             draft_tokens=drafts, draft_probs=qs, sampling=self.params)
        self.synced = len(history)
        accepted, token, done, *_ = await self.verify_round(self.seq, request)
        return Verdict(accepted, token, done)

    async def decode(self, history, max_tokens, stop, draft_forced=False, draft_lookup=None, offers=None):
        assert offers is None, "a fixed K offers no drafts to runs"
        request = verifier_pb2.DecodeRequest(start=self.synced, new_tokens=history[self.synced:],
                                             sampling=self.params, max_tokens=max_tokens, stop_token_ids=sorted(stop),
                                             draft_forced=draft_forced, draft_lookup=draft_lookup)
        self.synced = len(history)
        async for p in self.decode_run(self.seq, request, modeling.max_positions(self.engine.model)):
            yield Step(p.token, p.batch_pass)  # no lookup drafts: its drafter has no lookup rule

    def close(self):
        self.engine.release(self.seq)


def run_inprocess(index: int, target: Engine, proposer, ids: list[int], max_new_tokens: int, k: int, eos) -> Run:
    from orchestrator.rounds import speculate
    from orchestrator.stats import Stats

    params = common_pb2.SamplingParams(top_p=1.0)
    stats, tokens, arrivals = Stats(), [], []

    async def go():
        drafter, verifier = _LocalDrafter(proposer, params), _LocalVerifier(target, params)
        started = time.perf_counter()
        async for commit in speculate(ids, max_new_tokens, k, set(eos), drafter, verifier, stats):
            tokens.extend(commit.tokens)
            arrivals.extend([time.perf_counter() - started] * len(commit.tokens))
        wall = time.perf_counter() - started
        drafter.close()
        verifier.close()
        return wall

    wall = asyncio.run(go())
    return Run("inprocess", index, tokens, wall, arrivals, stats.rounds, stats.draft_tokens,
               stats.accepted_tokens, list(stats.accepted_per_position), draft_s=stats.draft_s,
               verify_s=stats.verify_s)


def run_grpc(variant: str, index: int, stub, ids: list[int], max_new_tokens: int, k: int | None) -> Run:
    call = harness.stream(stub, harness.request(ids, max_new_tokens=max_new_tokens, k=k))
    stats = call.stats
    return Run(variant, index, call.tokens, call.seconds, call.arrivals, stats.rounds, stats.draft_tokens,
               stats.accepted_tokens, list(stats.accepted_per_position), stats.lookaheads, stats.lookahead_hits,
               stats.draft_seconds, stats.verify_seconds)


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


def summarize(runs: list[Run], k: int, costs: dict[str, dict]) -> dict:
    """Per label (a variant under some numerics): rates, latencies, acceptance, and the
    speedup over the target alone with the same numerics, overall and per category.
    costs: the step costs of each numerics."""
    reference = {(r.numerics, r.prompt): r.tokens for r in runs if r.variant == "target"}
    by_variant = {}
    for label in dict.fromkeys(r.label for r in runs):
        mine = [r for r in runs if r.label == label]
        rates = [r.tokens_per_s for r in mine]
        gaps = [b - a for r in mine for a, b in zip(r.arrivals, r.arrivals[1:]) if b > a]
        row = {
            "variant": mine[0].variant, "numerics": mine[0].numerics,
            "runs": len(mine),
            "tokens": sum(len(r.tokens) for r in mine),
            "tokens_per_s_median": statistics.median(rates),
            "tokens_per_s_min": min(rates), "tokens_per_s_max": max(rates),
            "ttft_s_median": statistics.median(r.arrivals[0] for r in mine if r.arrivals),
            "itl_s_p50": harness.percentile(gaps, 50), "itl_s_p90": harness.percentile(gaps, 90),
            "itl_s_p99": harness.percentile(gaps, 99),
            "same_tokens_as_target": all(r.tokens == reference[r.numerics, r.prompt] for r in mine),
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

        # Speedups per prompt and repeat against the target run next to it, then medians.
        def speedups(numerics: str, category: str | None = None) -> list[float]:
            return [r.tokens_per_s / t.tokens_per_s for r in mine if category in (None, r.category)
                    for t in runs if t.variant == "target" and t.numerics == numerics and t.prompt == r.prompt]

        row["speedup_median"] = statistics.median(speedups(row["numerics"]))
        row["speedup_by_category"] = {c: statistics.median(speedups(row["numerics"], c))
                                      for c in dict.fromkeys(r.category for r in mine)}
        if row["numerics"] != "none" and ("none", mine[0].prompt) in reference:
            row["speedup_vs_fp32_target"] = statistics.median(speedups("none"))
        by_variant[label] = row
    for label, row in by_variant.items():
        cost = costs[row["numerics"]]
        if row["variant"] in ROUND_VARIANTS and "rounds" in row:
            c, v = cost["draft_step"] / cost["target_step"], cost["verify"] / cost["target_step"]
            alpha = alpha_from_accepted(row["mean_accepted_length"], k)
            row.update({"alpha": alpha, "bound": bound(alpha, k, c, v)})
            row["fraction_of_bound"] = row["speedup_median"] / row["bound"]
        inprocess = by_variant.get(label.replace("grpc", "inprocess", 1))
        if row["variant"] == "grpc" and "round_s" in row and inprocess and "round_s" in inprocess:
            row["network_s_per_round"] = row["round_s"] - inprocess["round_s"]
    first = costs[next(iter(costs))]
    return {"k": k, "costs_s": first, "c": first["draft_step"] / first["target_step"],
            "verify_cost": first["verify"] / first["target_step"],
            "numerics": {q: {"costs_s": c, "c": c["draft_step"] / c["target_step"],
                             "verify_cost": c["verify"] / c["target_step"]} for q, c in costs.items()},
            "variants": by_variant}


def markdown(summary: dict, meta: dict) -> str:
    lines = [f"target `{meta['target']}`, draft `{meta['draft']}`, K={summary['k']}, "
             f"{meta['prompts']} prompts x {meta['repeats']} repeats x {meta['max_new_tokens']} new tokens, "
             f"device {meta['device']}, dtype {meta['dtype']}", ""]
    for numerics, n in summary["numerics"].items():
        costs = n["costs_s"]
        lines.append(f"- quantize {numerics}: c = {n['c']:.3f} (draft step {costs['draft_step'] * 1e3:.1f} ms, "
                     f"target step {costs['target_step'] * 1e3:.1f} ms); verify of K+1 tokens = "
                     f"{n['verify_cost']:.2f}x a target step ({costs['verify'] * 1e3:.1f} ms)")
    lines += ["", "Speedup: over the target alone with the same numerics (`-int8`: every model int8), the median "
                  "over prompts of each run against the target's run of the same prompt.", "",
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
    categories = list(dict.fromkeys(c for row in summary["variants"].values() for c in row["speedup_by_category"]))
    fp32 = any("speedup_vs_fp32_target" in row for row in summary["variants"].values())
    lines += ["", "Speedup by prompt category (median):", "",
              "| variant | " + " | ".join(categories) + " | all |" + (" all, over the fp32 target |" if fp32 else ""),
              "|---|" + "---|" * (len(categories) + 1 + fp32)]
    for name, row in summary["variants"].items():
        cells = [f"{row['speedup_by_category'][c]:.2f}x" if c in row["speedup_by_category"] else "-"
                 for c in categories]
        extra = [f"{row['speedup_vs_fp32_target']:.2f}x" if "speedup_vs_fp32_target" in row else "-"] if fp32 else []
        lines.append(f"| {name} | " + " | ".join([*cells, f"{row['speedup_median']:.2f}x", *extra]) + " |")
    lines += ["", "Where a round's time goes, ms per round (model: the same steps timed alone; the rest of a call is "
                  "the service, the network and waiting for the cores):", "",
              "| variant | round | drafter calls | of which K draft steps | verifier calls | of which the verify pass "
              "| orchestrator and client |", "|---|---|---|---|---|---|---|"]
    for name, row in summary["variants"].items():
        if row["variant"] not in ROUND_VARIANTS or "drafter_s_per_round" not in row:
            continue
        costs = summary["numerics"][row["numerics"]]["costs_s"]
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
    parser = harness.model_flags(parser or harness.parser_for("compare", __doc__), "compare-out", quantize=False,
                                 verbose=False)
    parser.add_argument("--prompts", type=Path, default=harness.PROMPTS,
                        help="a text file, one prompt per line, in categories (see the default file)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("-k", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"some of {','.join(VARIANTS)}")
    parser.add_argument("--quantize", default="none",
                        help="numerics of every model, the target alone included: none or int8, or both "
                             "(none,int8): each runs every variant, side by side")
    return parser


class Setup:
    """Everything the variants of one numerics run on: the models in this process and
    the deployments of the gRPC variants."""

    def __init__(self, args, numerics: str, variants: list[str]):
        from drafter_service.proposers import ModelProposer

        self.numerics = numerics

        def load(spec: str, head_cut: bool = False):
            model, tokenizer = modeling.load_model(spec, args.dtype, args.device)
            output_ids = modeling.restrict_output(model, spec) if head_cut else None
            return quantize.quantize(model, numerics), tokenizer, output_ids

        self.target, self.tokenizer, _ = load(args.target)
        # Two copies of the draft: transformers' assisted generation needs the full output
        # head; our drafter cuts it to the draft vocabulary, as the drafter service does.
        self.draft = load(args.draft)[0]
        proposer_model, _, output_ids = load(args.draft, head_cut=True)
        # The in-process engines take the threads `specdec up` gives the services: with a
        # thread per core they would also slow `generate` on this process's main thread
        # (two thread pools of one process on the same cores).
        self.proposer = ModelProposer(Engine(proposer_model, IN_PROCESS_KV_BYTES, threads=launch.DRAFTER_THREADS),
                                      self.tokenizer, args.draft, output_ids=output_ids)
        # The in-process round runs the target through the engine the verifier uses, which
        # makes the model its own: `generate` gets another copy.
        self.target_engine = Engine(load(args.target)[0], IN_PROCESS_KV_BYTES, threads=launch.VERIFIER_THREADS)
        self.eos = modeling.eos_token_ids(self.target, self.tokenizer)

        def plan(draft=args.draft, overlap=False, proposer="model"):
            return harness.plan(args, draft=draft, overlap=overlap, quantize=numerics,
                                drafter_flags=[] if draft == "ngram" else ["--proposer", proposer])

        self.deployments = {}
        if "grpc" in variants or "adaptive" in variants:
            self.deployments["grpc"] = plan()
        if "overlap" in variants:
            self.deployments["overlap"] = plan(overlap=True)
        if "ngram" in variants:
            self.deployments["ngram"] = plan(draft="ngram")
        if "hybrid" in variants:
            self.deployments["hybrid"] = plan(proposer="hybrid")
        self.stubs = {}

    def connect(self, stack: contextlib.ExitStack) -> None:
        for name, services in self.deployments.items():
            self.stubs[name] = stack.enter_context(harness.orchestrator(services))
        if "grpc" in self.stubs:
            self.stubs["adaptive"] = self.stubs["grpc"]

    def one(self, variant: str, index: int, ids: list[int], args) -> Run:
        if variant == "target":
            return run_hf(variant, index, self.target, ids, args.max_new_tokens)
        if variant == "assisted":
            return run_hf(variant, index, self.target, ids, args.max_new_tokens, assistant=self.draft)
        if variant == "inprocess":
            return run_inprocess(index, self.target_engine, self.proposer, ids, args.max_new_tokens, args.k, self.eos)
        k = None if variant in PER_ROUND else args.k
        return run_grpc(variant, index, self.stubs[variant], ids, args.max_new_tokens, k)


def run(args) -> dict:
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        raise SystemExit(f"--variants: unknown {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    if "target" not in variants:
        variants.insert(0, "target")  # every variant is checked against it
    numerics = [q.strip() for q in args.quantize.split(",") if q.strip()]
    if not numerics or set(numerics) - {"none", "int8"}:
        raise SystemExit(f"--quantize: a list of {', '.join(quantize.METHODS)}, got {args.quantize!r}")
    prompts = harness.read_prompts(args.prompts)
    setups = [Setup(args, q, variants) for q in numerics]
    encoded = [prompt.encode(setups[0].tokenizer) for prompt in prompts]
    every = [services for setup in setups for services in setup.deployments.values()]
    with harness.running(*every), contextlib.ExitStack() as stubs:
        for setup in setups:
            setup.connect(stubs)
        with torch.inference_mode():
            warm = encoded[0][:16]  # first calls pay one-off costs: keep them out of the figures
            for setup in setups:
                run_hf("target", -1, setup.target, warm, 4)
                for name, stub in setup.stubs.items():
                    run_grpc(name, -1, stub, warm, 4, None if name in PER_ROUND else args.k)
            runs = []
            for repeat in range(args.repeats):
                for index, (prompt, ids) in enumerate(zip(prompts, encoded)):
                    for setup in setups:
                        for variant in variants:
                            run = setup.one(variant, index, ids, args)
                            run.numerics, run.category = setup.numerics, prompt.category
                            runs.append(run)
                            log.info("repeat %d prompt %d (%s) %-14s %5.1f tok/s (%d tokens)", repeat, index,
                                     prompt.category, run.label, run.tokens_per_s, len(run.tokens))
            costs = {setup.numerics: step_costs(setup.target_engine, setup.proposer.engine, encoded[0], args.k)
                     for setup in setups}
    summary = summarize(runs, args.k, costs)
    meta = {"target": args.target, "draft": args.draft, "prompts": len(prompts), "repeats": args.repeats,
            "max_new_tokens": args.max_new_tokens, "device": args.device, "dtype": args.dtype, "quantize": numerics,
            "categories": sorted({p.category for p in prompts})}
    report = {"meta": meta, "summary": summary, "runs": [asdict(r) for r in runs]}
    harness.write_report(args.out, "compare", report, markdown(summary, meta))
    chart(summary, args.out / "compare.png")
    return report


def main_with(args) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    report = run(args)
    differ = [name for name, row in report["summary"]["variants"].items() if not row["same_tokens_as_target"]]
    theirs = [name for name in differ if report["summary"]["variants"][name]["variant"] == "assisted"]
    if theirs:  # transformers' own algorithm: reported, not ours to fail on
        print(f"transformers' assisted generation produced different tokens from the target alone: {theirs}",
              file=sys.stderr)
    if set(differ) - set(theirs):
        print(f"some variant produced different tokens from the target alone: {sorted(set(differ) - set(theirs))}",
              file=sys.stderr)
        return 1
    return 0
