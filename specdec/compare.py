"""Target alone vs the full `specdec up` path, side by side on the same prompts:

    python -m specdec.compare [--draft ngram|MODEL] [--max-new-tokens 64] [-k 4]

Starts the services (as `specdec up` does), then for each prompt, interleaved: the
target alone in this process (transformers `generate`, greedy), and Generate through
the orchestrator over gRPC. Prints tokens/s, acceptance and whether the tokens agree.
(The full side-by-side benchmark is `specdec bench`'s job.)"""

import argparse
import statistics
import time

import grpc
import torch

from specdec import launch, modeling
from specdec.orchestrator.v1 import orchestrator_pb2 as pb, orchestrator_pb2_grpc

PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "List the days of the week, one per line.",
    "Tell me a short story about a cat who learns to fly.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=modeling.DEFAULT_TARGET)
    parser.add_argument("--draft", default="ngram")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("-k", type=int, default=4)
    args = parser.parse_args()
    model, tokenizer = modeling.load_model(args.target)
    services = launch.plan(args.target, args.draft, 1, launch.free_port())
    launch.start(services)
    try:
        launch.wait_serving(services, 600)
        channel = grpc.insecure_channel(services[-1].address)
        stub = orchestrator_pb2_grpc.OrchestratorServiceStub(channel)
        rows = []
        for prompt in PROMPTS:
            text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                 tokenize=False)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            started = time.perf_counter()
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 do_sample=False, max_new_tokens=args.max_new_tokens)
            alone_s = time.perf_counter() - started
            alone = out[0, len(ids):].tolist()
            started = time.perf_counter()
            result = stub.Complete(pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids),
                                                      max_new_tokens=args.max_new_tokens,
                                                      num_speculative_tokens=args.k), timeout=600)
            spec_s = time.perf_counter() - started
            rows.append((prompt[:40], len(alone) / alone_s, len(result.token_ids) / spec_s,
                         result.stats.acceptance_rate, list(result.token_ids) == alone))
        print(f"target {args.target}, draft {args.draft}, K={args.k}, max_new_tokens={args.max_new_tokens}")
        print("| prompt | target alone tok/s | specdec up tok/s | speedup | acceptance | same tokens |")
        print("|---|---|---|---|---|---|")
        for prompt, alone, spec, acc, same in rows:
            print(f"| {prompt} | {alone:.1f} | {spec:.1f} | {spec / alone:.2f}x | {acc:.2f} | {same} |")
        print(f"| median | {statistics.median(r[1] for r in rows):.1f} | {statistics.median(r[2] for r in rows):.1f} "
              f"| {statistics.median(r[2] / r[1] for r in rows):.2f}x | "
              f"{statistics.median(r[3] for r in rows):.2f} | {all(r[4] for r in rows)} |")
        channel.close()
    finally:
        launch.stop(services)


if __name__ == "__main__":
    main()
