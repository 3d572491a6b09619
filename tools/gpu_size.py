"""The GPU at a real target's size (never part of CI): a Llama-3.1-8B-shaped target and a
Llama-3.2-1B-shaped draft, random bfloat16 weights built on the device. A model built
from a config costs what the published one costs a step, and exactness holds for any
weights; the published ones cannot be fetched where this runs. (Their rope scaling is
left out: it changes no pass's cost.)

    python -m tools.gpu_size engine OUT   the engine's passes, into OUT/gpu_size.json
    python -m tools.gpu_size save DIR     both models as checkpoints the services load (DIR/target,
                                          DIR/draft), with the default target's tokenizer

`engine` measures, with CUDA graphs on and off:
- the copy bandwidth of the device (a 2 GiB buffer copied: bytes read and written over
  the time), and from it the bound of a one-token step: the bytes of the weights a step
  reads (every parameter but the input embedding, of which a step reads one row) over
  that bandwidth;
- the target's one-token step (greedy steps, ms a token), passes of 2, 3, 5 and 9 tokens
  of one session (a verify pass of K = 1, 2, 4 and 8), and 8 and 64 sessions' one-token
  passes, each over a 48-token cache; the draft's step and 5-token pass;
and, with `--batch-invariant` passes of 8 tokens and graphs, greedy speculation at K = 4
with drafts of which every third is wrong (rejections, caches rewritten) against the
same engine's one-token steps, on 8 prompts: how many outputs are token-identical (the
target alone's tokens in bfloat16 with the same numerics). The same speculation without
batch-invariant passes is reported beside it (bfloat16 rounds a pass of 5 otherwise than
a pass of 1: not required to agree).

GPU_CHECK_SMOKE=1: the script's own check, on a CPU: small models of the same vocabulary."""

import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdec.runtime.engine import Engine
from tools import gpu_check
from tools.gpu_check import DEVICE, greedy, pass_ms, prompt, speculated

COMMON = dict(vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
              bos_token_id=128000, eos_token_id=128001)
SHAPES = {
    # Llama-3.1-8B
    "target": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                   num_key_value_heads=8, tie_word_embeddings=False, **COMMON),
    # Llama-3.2-1B
    "draft": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                  num_key_value_heads=8, head_dim=64, tie_word_embeddings=True, **COMMON),
}
PASSES = (2, 3, 5, 9)  # a verify pass of K = 1, 2, 4, 8
ROWS = (8, 64)
PROMPTS, STEPS, INVARIANT = 8, 48, 8
KV_BYTES = 4 << 30
COPY_BYTES = 2 << 30
SMOKE = bool(os.environ.get("GPU_CHECK_SMOKE"))
if SMOKE:
    for shape in SHAPES.values():
        shape.update(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=32)
    PASSES, ROWS, PROMPTS, STEPS, KV_BYTES, COPY_BYTES = (2, 5), (8,), 2, 10, 64 << 20, 64 << 20


def build(name: str, dtype: torch.dtype = torch.bfloat16):
    """A model of SHAPES[name], random weights built where it runs (no host copy of 16 GB)."""
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = LlamaForCausalLM._from_config(LlamaConfig(**SHAPES[name]), dtype=dtype)
    with torch.no_grad():  # logits with margins, not a flat random head
        model.lm_head.weight.mul_(8.0)
    return model.eval()


def weight_bytes(model) -> int:
    """What a one-token step reads of the weights: every parameter once, but the input
    embedding's one row (a tied head is read whole, as the head)."""
    embedding = model.get_input_embeddings().weight
    tied = embedding is model.get_output_embeddings().weight
    return sum(p.numel() * p.element_size() for p in model.parameters() if tied or p is not embedding)


def copy_gb_s() -> float:
    """The device's copy bandwidth: bytes read and written by copying a buffer, median of 20."""
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    times = [gpu_check.timed(lambda: dst.copy_(src)) for _ in range(23)]
    return 2 * COPY_BYTES / (statistics.median(times[3:]) / 1000) / 1e9


def step_ms(engine: Engine, prompts: int = 4, steps: int = 32) -> float:
    return statistics.median(greedy(engine, prompt(50 + i), steps)[1] for i in range(prompts))


