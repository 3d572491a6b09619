"""Distil a draft model from the target: `python -m tools.distill.train`.

The draft is the target's embedding, its first `--layers` decoder layers (trained), its
final norm (trained) and its tied output head. Only the trained layers and norm are
shipped; the embedding is borrowed from the installed target when the draft is first
loaded (`borrowed.json`, see specdec.runtime.modeling). It trains over the `--vocab`
tokens the target uses most, and drafts from the `--serve-vocab` most used of those
(`draft_vocab.json`): on a CPU the 49k-row head is a large part of a small model's step.

Loss: cross-entropy of the draft's distribution (over its vocabulary) against the
target's, from the target's top-k logits at every position of the data (data.py),
renormalised over the tokens the draft can emit."""

import json
import logging
import math
import random
import sys
import time
from pathlib import Path

import torch

from tools.distill import data, prompts as prompt_sets

log = logging.getLogger(__name__)


def build_student(target, layers: list[int]):
    """A LlamaForCausalLM made of the target's embedding, the given layers and its norm."""
    from transformers import AutoModelForCausalLM

    config = target.config.__class__.from_dict(target.config.to_dict())
    config.num_hidden_layers = len(layers)
    config.tie_word_embeddings = True
    student = AutoModelForCausalLM.from_config(config)
    state = target.state_dict()
    own = {"model.embed_tokens.weight": state["model.embed_tokens.weight"],
           "model.norm.weight": state["model.norm.weight"]}
    for new, old in enumerate(layers):
        prefix = f"model.layers.{old}."
        own.update({f"model.layers.{new}." + k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})
    student.load_state_dict(own, strict=False)
    student.tie_weights()
    return student


