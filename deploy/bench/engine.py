"""The batching engine on its own: `specdec bench engine`.

1. What a batched pass of the target costs: R rows x n tokens against one row x one
   token, each row with a ~120-token cache (same process, median of 7 passes each); one
   row of 17 tokens is a lookup round at its largest K (16): what a copied answer can
   gain at most. Then what one row's drafts (1, then 4) add to a pass of 8 rows of one
   token: the price of lookup drafts under load. And one row's passes of 1, 3, 5 and 9
   tokens after 1,100, 600, 300 and 100 positions of history (median of 25 each): the
   attention they pay grows with it.
   On a GGUF target, passes of 1, 5 and 9 tokens and one row's drafts in 8 rows again on
   each path of its products the build has (AVX-512 VNNI, AVX2: the same bits), side by
   side.
2. Batch invariance: each of 8 rows run alone and together; how far their logits move
   and whether any argmax flips.
3. Prefix caching: a chat's second turn (the first turn's prompt and answer, then a new
   question) against the same prompt sent cold: the time to its first token.
4. With --llama-cpp DIR: llama.cpp's `llama-bench` on the same GGUF file and threads (a
   64-token generation), its time per token beside our 1-token pass counted as it counts
   its own (the mean of 3 x 64 passes in a row after a warm-up), measured just before and
   just after it.
5. With --stall: a 4000-token prompt arriving while 4 streams run through `specdec up`,
   with chunked prefill (256-token passes) and in one pass: how long the running
   streams stall.
6. Penalties: what a request's bias and penalties add to a pass of 1 and 5 tokens after
   300 and 4,000 tokens of history (all four at once; the frequency penalty alone),
   against the 1-token pass (median of 50 each).
Prints each line as it is measured; writes engine.json and engine.md to --out."""

import argparse
import asyncio
import statistics
import time
from pathlib import Path

import torch

from deploy.bench import harness
from specdec import model_files
from specdec.runtime import ggml, modeling, quantize
from specdec.runtime.engine import Engine, one_thread_outside_engines


def pass_seconds(eng: Engine, seqs, tokens: list[int], history: int, reps: int = 7) -> float:
    """The median seconds of a pass of len(tokens) rows, tokens[i] new tokens in row i
    after `history` positions (each row cut back to them after each pass)."""
    out = []
    for _ in range(reps):
        for seq, n in zip(seqs, tokens):
            seq.extend([100 + j for j in range(n)])
        with eng.cond:  # all rows ready together: one pass
            works = [eng.submit(seq, n) for seq, n in zip(seqs, tokens)]
        results = [w.future.result() for w in works]
        assert all(done.rows == len(tokens) for _, done in results)
        out.append(results[0][1].seconds)
        for seq in seqs[:len(tokens)]:
            seq.sync(history, [])
    return statistics.median(out)


def pass_costs(eng: Engine, seqs, shapes) -> list[str]:
    def timed(tokens: list[int]) -> float:  # after the rows' 120 positions
        return pass_seconds(eng, seqs, tokens, 120)

    base = timed([1])
    lines = [f"1 row x 1 token: {base * 1e3:.1f} ms"]
    for rows, n in shapes:
        t = timed([n] * rows)
        lines.append(f"{rows} rows x {n} tokens: {t * 1e3:.1f} ms = {t / base:.2f}x one token; "
                     f"tokens per unit time {rows * n * base / t:.2f}x")
    # What one session's drafts add to a full pass (a lookup match comes to a few rows at a time).
    full = timed([1] * len(seqs))
    for drafts in (1, 4):
        t = timed([1 + drafts] + [1] * (len(seqs) - 1))
        lines.append(f"{len(seqs)} rows x 1 token, one row with {drafts} draft(s) more: {t * 1e3:.1f} ms = "
                     f"{t / full:.2f}x the pass without them")
    return lines