def passes(engine: Engine) -> dict:
    """ms of the engine's passes: the step, a session's passes of PASSES tokens, ROWS
    sessions' one-token passes."""
    greedy(engine, prompt(1), 8)  # warm: kernels loaded, graphs captured
    for n in PASSES:
        pass_ms(engine, n)
    for rows in ROWS:
        pass_ms(engine, 1, rows)
    out = {"step_ms": step_ms(engine), "pass_1_ms": pass_ms(engine, 1)}
    out.update({f"pass_{n}_ms": pass_ms(engine, n) for n in PASSES})
    out.update({f"rows_{rows}_ms": pass_ms(engine, 1, rows) for rows in ROWS})
    return out


def speculation(engine: Engine) -> str:
    """Greedy speculation at K = 4 against the engine's own one-token steps, PROMPTS
    prompts of STEPS tokens: how many outputs are token-identical."""
    same = 0
    for seed in range(PROMPTS):
        ids = prompt(10 + seed)
        alone, _ = greedy(engine, ids, STEPS)
        same += int(speculated(engine, ids, alone, k=4) == alone)
    return f"{same}/{PROMPTS}"


def measured(model, **engine_flags) -> dict:
    engine = Engine(model, KV_BYTES, prefix_caching=False, **engine_flags)
    try:
        started = time.perf_counter()
        out = passes(engine)
        out.update(numerics=engine.numerics, warm_and_timed_s=round(time.perf_counter() - started, 1),
                   speculation_identical=speculation(engine))
        return out
    finally:
        engine.stop()


def engine_check(out_dir: Path) -> dict:
    results = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "torch": torch.__version__,
               "shapes": SHAPES, "copy_gb_s": copy_gb_s()}

    def save():  # after each run: a stage its time limit cuts keeps what it measured
        (out_dir / "gpu_size.json").write_text(json.dumps(results, indent=1))

    graphs = [True, False] if DEVICE == "cuda" else [False]  # a CPU has no graphs to capture
    for name in ("target", "draft"):
        model = build(name)
        bound = weight_bytes(model) / (results["copy_gb_s"] * 1e9) * 1000
        runs = results[name] = {"weight_bytes": weight_bytes(model), "bound_ms": bound}
        for on in graphs:
            runs["graphs" if on else "eager"] = measured(model, cuda_graphs=on)
            save()
        if name == "target":
            runs["invariant"] = measured(model, cuda_graphs=graphs[0], batch_invariant=INVARIANT)
            save()
        del model
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    return results


def report(results: dict) -> str:
    lines = [f"{results['device']}: copy {results['copy_gb_s']:.0f} GB/s"]
    for name in ("target", "draft"):
        runs = results[name]
        lines.append(f"{name}: {runs['weight_bytes'] / 1e9:.2f} GB of weights a step, bound {runs['bound_ms']:.2f} ms")
        for mode, r in runs.items():
            if not isinstance(r, dict):
                continue
            parts = [f"step {r['step_ms']:.2f} ms ({r['step_ms'] / runs['bound_ms']:.2f}x bound)"]
            parts += [f"{n} tok {r[f'pass_{n}_ms'] / r['pass_1_ms']:.2f}x" for n in PASSES]
            parts += [f"{rows} rows {r[f'rows_{rows}_ms'] / r['pass_1_ms']:.2f}x" for rows in ROWS]
            lines.append(f"  {mode:9} {r['numerics']}: " + ", ".join(parts) + f" of a 1-token pass "
                         f"({r['pass_1_ms']:.2f} ms); speculation K=4 identical {r['speculation_identical']}")
    return "\n".join(lines)


def save_checkpoints(out_dir: Path) -> None:
    """Both models as checkpoints with the default target's tokenizer: prompts encode to
    its 49,152 ids, and a random model's tokens past them decode to nothing."""
    from specdec.defaults import DEFAULT_TARGET
    from specdec.model_files import load_tokenizer, resolve

    tokenizer = load_tokenizer(resolve(DEFAULT_TARGET))
    for name in ("target", "draft"):
        started = time.perf_counter()
        model = build(name)
        model.save_pretrained(out_dir / name)
        tokenizer.save_pretrained(out_dir / name)
        print(f"{name}: saved to {out_dir / name} in {time.perf_counter() - started:.1f} s", flush=True)
        del model
        if DEVICE == "cuda":
            torch.cuda.empty_cache()


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("engine", "save"):
        print(__doc__, file=sys.stderr)
        return 2
    out_dir = Path(argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    if argv[0] == "save":
        save_checkpoints(out_dir)
        return 0
    print(report(engine_check(out_dir)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
