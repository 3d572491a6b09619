"""How far a draft that reads the target's hidden states gets on the same data:
`python -m drafter_service.distill.features_probe --work /tmp/distill`.

A probe for the next draft, not a draft we ship. The head is EAGLE's (Li et al. 2024):
from the target's last hidden state f[i] at position i and the embedding of token
x[i+1], one decoder layer (started from one of the target's) predicts f[i+1], and the
target's own output head turns that into the distribution of x[i+2]. Serving it would
need the verifier to send f for committed positions on the wire; this measures whether
that is worth it, with the held-out metric of train.py: how often the head's top token
is the target's greedy token, and sum(min(p, q)) at temperature 0.7, over the held-out
answers, with the target's f at the committed positions (what a first draft sees).

Data: the chat records of data.py (the target's answers to the training prompts); the
target's hidden states over them are computed once and cached in --work."""

import argparse
import json
import logging
import math
import random
import sys
import time
from pathlib import Path

import torch

from drafter_service.distill import data
from drafter_service.distill.train import held_out_reference

log = logging.getLogger(__name__)


@torch.inference_mode()
def target_features(target, records: list[dict], batch: int = 8) -> list[torch.Tensor]:
    """The target's last hidden state (what its output head reads) at every position."""
    out: list[torch.Tensor | None] = [None] * len(records)
    order = sorted(range(len(records)), key=lambda i: len(records[i]["tokens"]))
    for b in range(0, len(order), batch):
        rows = order[b:b + batch]
        width = max(len(records[i]["tokens"]) for i in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        for j, i in enumerate(rows):
            ids[j, :len(records[i]["tokens"])] = torch.tensor(records[i]["tokens"])
        hidden = target.model(input_ids=ids).last_hidden_state  # right padding: causal, so harmless
        for j, i in enumerate(rows):
            out[i] = hidden[j, :len(records[i]["tokens"])].to(torch.float16).clone()
    return out


class FeatureHead(torch.nn.Module):
    """f_hat[i+1] = Layer(W [embed(x[i+1]); f[i]]); logits of x[i+2] = head(f_hat[i+1])."""

    def __init__(self, target, layer: int):
        super().__init__()
        from transformers import AutoModelForCausalLM

        config = target.config.__class__.from_dict(target.config.to_dict())
        config.num_hidden_layers = 1
        self.body = AutoModelForCausalLM.from_config(config).model
        self.body.embed_tokens = None  # inputs are given as vectors
        state = target.state_dict()
        prefix = f"model.layers.{layer}."
        self.body.layers[0].load_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})
        self.body.norm.weight.data.copy_(state["model.norm.weight"])
        width = config.hidden_size
        self.fc = torch.nn.Linear(2 * width, width, bias=False)
        with torch.no_grad():  # start as the embedding plus half the feature
            self.fc.weight.zero_()
            self.fc.weight[:, :width] = torch.eye(width)
            self.fc.weight[:, width:] = 0.5 * torch.eye(width)

    def forward(self, embedded: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        return self.body(inputs_embeds=self.fc(torch.cat([embedded, features], -1))).last_hidden_state


@torch.no_grad()
def evaluate(model: FeatureHead, embed, head, vocab, index_of, refs, temperature: float = 0.7) -> dict:
    agree = total = 0
    overlap = 0.0
    for r in refs:
        tokens, start, f = r["tokens"], r["start"], r["features"]
        predicted = model(embed[tokens[1:]][None], f[:-1][None].float())[0]  # [i] predicts f[i + 1]
        logits = predicted[start - 2:len(tokens) - 2] @ head.T  # -> the answer tokens x[start:]
        answer = tokens[start:]
        agree += int((vocab[logits.argmax(-1)] == answer).sum())
        total += len(answer)
        q = torch.softmax(logits / temperature, -1)
        sub = index_of[r["p_ids"]]
        q_at = torch.where(sub >= 0, q.gather(-1, sub.clamp_min(0)), torch.zeros_like(r["p"]))
        overlap += float(torch.minimum(r["p"], q_at).sum())
    return {"greedy": agree / total, "sampled": overlap / total, "positions": total}


def main(argv=None):
    from specdec import modeling

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=Path, required=True, help="the data directory of data.py")
    parser.add_argument("--target", default=modeling.DEFAULT_TARGET)
    parser.add_argument("--vocab-from", default=modeling.DEFAULT_DRAFT,
                        help="model directory whose draft_vocab.json the head scores (the shipped draft's)")
    parser.add_argument("--layer", type=int, default=29, help="target layer the head's layer starts from")
    parser.add_argument("--minutes", type=float, default=20)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--feature-loss", type=float, default=0.1, help="weight of the hidden-state regression")
    parser.add_argument("--noise", type=float, default=0.05, help="uniform noise on input features (EAGLE)")
    parser.add_argument("--tokens-per-batch", type=int, default=4096)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--held-out-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=None, help="where to write the curve (JSON)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)

    target, tokenizer = modeling.load_model(args.target)
    chat = data.load(args.work, "chat")
    cached = args.work / "features-chat.pt"
    if not cached.exists():
        started = time.monotonic()
        torch.save(target_features(target, chat), cached)
        log.info("target features over %d records in %.0f s", len(chat), time.monotonic() - started)
    features = torch.load(cached)
    refs_path = args.work / f"held_out-{args.held_out_tokens}.pt"
    if not refs_path.exists():
        torch.save(held_out_reference(target, tokenizer, args.held_out_tokens), refs_path)
    refs = torch.load(refs_path)
    with torch.inference_mode():
        for r in refs:
            r["features"] = target.model(input_ids=r["tokens"][None]).last_hidden_state[0].clone()

    vocab = torch.tensor(json.loads((Path(modeling.resolve(args.vocab_from)) / "draft_vocab.json").read_text())
                         ["token_ids"])
    index_of = torch.full((target.config.vocab_size,), -1, dtype=torch.long)
    index_of[vocab] = torch.arange(len(vocab))
    embed = target.model.embed_tokens.weight.detach()
    head = target.lm_head.weight.detach()[vocab].clone()
    model = FeatureHead(target, args.layer)
    del target
    trained = list(model.parameters())
    opt = torch.optim.AdamW(trained, lr=args.lr, weight_decay=0.0)
    curve = [{"step": 0, "minutes": 0.0, **evaluate(model, embed, head, vocab, index_of, refs)}]
    log.info("before training: %s", curve[0])

    started, step = time.monotonic(), 0
    deadline = started + args.minutes * 60
    while time.monotonic() < deadline:
        order = list(range(len(chat)))
        rng.shuffle(order)
        batches, batch, longest = [], [], 0
        for i in order:
            length = len(chat[i]["tokens"])
            if batch and max(longest, length) * (len(batch) + 1) > args.tokens_per_batch:
                batches.append(batch)
                batch, longest = [], 0
            batch.append(i)
            longest = max(longest, length)
        batches.append(batch)
        for rows in batches:
            if time.monotonic() >= deadline:
                break
            width = max(len(chat[i]["tokens"]) for i in rows)
            ids = torch.zeros(len(rows), width, dtype=torch.long)
            f = torch.zeros(len(rows), width, embed.shape[1])
            mask = torch.zeros(len(rows), width - 1)
            for j, i in enumerate(rows):
                n = len(chat[i]["tokens"])
                ids[j, :n] = torch.tensor(chat[i]["tokens"])
                f[j, :n] = features[i].float()
                mask[j, :n - 1] = 1
            for group in opt.param_groups:
                group["lr"] = args.lr * min(1.0, (step + 1) / 20) * 0.5 * (
                    1 + math.cos(math.pi * min(1.0, (time.monotonic() - started) / (args.minutes * 60))))
            noisy = f[:, :-1] + (torch.rand_like(f[:, :-1]) - 0.5) * 2 * args.noise
            predicted = model(embed[ids[:, 1:]], noisy)
            wanted = f[:, 1:]
            regression = (torch.nn.functional.smooth_l1_loss(predicted, wanted, reduction="none").mean(-1)
                          * mask).sum() / mask.sum()
            with torch.no_grad():
                p = torch.softmax(wanted @ head.T, -1)  # the target's distribution of x[i+2]
            cross_entropy = (-(p * torch.log_softmax(predicted @ head.T, -1)).sum(-1) * mask).sum() / mask.sum()
            loss = cross_entropy + args.feature_loss * regression
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trained, 1.0)
            opt.step()
            step += 1
            if step % args.eval_every == 0:
                minutes = (time.monotonic() - started) / 60
                curve.append({"step": step, "minutes": round(minutes, 1), "loss": round(loss.item(), 4),
                              **evaluate(model, embed, head, vocab, index_of, refs)})
                log.info("step %d (%.1f min): loss %.3f, held-out greedy %.3f, sampled %.3f", step, minutes,
                         loss.item(), curve[-1]["greedy"], curve[-1]["sampled"])
    curve.append({"step": step, "minutes": round((time.monotonic() - started) / 60, 1),
                  **evaluate(model, embed, head, vocab, index_of, refs)})
    log.info("final: %s", curve[-1])
    if args.out:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "curve": curve},
                                       indent=1) + "\n")


if __name__ == "__main__":
    main()