def _counts(records: list[dict], vocab_size: int) -> torch.Tensor:
    """How often each token is in an answer or the target's first choice."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for r in records:
        counts.index_add_(0, r["top_ids"][:, 0].long(), torch.ones(len(r["top_ids"]), dtype=torch.long))
        answer = torch.tensor(r["tokens"][r["start"]:], dtype=torch.long)
        counts.index_add_(0, answer, torch.ones(len(answer), dtype=torch.long))
    return counts


def draft_vocabulary(chat: list[dict], text: list[dict], size: int, vocab_size: int,
                     always: list[int], chat_weight: int = 16) -> torch.Tensor:
    """The `size` tokens the target uses most, plus `always`. Chat is what the draft
    serves, so one occurrence there counts `chat_weight` in installed text (whose code
    and markup would otherwise crowd out the words of answers)."""
    counts = _counts(chat, vocab_size) * chat_weight + _counts(text, vocab_size)
    counts[torch.tensor(always)] = counts.max() + 1
    return torch.topk(counts, size).indices.sort().values


class Batches:
    """Token-budget batches of records, each with the positions that carry a target
    distribution and that distribution over the draft vocabulary."""

    def __init__(self, records, index_of: torch.Tensor, tokens_per_batch: int, seed: int):
        self.records, self.index_of = records, index_of
        self.tokens_per_batch, self.rng = tokens_per_batch, random.Random(seed)

    def __iter__(self):
        order = list(range(len(self.records)))
        self.rng.shuffle(order)
        batch, longest = [], 0
        for i in order:
            length = len(self.records[i]["tokens"])
            if batch and max(longest, length) * (len(batch) + 1) > self.tokens_per_batch:
                yield self.collate(batch)
                batch, longest = [], 0
            batch.append(self.records[i])
            longest = max(longest, length)
        if batch:
            yield self.collate(batch)

    def collate(self, batch):
        width = max(len(r["tokens"]) for r in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        rows, cols, top_ids, top_lp = [], [], [], []
        for b, r in enumerate(batch):
            ids[b, :len(r["tokens"])] = torch.tensor(r["tokens"])
            mask[b, :len(r["tokens"])] = 1
            n = len(r["top_ids"])
            rows.append(torch.full((n,), b))
            cols.append(torch.arange(r["start"] - 1, r["start"] - 1 + n))  # position i predicts i + 1
            top_ids.append(r["top_ids"].long())
            top_lp.append(r["top_lp"].float())
        top_ids, top_lp = torch.cat(top_ids), torch.cat(top_lp)
        sub = self.index_of[top_ids]  # -1: outside the draft vocabulary
        p = top_lp.exp() * (sub >= 0)
        p = p / p.sum(-1, keepdim=True).clamp_min(1e-9)
        return ids, mask, torch.cat(rows), torch.cat(cols), sub.clamp_min(0), p


def distill_loss(student, head: torch.Tensor, batch) -> torch.Tensor:
    ids, mask, rows, cols, sub, p = batch
    hidden = student.model(input_ids=ids, attention_mask=mask).last_hidden_state[rows, cols]
    logq = torch.log_softmax(hidden @ head.T, dim=-1)
    return -(p * logq.gather(-1, sub)).sum(-1).mean()


@torch.inference_mode()
def held_out_reference(target, tokenizer, max_new_tokens: int, temperature: float = 0.7,
                       prompts: list[str] | None = None):
    """The target's greedy answers to the held-out prompts (or `prompts`), and at each
    answer position its distribution at `temperature` (top 256 tokens, which hold nearly
    all the mass)."""
    refs = []
    for prompt in prompt_sets.HELD_OUT if prompts is None else prompts:
        ids = torch.tensor([data.chat_ids(tokenizer, prompt)])
        out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                              do_sample=False, pad_token_id=tokenizer.pad_token_id)
        tokens = out[0]
        logits = target(tokens[None]).logits[0, ids.shape[1] - 1:-1]
        p = torch.softmax(logits / temperature, -1)
        top = torch.topk(p, 256, -1)
        refs.append({"tokens": tokens, "start": ids.shape[1], "p_ids": top.indices, "p": top.values})
    return refs


@torch.inference_mode()
def acceptance(student, head: torch.Tensor, vocab: torch.Tensor, index_of: torch.Tensor, refs,
               temperature: float = 0.7) -> dict:
    """Greedy agreement (the draft's top token equals the target's greedy token) and
    sampled acceptance sum(min(p, q)) at temperature, over the held-out answers."""
    agree, total, overlap, covered = 0, 0, 0.0, 0
    for r in refs:
        hidden = student.model(input_ids=r["tokens"][None]).last_hidden_state[0, r["start"] - 1:-1]
        logits = hidden @ head.T
        answer = r["tokens"][r["start"]:]
        agree += int((vocab[logits.argmax(-1)] == answer).sum())
        covered += int((index_of[answer] >= 0).sum())
        total += len(answer)
        q = torch.softmax(logits / temperature, -1)
        sub = index_of[r["p_ids"]]
        q_at = torch.where(sub >= 0, q.gather(-1, sub.clamp_min(0)), torch.zeros_like(r["p"]))
        overlap += float(torch.minimum(r["p"], q_at).sum())
    return {"greedy": agree / total, "sampled": overlap / total, "vocab_coverage": covered / total,
            "positions": total}


def save(student, vocab: torch.Tensor, out: Path, source: str, meta: dict) -> None:
    """What is shipped: the trained tensors in fp16, the config, the borrowed tensors'
    source and the draft vocabulary."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.float16).contiguous() for k, v in student.state_dict().items()
             if k.startswith("model.layers.") or k == "model.norm.weight"}
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    config = student.config.to_dict()
    config["dtype"] = "float16"
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out / "borrowed.json").write_text(json.dumps(
        {"from": source, "tensors": ["model.embed_tokens.weight"], "tokenizer": True}, indent=2) + "\n")
    (out / "draft_vocab.json").write_text(json.dumps({"token_ids": vocab.tolist()}) + "\n")
    (out / "training.json").write_text(json.dumps(meta, indent=2) + "\n")