def by_history(eng: Engine, lengths=(1100, 600, 300, 100), tokens=(1, 3, 5, 9), reps: int = 25) -> list[str]:
    """Passes of n tokens of one row after L positions of history, L going down (a
    session's passes pay attention over all of its history, once a query: the costs of
    pass_costs, after 120 positions, are those of a short one)."""
    seq = eng.new_sequence()
    seq.sync(0, [(7 * j) % 5000 + 100 for j in range(max(lengths) + 1)])
    eng.forward_now(seq, 1)
    lines = []
    for length in lengths:
        seq.sync(length, [])
        costs = {n: pass_seconds(eng, [seq], [n], length, reps) for n in tokens}
        lines.append(f"after {length} positions: " + ", ".join(
            f"{n} token{'s' if n > 1 else ''} {t * 1e3:.1f} ms" + (f" ({t / costs[1]:.2f}x)" if n > 1 else "")
            for n, t in costs.items()))
    seq.sync(0, [])
    return lines


def by_path(eng: Engine, seqs) -> list[str]:
    """Passes on each SIMD path of the GGUF products, widest (the default) first: the same
    bits; a narrower one is what a CPU without the widest runs."""
    kernels = ggml._kernels()
    lines = []
    for path in [p for p in kernels.isas() if p != "portable"][::-1]:
        default = kernels.set_isa(path)
        try:
            costs = pass_costs(eng, seqs, [(1, 5), (1, 9)])
        finally:
            kernels.set_isa(default)
        lines.append(f"GGUF products on {path}{' (the default)' if path == default else ''}: " + "; ".join(costs))
    return lines


def invariance(eng: Engine, seqs, trials: int = 5) -> str:
    differ = flips = 0
    worst = 0.0
    for trial in range(trials):
        drafts = [200 + trial, 300, 400]
        alone = []
        for seq in seqs:
            seq.extend(drafts)
            alone.append(eng.forward_now(seq, 4)[0])
            seq.sync(120, [])
        for seq in seqs:
            seq.extend(drafts)
        with eng.cond:
            works = [eng.submit(seq, 4) for seq in seqs]
        for a, work in zip(alone, works):
            b = work.future.result()[0]
            worst = max(worst, (a - b).abs().max().item())
            differ += int(not torch.equal(a, b))
            flips += int((a.argmax(-1) != b.argmax(-1)).sum())
        for seq in seqs:
            seq.sync(120, [])
    rows = trials * len(seqs)
    return (f"batch invariance: {differ} of {rows} rows differ at all between alone and {len(seqs)}-row passes; "
            f"max |logit difference| {worst:.2e}; argmax flips {flips} of {rows * 4} positions")


def penalty_costs(eng: Engine, seq) -> list[str]:
    from specdec import sampling
    from specdec.api.common.v1 import common_pb2

    def median_of(work, reps: int = 50) -> float:
        out = []
        for _ in range(reps):
            started = time.perf_counter()
            work()
            out.append(time.perf_counter() - started)
        return statistics.median(out)

    length = len(seq.tokens)

    def step():
        seq.extend([101])
        eng.forward_now(seq, 1)
        seq.sync(length, [])

    one = median_of(step, 21)
    logits = torch.randn(5, eng.model.config.vocab_size)
    lines = []
    for name, fields in (("all four", dict(logit_bias={314: 3.0, 2: -100.0}, repetition_penalty=1.1,
                                           frequency_penalty=0.5, presence_penalty=0.5)),
                         ("frequency alone", dict(frequency_penalty=0.5))):
        for history in (300, 4000):
            params = common_pb2.SamplingParams(temperature=0.0, top_p=1.0, output_start=history - 100, **fields)
            tokens = [(7 * j) % 20000 + 100 for j in range(history)]
            with_drafts = {n: tokens + tokens[-(n - 1):][:n - 1] for n in (1, 5)}  # the history, then n - 1 drafts
            costs = [median_of(lambda: sampling.penalize(logits[:n], params, with_drafts[n], len(tokens)))
                     for n in (1, 5)]
            lines.append(f"penalties ({name}), {history} tokens of history: {costs[0] * 1e3:.3f} ms on a 1-token "
                         f"pass, {costs[1] * 1e3:.3f} ms on a 5-token one; the 1-token pass {one * 1e3:.2f} ms "
                         f"({costs[0] / one:.1%}, {costs[1] / one:.1%})")
    return lines


