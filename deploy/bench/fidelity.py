"""How faithful a model's numerics are to the model as published: `specdec bench fidelity`.

The reference is the target with its weights de-quantized to float32 (for a GGUF file,
its blocks exactly: the published model) and float32 arithmetic. Each numerics
(`--quantize` methods) and, with `--llama-cpp DIR`, llama.cpp's `llama-server` on the
same file, answers 16 chat prompts greedily; per numerics:
- prompts whose greedy tokens are identical to the reference's;
- the first divergence (median tokens before it);
- the perplexity ratio: how much less likely the reference's own greedy text is under
  the numerics than under the reference (1.0: as likely).
With --rounded-activations BITS/BLOCK,...: numerics a kernel could have, simulated on the
reference: every linear layer's input rounded per BLOCK columns to BITS-bit integers with
a block scale (the largest magnitude to the largest integer), the products in float64
(a kernel's integer sums are exact). 16/32 is what our GGUF kernels do; 8/32 what
llama.cpp's dot products do. Writes fidelity.json and fidelity.md to --out."""

import argparse
import statistics
from pathlib import Path

import torch

from deploy.bench import harness
from specdec.runtime import modeling, quantize

PROMPTS = [
    "What causes the seasons on Earth?",
    "Write a haiku about autumn leaves.",
    "How do I make a cup of green tea?",
    "Explain what a prime number is to a child.",
    "What are three benefits of regular exercise?",
    "Describe the water cycle in a few sentences.",
    "Why is the sky blue?",
    "Suggest a name for a friendly robot.",
    "How does a bicycle stay upright?",
    "What should I pack for a weekend camping trip?",
    "Summarize the plot of Romeo and Juliet.",
    "What is the difference between weather and climate?",
    "Give me a simple recipe for pancakes.",
    "How do bees make honey?",
    "What is machine learning, in two sentences?",
    "Write a short thank-you note to a teacher.",
]


def greedy(model, ids: list[int], n: int) -> list[int]:
    x = torch.tensor([ids])
    out = model.generate(x, max_new_tokens=n, do_sample=False, attention_mask=torch.ones_like(x))
    return out[0, len(ids):].tolist()


def nll(model, ids: list[int], answer: list[int]) -> float:
    """Mean negative log-likelihood of `answer` after `ids`."""
    logits = model(torch.tensor([ids + answer])).logits[0, len(ids) - 1:-1].double()
    return torch.nn.functional.cross_entropy(logits, torch.tensor(answer)).item()


def round_activations(model, bits: int, block: int):
    """The reference `model` with each linear layer's input rounded (see the module's
    docstring), in place; -> model."""
    top = float(2 ** (bits - 1) - 1)

    def rounded(linear):
        weight = linear.weight.double()
        bias = None if linear.bias is None else linear.bias.double()

        def forward(x):
            blocks = x.double().reshape(*x.shape[:-1], x.shape[-1] // block, block)
            amax = blocks.abs().amax(-1, keepdim=True)
            scale = torch.where(amax > 0, amax / top, torch.ones_like(amax)).float().double()  # a float32 scale
            x = (torch.round(blocks / scale) * scale).reshape(x.shape)
            return torch.nn.functional.linear(x, weight, bias).float()
        return forward

    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            if module.in_features % block:
                raise SystemExit(f"--rounded-activations: {module.in_features} columns are not blocks of {block}")
            module.forward = rounded(module)
    return model


def first_divergence(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def summary(label: str, reference: list[list[int]], answers: list[list[int]], ratio: float | None) -> str:
    same = sum(a == r for a, r in zip(answers, reference))
    diverge = statistics.median(first_divergence(a, r) for a, r in zip(answers, reference))
    return (f"{label}: identical on {same} of {len(reference)} prompts; first divergence after a median of "
            f"{diverge:g} tokens; perplexity ratio " + (f"{ratio:.4f}" if ratio is not None else "n/a"))


def llama_cpp_answers(bin_dir: str, target: str, prompts: list[list[int]], n: int, threads: int) -> list[list[int]]:
    with harness.llama_server(bin_dir, target, threads=threads) as url:
        return [harness.llama_completion(url, ids, n, return_tokens=True)["tokens"] for ids in prompts]


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or harness.parser_for("fidelity", __doc__)
    parser.add_argument("--target", default=modeling.DEFAULT_TARGET)
    parser.add_argument("--quantize", default="gguf,int8", help="numerics to compare with the float32 reference")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--llama-cpp", metavar="DIR", help="llama.cpp's bin directory: add llama-server's answers")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounded-activations", default="", metavar="BITS/BLOCK,...",
                        help="also simulate each such rounding of the linear layers' inputs (16/32: our kernels')")
    parser.add_argument("--out", type=Path, default=Path("fidelity-out"))
    return parser


def main_with(args) -> int:
    torch.set_grad_enabled(False)
    torch.set_num_threads(args.threads)
    reference, tokenizer = modeling.load_model(args.target)
    prompts = [harness.chat_ids(tokenizer, p) for p in PROMPTS]
    want = [greedy(reference, ids, args.max_new_tokens) for ids in prompts]
    base = [nll(reference, ids, a) for ids, a in zip(prompts, want)]
    lines = []

    def report(label: str, got: list[list[int]], ratio: float | None) -> None:
        lines.append(summary(label, want, got, ratio))
        print(lines[-1], flush=True)

    def of_model(label: str, model) -> None:
        got = [greedy(model, ids, args.max_new_tokens) for ids in prompts]
        report(label, got, torch.tensor([nll(model, ids, a) - b for ids, a, b in zip(prompts, want, base)]
                                        ).mean().exp().item())

    for method in [m.strip() for m in args.quantize.split(",") if m.strip()]:
        model = quantize.quantize(modeling.load_model(args.target)[0], method)
        of_model(f"{method} ({quantize.method_of(model)})", model)
        del model
    for spec in [r.strip() for r in args.rounded_activations.split(",") if r.strip()]:
        bits, block = (int(v) for v in spec.split("/"))
        of_model(f"{bits}-bit activations per {block} columns (simulated)",
                 round_activations(modeling.load_model(args.target)[0], bits, block))
    if args.llama_cpp:
        report("llama.cpp (llama-server)",
               llama_cpp_answers(args.llama_cpp, args.target, prompts, args.max_new_tokens, args.threads), None)
    meta = {"target": args.target, "max_new_tokens": args.max_new_tokens, "prompts": len(PROMPTS),
            "threads": args.threads}
    harness.write_report(args.out, "fidelity", {"meta": meta, "lines": lines},
                         "".join(f"- {line}\n" for line in lines), echo=False)
    return 0
