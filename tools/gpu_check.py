"""The prepared device check for a lent GPU (never part of CI): the engine on CUDA, its
static passes replayed from CUDA graphs (`--cuda-graphs on`, `compiled`), with and
without batch-invariant passes (`--batch-invariant N`), on a model of the default
target's shape (SmolLM2-135M's config, random weights: the GGUF file is larger than
what travels to the device), in bfloat16 (float32 with GPU_CHECK_FLOAT32=1).

Prints a table and writes every figure to $OUT/gpu_check.json (or the folder given):
- a step: ms a token of greedy one-token steps;
- a pass of 5 tokens (a K = 4 verify pass) against a pass of 1, and 64 rows of one token
  against one row;
- exactness, on 16 prompts: a continuation of 64 random tokens fed as drafts of 4, each
  round one pass of 5 (as a verify pass takes them), against the same tokens fed one a
  step: how many positions' argmax agree and whether their logits are bit-identical
  (a random model's greedy output repeats one token: fed back, it would say little); and greedy
  speculation with drafts of 4 of which every third is wrong (rejections, caches
  rewritten): how many of the 16 outputs equal the one-token steps'; and 64 sessions'
  next tokens in one pass against each computed alone: how many rows are bit-identical;
- a pass keeping a feature drafter's layers against the same pass without: its logits
  bit-identical or not.

With GPU_CHECK_FAMILIES (a comma list of transformers model types: mistral, qwen2,
qwen3, phi3, gemma2, gemma3_text), the same check instead on a random model of each of
those families at the default target's shape, what each differs by switched on (Qwen2's
q/k/v biases and Qwen3's head norms drawn away from 0 and 1, windows of 64 on Mistral's
layers and Gemma's local ones, Gemma 2's capped scores and logits), graphs on with
batch-invariant passes of 8 (GPU_CHECK_PROMPTS prompts each, default 4): the fused
launches, static passes and CUDA graphs of every family the CPU's layer kernel runs.

    python -m tools.gpu_check [OUT]"""

import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from specdec.runtime.engine import Engine

SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                    rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)
PROMPT, STEPS, REPEATS, PROMPTS = 48, 64, 30, 16
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if os.environ.get("GPU_CHECK_SMOKE"):  # the script's own check, on a CPU: a small model, few repeats
    SMOLLM2_135M["num_hidden_layers"], STEPS, REPEATS, PROMPTS = 2, 9, 2, 3


WINDOW = 64  # Mistral's and Gemma's local layers': shorter than a prompt and its steps


def model(dtype: torch.dtype, family: str = "llama"):
    torch.manual_seed(0)
    if family == "llama":
        m = LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M))
    else:
        shape = dict(SMOLLM2_135M, head_dim=SMOLLM2_135M["hidden_size"] // SMOLLM2_135M["num_attention_heads"],
                     bos_token_id=None, eos_token_id=None, pad_token_id=None)
        if family == "mistral":
            shape["sliding_window"] = WINDOW
        if family.startswith("gemma"):
            shape.update(sliding_window=WINDOW, query_pre_attn_scalar=shape["head_dim"])
        m = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **shape))
        with torch.no_grad():  # biases and head norms that count (Gemma's norms hold w of 1 + w)
            for name, p in m.named_parameters():
                if name.endswith(("bias", "q_norm.weight", "k_norm.weight")) or (
                        family.startswith("gemma") and "layernorm" in name):
                    p.add_(torch.randn_like(p) * (0.05 if name.endswith("bias") else 0.3))
    with torch.no_grad():  # logits with margins, not a flat random head
        m.lm_head.weight.mul_(8.0)
    return m.to(device=DEVICE, dtype=dtype).eval()