def steady_step(eng: Engine, seq) -> float:
    """Our 1-token pass as llama-bench times its generation: one warm-up pass, then the
    mean of 3 x 64 passes in a row (seconds). The first passes after a pause or a long
    prefill run slower (on the 2-core Xeon VM, 9.6 ms falling to about 5 over some 20
    passes at 2 threads): a median of a few passes right after the prefill counted those."""
    length = len(seq.tokens)
    seq.extend([101])
    eng.forward_now(seq, 1)
    seq.sync(length, [])
    total = 0.0
    for _ in range(3):
        for i in range(64):
            seq.extend([100 + i])
            total += eng.forward_now(seq, 1)[1].seconds
        seq.sync(length, [])
    return total / (3 * 64)


def llama_cpp_step(bin_dir: str, gguf: str, threads: int) -> float:
    """llama-bench's time per generated token on the file, at these threads (seconds)."""
    import json
    import subprocess

    done = subprocess.run([f"{bin_dir}/llama-bench", "-m", gguf, "-t", str(threads), "-p", "0", "-n", "64",
                           "-r", "3", "-o", "json"], capture_output=True, text=True, timeout=600, check=True)
    return 1.0 / json.loads(done.stdout)[0]["avg_ts"]


def second_turn(eng: Engine, tokenizer) -> str:
    def chat(messages):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)

    def first_token(ids) -> float:
        seq = eng.new_sequence()
        seq.sync(0, ids)
        started = time.perf_counter()
        logits, _ = eng.forward_now(seq, 1)
        took = time.perf_counter() - started
        eng.release(seq)
        return took

    system = {"role": "system", "content": "You are a careful assistant. " + "Answer in plain words, cite what "
              "you rely on, and say when you do not know. " * 20}
    turn1 = [system, {"role": "user", "content": "Tell me about the history of the printing press."}]
    seq = eng.new_sequence()
    seq.sync(0, chat(turn1))
    answer = []
    for _ in range(32):  # the first turn's answer, greedy
        answer.append(int(eng.forward_now(seq, 1)[0][-1].argmax()))
        seq.extend(answer[-1:])
    eng.release(seq)
    turn2 = chat(turn1 + [{"role": "assistant", "content": tokenizer.decode(answer, skip_special_tokens=True)},
                          {"role": "user", "content": "And what changed after Gutenberg?"}])
    warm = first_token(turn2)  # once: a repeat would find this very prompt's blocks
    eng.blocks.prefix_caching = False
    cold = statistics.median(first_token(turn2) for _ in range(3))
    eng.blocks.prefix_caching = True
    return (f"prefix caching: a chat's second turn ({len(turn2)} tokens) to its first token in {warm * 1e3:.0f} ms, "
            f"the same prompt cold {cold * 1e3:.0f} ms ({warm / cold:.2f}x)")