def main(argv=None):
    import argparse

    from tqdm import tqdm

    from specdec.runtime import modeling

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=Path, required=True, help="the data directory of data.py")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--target", default=modeling.DEFAULT_TARGET)
    parser.add_argument("--layers", default="0,1", help="target layers the draft starts from")
    parser.add_argument("--vocab", type=int, default=12288, help="size of the draft vocabulary it trains over")
    parser.add_argument("--serve-vocab", type=int, default=8192,
                        help="size of the vocabulary it drafts from (the most used of --vocab): a smaller head "
                             "is a cheaper step, and the tokens left out are ones it rarely predicts")
    parser.add_argument("--minutes", type=float, default=30)
    parser.add_argument("--epochs", type=float, default=6)
    parser.add_argument("--steps", type=int, default=None,
                        help="exact number of steps (reproduces a run); default: as many as --epochs and --minutes allow")
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--tokens-per-batch", type=int, default=4096)
    parser.add_argument("--text-weight", type=float, default=1.0,
                        help="fraction of the installed-text records used")
    parser.add_argument("--chat-repeat", type=int, default=2,
                        help="times each chat answer occurs per epoch (they are what the draft serves)")
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--held-out-tokens", type=int, default=128, help="target tokens per held-out prompt")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    torch.manual_seed(args.seed)

    target, tokenizer = modeling.load_model(args.target)
    chat, text = data.load(args.work, "chat"), data.load(args.work, "text")
    text = random.Random(args.seed).sample(text, int(len(text) * args.text_weight))
    records = chat * args.chat_repeat + text
    always = sorted(set(modeling.eos_token_ids(target, tokenizer)) | set(tokenizer.all_special_ids))
    vocab = draft_vocabulary(chat, text, args.vocab, target.config.vocab_size, always)
    index_of = torch.full((target.config.vocab_size,), -1, dtype=torch.long)
    index_of[vocab] = torch.arange(len(vocab))
    log.info("data: %d chat answers (%d positions), %d text windows (%d positions); draft vocabulary %d",
             len(chat), sum(len(r["top_ids"]) for r in chat), len(text), sum(len(r["top_ids"]) for r in text),
             len(vocab))

    cached = args.work / f"held_out-{args.held_out_tokens}.pt"  # the target's answers do not change
    if not cached.exists():
        torch.save(held_out_reference(target, tokenizer, args.held_out_tokens), cached)
    refs = torch.load(cached)
    student = build_student(target, [int(x) for x in args.layers.split(",")])
    del target
    embed = student.model.embed_tokens.weight
    embed.requires_grad_(False)
    head = lambda: embed[vocab]  # tied and frozen: the head rows are the target's
    trained = [p for n, p in student.named_parameters() if p.requires_grad]
    start = acceptance(student.eval(), head(), vocab, index_of, refs)
    log.info("held-out before training: %s", start)

    batches = Batches(records, index_of, args.tokens_per_batch, args.seed)
    steps_per_epoch = sum(1 for _ in batches)
    total = args.steps or int(steps_per_epoch * args.epochs)
    opt = torch.optim.AdamW(trained, lr=args.lr, weight_decay=0.0, betas=(0.9, 0.98))
    warmup = max(1, min(100, total // 10))
    plan = {"total": total}  # the cosine ends when the data or the time budget does
    schedule = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / plan["total"]))))
    deadline = time.monotonic() + args.minutes * 60
    curve, step, smooth = [{"step": 0, "minutes": 0.0, **start}], 0, None
    started = time.monotonic()
    bar = tqdm(total=total, desc="distil", mininterval=30)
    while step < total and (args.steps or time.monotonic() < deadline):
        for batch in batches:
            student.train()
            loss = distill_loss(student, head(), batch)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trained, 1.0)
            opt.step()
            schedule.step()
            step += 1
            if step == 20 and not args.steps:  # now the pace is known: fit the schedule into the time budget
                pace = (time.monotonic() - started) / step
                plan["total"] = total = min(total, int(args.minutes * 60 / pace))
                bar.total = total
                log.info("%.2f s per step: %d steps (%.1f epochs)", pace, total, total / steps_per_epoch)
            smooth = loss.item() if smooth is None else 0.98 * smooth + 0.02 * loss.item()
            bar.update(1)
            bar.set_postfix(loss=f"{smooth:.3f}")
            if step % args.eval_every == 0 or step == total or (not args.steps and time.monotonic() >= deadline):
                result = acceptance(student.eval(), head(), vocab, index_of, refs)
                minutes = (time.monotonic() - started) / 60
                curve.append({"step": step, "minutes": round(minutes, 1), "loss": round(smooth, 4), **result})
                log.info("step %d (%.1f min): loss %.3f, held-out greedy %.3f, sampled %.3f",
                         step, minutes, smooth, result["greedy"], result["sampled"])
            if step >= total or (not args.steps and time.monotonic() >= deadline):
                break
    bar.close()
    served = draft_vocabulary(chat, text, min(args.serve_vocab, len(vocab)), len(index_of), always)
    served_index = torch.full_like(index_of, -1)
    served_index[served] = torch.arange(len(served))
    served_result = acceptance(student.eval(), embed[served], served, served_index, refs)
    log.info("held-out drafting from the %d most used tokens: %s", len(served), served_result)
    meta = {"command": " ".join(["python -m tools.distill.train"] + (argv or sys.argv[1:])),
            "layers": args.layers, "vocab": len(vocab), "served_vocab": len(served),
            "steps": step, "epochs": step / steps_per_epoch,
            "minutes": round((time.monotonic() - started) / 60, 1),
            "data": {"chat_answers": len(chat), "chat_positions": sum(len(r["top_ids"]) for r in chat),
                     "text_windows": len(text), "text_positions": sum(len(r["top_ids"]) for r in text)},
            "held_out": curve[-1], "held_out_served_vocab": served_result, "curve": curve}
    save(student, served, args.out, args.target, meta)
    log.info("saved to %s: %s", args.out, curve[-1])


if __name__ == "__main__":
    main()