def prompt(seed: int, n: int = PROMPT) -> list[int]:
    return torch.randint(0, SMOLLM2_135M["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def timed(fn) -> float:
    sync = torch.cuda.synchronize if DEVICE == "cuda" else (lambda: None)
    sync()
    started = time.perf_counter()
    fn()
    sync()
    return (time.perf_counter() - started) * 1000


def greedy(engine: Engine, ids: list[int], steps: int) -> tuple[list[int], float]:
    """One-token steps -> (tokens, ms a token after the first)."""
    seq = engine.new_sequence()
    seq.sync(0, ids)
    tokens = [int(engine.forward_now(seq, 1)[0][-1].argmax())]
    started = time.perf_counter()
    for _ in range(steps - 1):
        seq.extend([tokens[-1]])
        tokens.append(int(engine.forward_now(seq, 1)[0][-1].argmax()))
    ms = (time.perf_counter() - started) * 1000 / (steps - 1)
    engine.release(seq)
    return tokens, ms


def stepped(engine: Engine, ids: list[int], tokens: list[int]) -> list[torch.Tensor]:
    """`tokens` fed one a step -> the logits after the prompt and after each token but the
    last (as `verified` gives them)."""
    seq = engine.new_sequence()
    seq.sync(0, ids)
    out = [engine.forward_now(seq, 1)[0][-1]]
    for token in tokens[:-1]:
        seq.extend([token])
        out.append(engine.forward_now(seq, 1)[0][-1])
    engine.release(seq)
    return out


def verified(engine: Engine, ids: list[int], tokens: list[int], k: int = 4) -> list[torch.Tensor]:
    """The target's own tokens as drafts of k, each round one pass of k + 1 positions ->
    the logits after each position of `tokens` but the last."""
    seq = engine.new_sequence()
    seq.sync(0, ids)
    out = [engine.forward_now(seq, 1)[0][-1]]
    at = 0
    while at + k < len(tokens):
        seq.sync(len(ids) + at, tokens[at:at + k + 1])
        out += list(engine.forward_now(seq, k + 1)[0])
        at += k + 1
    engine.release(seq)
    return out[:len(tokens)]


def speculated(engine: Engine, ids: list[int], reference: list[int], k: int = 4) -> list[int]:
    """Greedy speculation with the reference's tokens as drafts of k, every third one
    wrong: each round one pass of the last token and its drafts, the longest agreeing
    prefix kept and the target's own token after it -> the output."""
    vocab = SMOLLM2_135M["vocab_size"]
    seq = engine.new_sequence()
    seq.sync(0, ids)
    out = [int(engine.forward_now(seq, 1)[0][-1].argmax())]
    while len(out) < len(reference):
        at = len(out)
        drafts = [t if (at + i) % 3 else (t + 1) % vocab for i, t in enumerate(reference[at:at + k])]
        seq.sync(len(ids) + at - 1, [out[-1]] + drafts)
        picks = engine.forward_now(seq, len(drafts) + 1)[0].argmax(-1).tolist()
        n = 0
        while n < len(drafts) and drafts[n] == picks[n]:
            n += 1
        out += drafts[:n] + [picks[n]]
    engine.release(seq)
    return out[:len(reference)]


def features_agree(engine: Engine) -> bool:
    """A 5-token pass keeping a feature drafter's layers (the first's input, the middle
    one's, the last one's output) gives the same logits, to the bit, as the pass without
    them."""
    n = SMOLLM2_135M["num_hidden_layers"]
    layers, logits = (0, n // 2, n), []
    for keep in ((), layers):
        seq = engine.new_sequence()
        seq.sync(0, prompt(7) + prompt(8, 5))
        engine.forward_now(seq, 1)
        seq.sync(PROMPT, prompt(9, 5))
        logits.append(engine.submit(seq, 5, layers=keep).future.result()[0])
        engine.release(seq)
    return torch.equal(*logits)


def rows_agree(engine: Engine, rows: int = 64) -> str:
    """Each of `rows` sessions' next token computed alone, then all in one pass: how many
    rows' logits are bit-identical."""
    seqs = [engine.new_sequence() for _ in range(rows)]
    alone = []
    for i, seq in enumerate(seqs):
        seq.sync(0, prompt(300 + i))
        engine.forward_now(seq, 1)
        seq.sync(PROMPT, prompt(400 + i, 1))
        alone.append(engine.forward_now(seq, 1)[0][-1])
        seq.sync(PROMPT, [])  # the token computed again below
    with engine.cond:
        for i, seq in enumerate(seqs):
            seq.sync(PROMPT, prompt(400 + i, 1))
        works = [engine.submit(seq, 1) for seq in seqs]
    together = [work.future.result()[0][-1] for work in works]
    for seq in seqs:
        engine.release(seq)
    return f"{sum(torch.equal(a, b) for a, b in zip(alone, together))}/{rows}"


def pass_ms(engine: Engine, n: int, rows: int = 1, runner: list | None = None) -> float:
    """Median ms of a pass of `rows` sessions x n new tokens, each over a 48-token cache
    (`runner`: the mean ms of the engine's own part, the runner's, appended to it)."""
    seqs = [engine.new_sequence() for _ in range(rows)]
    for i, seq in enumerate(seqs):
        seq.sync(0, prompt(100 + i))
        engine.forward_now(seq, 1)
    times = []
    busy, passes = engine.busy_s, engine.passes
    for r in range(REPEATS + 3):
        def one():
            with engine.cond:
                for seq in seqs:
                    seq.sync(PROMPT, prompt(200 + r, n))
                works = [engine.submit(seq, n) for seq in seqs]
            for work in works:
                work.future.result()
        times.append(timed(one))
    if runner is not None:
        runner.append((engine.busy_s - busy) * 1000 / (engine.passes - passes))
    for seq in seqs:
        engine.release(seq)
    return statistics.median(times[3:])


def replay_ms(graph) -> float:
    """A captured pass's replay alone, on the device's clock: median of 50."""
    times = []
    for _ in range(53):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[3:])


def check(dtype: torch.dtype, graphs: bool, compiled: bool = False, invariant: int = 0, family: str = "llama",
          prompts: int = PROMPTS) -> dict:
    m = model(dtype, family)
    started = time.perf_counter()
    engine = Engine(m, 1 << 30, cuda_graphs="compiled" if compiled else graphs, prefix_caching=False,
                    batch_invariant=invariant)
    try:
        greedy(engine, prompt(1), 8)  # warm: kernels loaded, the step's graphs captured
        for n, rows in ((5, 1), (1, 64)):
            pass_ms(engine, n, rows)  # their graphs captured before timing
        warm_s = time.perf_counter() - started
        out = {"family": family, "dtype": str(dtype).removeprefix("torch."), "cuda_graphs": graphs, "compiled": compiled,
               "invariant": invariant, "numerics": engine.numerics, "warm_s": round(warm_s, 2)}
        out["pass_1_ms"] = pass_ms(engine, 1)
        out["pass_5_ms"] = pass_ms(engine, 5)
        out["rows_64_ms"] = pass_ms(engine, 1, 64)
        out["pass_5_over_1"] = out["pass_5_ms"] / out["pass_1_ms"]
        out["rows_64_over_1"] = out["rows_64_ms"] / out["pass_1_ms"]
        agree = bits = total = same = 0
        step_ms = []
        outputs = []
        for seed in range(prompts):
            ids = prompt(10 + seed)
            tokens, ms = greedy(engine, ids, STEPS)
            step_ms.append(ms)
            outputs.append(tokens)
            # A random model's greedy output repeats a token: a random continuation instead.
            fed = prompt(1000 + seed, STEPS)
            for a, b in zip(stepped(engine, ids, fed), verified(engine, ids, fed)):
                total += 1
                agree += int(a.argmax() == b.argmax())
                bits += int(torch.equal(a, b))
            same += int(speculated(engine, ids, tokens) == tokens)
        out.update(step_ms=statistics.median(step_ms), verify_argmax_agree=f"{agree}/{total}",
                   verify_bit_identical=f"{bits}/{total}", speculation_identical=f"{same}/{prompts}",
                   features_bit_identical=features_agree(engine), rows_bit_identical=rows_agree(engine),
                   outputs=outputs)
        runner = []
        pass_ms(engine, 1, runner=runner)
        out["pass_1_engine_ms"] = runner[0]
        if static := engine.runner.static:
            out["graphs"] = len(static.graphs)
            out["static_passes"] = static.passes
            if DEVICE == "cuda" and graphs:
                out["replay_ms"] = {"x".join(map(str, key[:2])) + ("+features" if key[2] else ""): replay_ms(graph)
                                    for key, (graph, _) in sorted(static.graphs.items())}
        return out
    finally:
        engine.stop()
        del m
        if DEVICE == "cuda":
            torch.cuda.empty_cache()


def main() -> int:
    out_dir = Path(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "."))
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "torch": torch.__version__,
               "runs": []}
    # (dtype, graphs, compiled, invariant, family), the slow compiles last: a variant that
    # would start past the deadline is left out, so the check ends in its lease.
    variants = [(torch.bfloat16, True, False, 0), (torch.bfloat16, True, False, 8), (torch.bfloat16, True, False, 64),
                (torch.bfloat16, True, True, 8), (torch.bfloat16, True, True, 0)]
    if os.environ.get("GPU_CHECK_FLOAT32"):
        variants = [(torch.float32, True, False, 0), (torch.float32, True, False, 8)] + variants
    if os.environ.get("GPU_CHECK_NO_COMPILE"):
        variants = [v for v in variants if not v[2]]
    variants = [(*v, "llama") for v in variants]
    prompts = PROMPTS
    if families := os.environ.get("GPU_CHECK_FAMILIES"):
        global REPEATS
        variants = [(torch.bfloat16, True, False, 8, f) for f in families.split(",")]
        prompts = min(PROMPTS, int(os.environ.get("GPU_CHECK_PROMPTS", "4")))
        REPEATS = min(REPEATS, 10)  # six families in a stage's 90 s
    deadline = time.perf_counter() + float(os.environ.get("GPU_CHECK_DEADLINE_S", "300"))
    for dtype, graphs, compiled, invariant, family in variants:
        if time.perf_counter() > deadline:
            print(f"left out past the deadline: {family} {dtype} graphs={graphs} compiled={compiled} "
                  f"invariant={invariant}")
            continue
        run = check(dtype, graphs, compiled, invariant, family, prompts)
        results["runs"].append(run)
        (out_dir / "gpu_check.json").write_text(json.dumps(results, indent=1))
        print(json.dumps({k: v for k, v in run.items() if k != "outputs"}), flush=True)
    first = results["runs"][0]
    for other in [r for r in results["runs"][1:] if r["family"] == first["family"]]:
        same = sum(a == b for a, b in zip(first["outputs"], other["outputs"]))
        print(f"greedy outputs of {other['numerics']} against {first['numerics']}: {same}/{len(first['outputs'])} "
              f"identical")
    for r in results["runs"]:
        print(r["numerics"], "replay ms by bucket:", r.get("replay_ms"),
              "engine's part of a 1-token pass:", round(r["pass_1_engine_ms"], 3), "ms")
    print(f"\n{'family':12} {'numerics':42} {'step ms':>8} {'1 tok':>7} {'5 tok':>7} {'64 rows':>8} {'5/1':>5} "
          f"{'64/1':>5} {'verify argmax':>13} {'bits':>9} {'spec':>6} {'feat':>5} {'64 rows bits':>12} {'warm s':>6}")
    for r in results["runs"]:
        print(f"{r['family']:12} {r['numerics']:42} {r['step_ms']:8.2f} {r['pass_1_ms']:7.2f} "
              f"{r['pass_5_ms']:7.2f} {r['rows_64_ms']:8.2f} {r['pass_5_over_1']:5.2f} {r['rows_64_over_1']:5.2f} "
              f"{r['verify_argmax_agree']:>13} {r['verify_bit_identical']:>9} {r['speculation_identical']:>6} "
              f"{str(r['features_bit_identical']):>5} {r['rows_bit_identical']:>12} {r['warm_s']:6.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