async def _stall(address: str, tokenizer) -> tuple[float, float, float]:
    import grpc
    from specdec.api.orchestrator.v1 import orchestrator_pb2_grpc

    chat = harness.chat_ids(tokenizer, "Tell me about the sea.")
    long = (tokenizer("The history of the world is long and full of events. ")["input_ids"] * 400)[:4000]
    async with grpc.aio.insecure_channel(address) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorServiceStub(channel)

        async def call(ids, n) -> harness.Stream:
            out = harness.Stream()
            await harness.stream_async(stub, harness.request(ids, max_new_tokens=n, k=0), out, t0, timeout=900)
            return out

        t0 = time.perf_counter()
        await call(chat, 4)
        running = [asyncio.ensure_future(call(chat, 120)) for _ in range(4)]
        await asyncio.sleep(3)
        started = time.perf_counter() - t0
        await call(long, 1)
        answered = time.perf_counter() - t0
        streams = await asyncio.gather(*running)
    gaps = [(b, b - a) for s in streams for a, b in zip(s.arrivals, s.arrivals[1:]) if b > a]
    during = [g for t, g in gaps if started <= t <= answered + 1]
    before = sorted(g for t, g in gaps if t < started)
    return answered - started, max(during, default=float("nan")), before[len(before) // 2]


def stall(args) -> list[str]:
    tokenizer = model_files.load_tokenizer(args.target)
    lines = []
    for label, tokens in (("chunked prefill (--max-batch-tokens 256)", "256"), ("one pass (--max-batch-tokens 8192)",
                                                                                  "8192")):
        with harness.running(harness.plan(args, verifier_flags=["--max-batch-tokens", tokens])) as (services,):
            prefill, worst, median = asyncio.run(_stall(services[-1].address, tokenizer))
        lines.append(f"{label}: the 4000-token prompt answered in {prefill:.1f} s; the running streams' longest gap "
                     f"meanwhile {worst:.2f} s (median gap before it arrived: {median * 1e3:.0f} ms)")
    return lines


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or harness.parser_for("engine", __doc__)
    parser.add_argument("--target", default=modeling.DEFAULT_TARGET)
    parser.add_argument("--draft", default=modeling.DEFAULT_DRAFT, help="for --stall")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=sorted(modeling.DTYPES))
    parser.add_argument("--quantize", default="auto", choices=quantize.METHODS)
    parser.add_argument("--threads", type=int, default=0, help="the pass's threads (0: one per core)")
    parser.add_argument("--llama-cpp", metavar="DIR", help="llama.cpp's bin directory: its llama-bench beside ours")
    parser.add_argument("--stall", action="store_true", help="also measure a long prefill beside running streams")
    parser.add_argument("--out", type=Path, default=Path("engine-out"))
    return parser


def main_with(args) -> int:
    lines = []

    def say(line: str) -> None:
        lines.append(line)
        print(line, flush=True)

    torch.set_grad_enabled(False)
    one_thread_outside_engines()  # as the services do
    model, _ = modeling.load_model(args.target, args.dtype, args.device)
    quantize.quantize(model, args.quantize)
    say(f"{args.target} on {args.device}, quantize {args.quantize}"
        + f" -> {quantize.method_of(model)}" + (f" ({quantize.kernel()})" if quantize.is_int8(model) else ""))
    eng = Engine(model, 1 << 30, max_batch_tokens=1024, threads=args.threads)
    seqs = []
    for i in range(8):
        seq = eng.new_sequence()
        seq.sync(0, [(7 * i + j) % 5000 + 100 for j in range(120)])
        eng.forward_now(seq, 1)
        seqs.append(seq)
    shapes = [(1, 3), (1, 5), (1, 9), (1, 17), (4, 1), (4, 3), (8, 1), (8, 3), (8, 5), (8, 9)]
    for line in pass_costs(eng, seqs, shapes):
        say(line)
    for line in by_history(eng):
        say(line)
    if quantize.method_of(model) == "gguf":
        for line in by_path(eng, seqs):
            say(line)
    say(invariance(eng, seqs))
    say(second_turn(eng, model_files.load_tokenizer(args.target)))
    for line in penalty_costs(eng, seqs[0]):
        say(line)
    if args.llama_cpp:
        if model_files.gguf_file(args.target) is None:
            raise SystemExit("--llama-cpp needs a GGUF target")
        before = steady_step(eng, seqs[0])
        theirs = llama_cpp_step(args.llama_cpp, model_files.gguf_file(args.target), eng.threads)
        after = steady_step(eng, seqs[0])
        threads = f"{eng.threads} thread" + ("s" if eng.threads > 1 else "")
        say(f"1-token pass, {threads}, mean of 3 x 64 in a row: ours {before * 1e3:.2f} ms before and "
            f"{after * 1e3:.2f} after llama.cpp's llama-bench on the same file, {theirs * 1e3:.2f} ms a token: "
            f"{(before + after) / 2 / theirs:.2f}x")
    eng.stop()
    if args.stall:
        for line in stall(args):
            say(line)
    harness.write_report(args.out, "engine", {"meta": {"target": args.target, "quantize": args.quantize,
                                                       "threads": eng.threads}, "lines": lines},
                         "".join(f"- {line}\n" for line in lines), echo=False)
    return 0
