"""Each model's path through the CPU engine, side by side: `specdec bench paths`.

The default target as its GGUF file runs on the file's blocks with its layers in one
kernel call. Here, in one process and interleaved (rounds of each engine in turn, the
median of each), against it: the same model as a transformers checkpoint (its float32
de-quantized weights) through `--quantize q8_m`, `q8_0`, `q4_0` and `int8` (--methods), and
random-weight checkpoints of exactly its shape in each family the layer kernel runs (saved,
then loaded as a user's model is), through `auto` (q8_m) and `int8`; and the shipped draft, its head
cut to its vocabulary as the drafter cuts it, through `int8` and `auto`. A one-token pass
and a 5-token verify pass each, after 120 positions of history. Writes paths.json and
paths.md to --out."""

import argparse
import statistics
import tempfile
from pathlib import Path

import torch

from deploy.bench import harness
from deploy.bench.engine import pass_seconds
from specdec import model_files
from specdec.runtime import modeling, quantize
from specdec.runtime.engine import Engine, one_thread_outside_engines

FAMILIES = ("llama", "qwen2", "mistral", "qwen3", "phi3", "gemma2", "gemma3_text")


def build_parser(parser=None) -> argparse.ArgumentParser:
    parser = parser or harness.parser_for("paths", __doc__)
    parser.add_argument("--target", default=modeling.DEFAULT_TARGET, help="a GGUF target: the reference path")
    parser.add_argument("--draft", default=modeling.DEFAULT_DRAFT)
    parser.add_argument("--threads", type=int, default=2, help="the target's passes' threads")
    parser.add_argument("--draft-threads", type=int, default=1, help="the draft's (a drafter's default)")
    parser.add_argument("--families", default=",".join(FAMILIES), help="the random checkpoints' families")
    parser.add_argument("--methods", default="q8_m,q8_0,q4_0,int8", help="the target as a checkpoint: its numerics")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of every engine in turn")
    parser.add_argument("--out", type=Path, default=Path("paths-out"))
    return parser


def random_checkpoint(family: str, like, tokenizer, path: Path) -> str:
    """A random-weight `family` model of `like`'s shape, saved with `tokenizer` at `path`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    c = like.config
    config = AutoConfig.for_model(
        family, vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.hidden_size // c.num_attention_heads,
        max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
        tie_word_embeddings=c.tie_word_embeddings, **({"sliding_window": None} if family == "mistral" else {}))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def main_with(args) -> int:
    torch.set_grad_enabled(False)
    one_thread_outside_engines()  # as the services do
    lines = []

    def say(line: str) -> None:
        lines.append(line)
        print(line, flush=True)

    reference, tokenizer = modeling.load_model(args.target)
    checkpoint = model_files.resolve(args.target)  # a GGUF target's de-quantized model directory
    work = tempfile.TemporaryDirectory()
    cases = [("target (its GGUF file)", args.target, "auto", args.threads)]
    cases += [("target as a checkpoint", checkpoint, m, args.threads) for m in args.methods.split(",") if m]
    for family in [f.strip() for f in args.families.split(",") if f.strip()]:
        path = random_checkpoint(family, reference, tokenizer, Path(work.name) / family)
        cases += [(f"random {family}", path, m, args.threads) for m in ("auto", "int8")]
    cases += [("shipped draft", args.draft, m, args.draft_threads) for m in ("int8", "auto")]
    del reference
    engines = []
    for label, spec, method, threads in cases:
        model, _ = modeling.load_model(spec)
        modeling.restrict_output(model, spec)  # the drafter's cut head, where the model names one
        eng = Engine(quantize.quantize(model, method), 1 << 28, max_batch_tokens=256, threads=threads)
        seq = eng.new_sequence()
        seq.sync(0, [(7 * j) % 5000 + 100 for j in range(120)])
        eng.forward_now(seq, 1)
        engines.append((f"{label}, --quantize {method}, {threads} thread{'s' * (threads > 1)}", eng, seq))
    times = {i: {1: [], 5: []} for i in range(len(engines))}
    for _ in range(args.rounds):
        for i, (_, eng, seq) in enumerate(engines):
            for n in (1, 5):
                times[i][n].append(pass_seconds(eng, [seq], [n], 120, reps=9))
    ms = {i: {n: statistics.median(t) * 1e3 for n, t in by_n.items()} for i, by_n in times.items()}
    say(f"medians of {args.rounds} rounds x 9 passes, each engine in turn; ratios to the target's GGUF file's "
        "(the drafts': to the draft's first line)")
    for i, (label, eng, _) in enumerate(engines):
        base = 0 if "draft" not in label else next(j for j, (other, _, _) in enumerate(engines) if "draft" in other)
        say(f"{label} -> {eng.numerics}: 1 token {ms[i][1]:.2f} ms ({ms[i][1] / ms[base][1]:.2f}x), "
            f"5 tokens {ms[i][5]:.2f} ms ({ms[i][5] / ms[base][5]:.2f}x)")
    for _, eng, _ in engines:
        eng.stop()
    work.cleanup()
    harness.write_report(args.out, "paths", {"meta": {"target": args.target, "draft": args.draft,
                                                      "threads": args.threads, "rounds": args.rounds},
                                             "lines": lines, "ms": ms},
                         "".join(f"- {line}\n" for line in lines), echo=False)
    return 0
