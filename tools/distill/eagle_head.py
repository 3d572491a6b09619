"""Trains an EAGLE-3 head (specdec.runtime.eagle) for a target from the distillation data:
`python -m tools.distill.eagle_head --work /tmp/distill --out DIR --minutes 35`.

Data: the chat records of data.py (the target's own answers to the training prompts).
The target runs once over each record; its residual stream at the head's layers (the
features the verifier sends) and its final hidden state (its distribution at each
position, over the draft vocabulary) are kept in --work. The head learns, unrolled
`--steps` deep as it drafts (EAGLE-3's training-time test), the target's distribution of
x[i+2+j] from (f[i], x[i+1]) and its own outputs; loss: cross-entropy against the
target's distribution renormalised over the draft vocabulary, step j weighted 0.8^j.

Held out: the 16 prompts of prompts.HELD_OUT, the target's greedy answers; reported
per draft position: how often the head's top token is the target's (the chain's earlier
drafts being right, as in a round), and the chance that the first j drafts all are.
`--init HEAD` goes on training a head; `--evaluate HEAD...` only measures heads (on
--eval-prompts, a prompt file, where given)."""

import argparse
import json
import logging
import math
import random
import sys
import time
from pathlib import Path

import torch

from tools.distill import data
from tools.distill.train import held_out_reference
from specdec.runtime import eagle

log = logging.getLogger(__name__)


@torch.inference_mode()
def target_states(target, tokens: torch.Tensor, layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [B, T] -> the features at `layers` [B, T, n*H] and the final hidden state [B, T, H]."""
    out = target.model(input_ids=tokens, output_hidden_states=True)
    return torch.cat([out.hidden_states[i] for i in layers], -1), out.last_hidden_state


def extract(target, records: list[dict], layers: tuple[int, ...], batch: int = 8) -> list[dict]:
    out: list[dict | None] = [None] * len(records)
    order = sorted(range(len(records)), key=lambda i: len(records[i]["tokens"]))
    for b in range(0, len(order), batch):
        rows = order[b:b + batch]
        width = max(len(records[i]["tokens"]) for i in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        for j, i in enumerate(rows):
            ids[j, :len(records[i]["tokens"])] = torch.tensor(records[i]["tokens"])
        features, final = target_states(target, ids, layers)  # right padding: causal, so harmless
        for j, i in enumerate(rows):
            n = len(records[i]["tokens"])
            out[i] = {"tokens": ids[j, :n].clone(), "features": features[j, :n].half().clone(),
                      "final": final[j, :n].half().clone()}
    return out


def with_features(target, refs: list[dict], layers: tuple[int, ...]) -> list[dict]:
    """Each reference answer with the target's features at every position (half precision,
    as the verifier sends them)."""
    for r in refs:
        r["features"] = target_states(target, r["tokens"][None], layers)[0][0].half()
    return refs


def initial_head(target, vocab: torch.Tensor, window: int) -> eagle.Eagle3Head:
    """A head started from the target: its layer from the target's high layer (the
    hidden half of q, k and v; the embedding half at zero), fc passing that layer's
    features through, the target's final norm and its head's rows of the draft vocabulary."""
    config = target.config
    layers = eagle.aux_layers_for(config.num_hidden_layers)
    fields = {k: v for k, v in config.to_dict().items()
              if k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                       "head_dim", "rms_norm_eps", "vocab_size", "max_position_embeddings", "rope_theta",
                       "rope_parameters", "rope_scaling", "hidden_act", "attention_bias", "mlp_bias",
                       "bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings")}
    fields["num_hidden_layers"] = 1
    head = eagle.Eagle3Head(eagle.HeadConfig(layer=fields, draft_vocab=len(vocab), target_hidden=config.hidden_size,
                                             aux_layers=layers, window=window))
    source = target.model.layers[layers[-1]]
    hidden = config.hidden_size
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj"):
            weight = getattr(head.midlayer, name).weight
            weight.zero_()
            weight[:, hidden:] = getattr(source.self_attn, name).weight
        head.midlayer.o_proj.weight.copy_(source.self_attn.o_proj.weight)
        head.midlayer.mlp.load_state_dict(source.mlp.state_dict())
        for norm in (head.midlayer.input_layernorm, head.midlayer.hidden_norm):
            norm.weight.copy_(source.input_layernorm.weight)
        head.midlayer.post_attention_layernorm.weight.copy_(source.post_attention_layernorm.weight)
        head.fc.weight.zero_()
        head.fc.weight[:, -hidden:] = torch.eye(hidden)
        head.norm.weight.copy_(target.model.norm.weight)
        head.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        head.lm_head.weight.copy_(target.lm_head.weight[vocab])
        head.d2t.copy_(vocab - torch.arange(len(vocab)))
    return head


@torch.no_grad()
def evaluate(head: eagle.Eagle3Head, refs: list[dict], steps: int) -> dict:
    """Per draft position j: agreement of the head's top token with the target's greedy
    one where the chain's earlier drafts were right, and the rate at which drafts 1..j all are."""
    token_ids = head.token_ids
    right = [0] * steps
    all_right = [0] * steps
    total = 0
    for r in refs:
        tokens, start = r["tokens"], r["start"]
        outputs = head.unrolled(tokens[None, 1:], r["features"][None, :-1].float(), steps)
        # index i predicts x[i+2+j]; the answer starts at `start`: chains from index start-2
        chains = range(start - 2, len(tokens) - 2)
        good = torch.ones(len(chains), dtype=torch.bool)
        for j, out in enumerate(outputs):
            idx = torch.tensor([i for i in chains])
            valid = idx + 2 + j < len(tokens)
            guess = token_ids[head.logits(out[0, idx]).argmax(-1)]
            want = tokens[(idx + 2 + j).clamp(max=len(tokens) - 1)]
            hit = (guess == want) & valid
            good &= hit
            right[j] += int(hit.sum())
            all_right[j] += int(good.sum())
            if j == 0:
                total += len(chains)
    return {"positions": total, "first": right[0] / total,
            "all_right": [round(x / total, 4) for x in all_right],
            "conditional": [round(all_right[j] / max(1, all_right[j - 1] if j else total), 4)
                            for j in range(steps)]}


def step_costs(head_spec: str, target_spec: str, threads: int = 2, repeats: int = 30) -> dict:
    """A draft step of the head (one session, one token after a 64-position context) and a
    step of the target (its GGUF numerics through the engine, one token after 64), timed
    alternately in one run on `threads` threads: medians in ms, and c, their ratio."""
    import statistics

    from specdec import model_files
    from specdec.runtime import modeling, quantize
    from specdec.runtime.engine import Engine

    torch.set_num_threads(threads)
    head = eagle.load_head(model_files.resolve(head_spec))
    target, _ = modeling.load_model(target_spec)
    engine = Engine(quantize.quantize(target, "auto"), 64 << 20, threads=threads, prefix_caching=False)
    width = len(head.aux_layers) * head.config.target_hidden
    cache = eagle.HeadCache()
    head.step([(cache, torch.randint(0, 1000, (64,)), torch.randn(64, width), 0, True)])
    seq = engine.new_sequence()
    seq.sync(0, torch.randint(0, 1000, (64,)).tolist())
    engine.forward_now(seq, 1)
    draft_ms, target_ms = [], []
    g = torch.randn(1, head.config.llama().hidden_size)
    for _ in range(repeats):
        started = time.perf_counter()
        head.step([(cache, torch.tensor([5]), g, 64, False)])
        draft_ms.append((time.perf_counter() - started) * 1e3)
        cache.crop(64)
        seq.extend([5])
        started = time.perf_counter()
        engine.forward_now(seq, 1)
        target_ms.append((time.perf_counter() - started) * 1e3)
        seq.sync(0, seq.tokens[:64])
    engine.stop()
    draft, step = statistics.median(draft_ms), statistics.median(target_ms)
    return {"draft_step_ms": round(draft, 3), "target_step_ms": round(step, 3), "c": round(draft / step, 4),
            "threads": threads, "repeats": repeats}


def main(argv=None):
    from specdec import model_files
    from specdec.runtime import modeling

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=Path, help="the data directory of data.py")
    parser.add_argument("--out", type=Path, help="where the head goes")
    parser.add_argument("--target", default=modeling.DEFAULT_TARGET)
    parser.add_argument("--vocab-from", default=modeling.DEFAULT_DRAFT,
                        help="model directory whose draft_vocab.json the head drafts from")
    parser.add_argument("--minutes", type=float, default=35)
    parser.add_argument("--steps", type=int, default=3, help="drafting steps unrolled in training")
    parser.add_argument("--window", type=int, default=eagle.DEFAULT_WINDOW)
    parser.add_argument("--init", metavar="HEAD", help="go on training this head (a model name or directory) "
                                                        "instead of starting from the target's layers")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--tokens-per-batch", type=int, default=4096)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--held-out-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--evaluate", metavar="HEAD", nargs="+",
                        help="measure these heads on the held-out prompts (or --eval-prompts); nothing else")
    parser.add_argument("--eval-prompts", type=Path, metavar="FILE",
                        help="with --evaluate: chat prompts, one a line ('#' and '[section]' lines skipped)")
    parser.add_argument("--eval-limit", type=int, default=32, help="with --eval-prompts: the first this many")
    parser.add_argument("--cost-of", metavar="HEAD", help="time a draft step of HEAD against a target step "
                                                           "(step_costs) and print it; nothing else")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    if args.cost_of:
        print(json.dumps(step_costs(args.cost_of, args.target)))
        return
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)

    target, tokenizer = modeling.load_model(args.target)
    layers = eagle.aux_layers_for(target.config.num_hidden_layers)
    if args.evaluate:
        prompts = None
        if args.eval_prompts:
            lines = [line.strip() for line in args.eval_prompts.read_text().splitlines()]
            prompts = [line for line in lines if line and line[0] not in "#["][:args.eval_limit]
            if not prompts:
                raise SystemExit(f"--eval-prompts {args.eval_prompts}: no prompt in it")
        refs = with_features(target, held_out_reference(target, tokenizer, args.held_out_tokens, prompts=prompts),
                             layers)
        for spec in args.evaluate:
            head = eagle.load_head(model_files.resolve(spec))
            print(json.dumps({"head": spec, "prompts": len(refs), **evaluate(head, refs, args.steps)}))
        return
    cached = args.work / f"eagle-states-{'-'.join(map(str, layers))}.pt"
    started = time.monotonic()
    if not cached.exists():
        chat = data.load(args.work, "chat")
        torch.save(extract(target, chat, layers), cached)
        log.info("target states over %d records in %.0f s", len(chat), time.monotonic() - started)
    records = torch.load(cached)
    extract_s = time.monotonic() - started
    refs_path = args.work / f"held_out-{args.held_out_tokens}.pt"
    if not refs_path.exists():
        torch.save(held_out_reference(target, tokenizer, args.held_out_tokens), refs_path)
    refs = with_features(target, torch.load(refs_path), layers)

    vocab = torch.tensor(json.loads((Path(model_files.resolve(args.vocab_from)) / "draft_vocab.json").read_text())
                         ["token_ids"])
    if args.init:
        head = eagle.load_head(model_files.resolve(args.init), window=args.window).train()
        if not torch.equal(head.token_ids.cpu(), vocab):
            raise SystemExit(f"--init {args.init}: its draft vocabulary is not --vocab-from's")
    else:
        head = initial_head(target, vocab, args.window)
    target_head = target.lm_head.weight.detach()[vocab].clone()  # the target's distribution over the draft vocab
    del target
    head.embed_tokens.weight.requires_grad_(False)  # the target's: the drafter borrows it
    trained = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    curve = [{"step": 0, "minutes": 0.0, **evaluate(head, refs, args.steps)}]
    log.info("before training: %s", curve[0])
    positions = sum(len(r["tokens"]) for r in records)
    log.info("%d records, %d positions", len(records), positions)

    started, step, epochs = time.monotonic(), 0, 0
    best = None  # (held-out agreement at the first position, step, the head's state)
    deadline = started + args.minutes * 60
    while time.monotonic() < deadline:
        order = list(range(len(records)))
        rng.shuffle(order)
        batches, batch, longest = [], [], 0
        for i in order:
            length = len(records[i]["tokens"]) - 1
            if batch and max(longest, length) * (len(batch) + 1) > args.tokens_per_batch:
                batches.append(batch)
                batch, longest = [], 0
            batch.append(i)
            longest = max(longest, length)
        batches.append(batch)
        for rows in batches:
            if time.monotonic() >= deadline:
                break
            width = max(len(records[i]["tokens"]) for i in rows) - 1
            tokens = torch.zeros(len(rows), width, dtype=torch.long)
            features = torch.zeros(len(rows), width, records[rows[0]]["features"].shape[-1])
            final = torch.zeros(len(rows), width + args.steps + 1, target_head.shape[1])
            mask = torch.zeros(len(rows), width + args.steps + 1)
            for j, i in enumerate(rows):
                r = records[i]
                n = len(r["tokens"]) - 1
                tokens[j, :n] = r["tokens"][1:]
                features[j, :n] = r["features"][:-1].float()
                final[j, :n] = r["final"][1:].float()  # index i: the target at position i+1 -> x[i+2]
                mask[j, :n] = 1
            progress = min(1.0, (time.monotonic() - started) / (args.minutes * 60))
            for group in opt.param_groups:
                group["lr"] = args.lr * min(1.0, (step + 1) / 30) * 0.5 * (1 + math.cos(math.pi * progress))
            outputs = head.unrolled(tokens, features, args.steps)
            loss = 0.0
            for j, out in enumerate(outputs):
                m = mask[:, j:j + width]
                with torch.no_grad():
                    p = torch.softmax(final[:, j:j + width] @ target_head.T, -1)
                ce = -(p * torch.log_softmax(head.logits(out), -1)).sum(-1)
                loss = loss + 0.8 ** j * (ce * m).sum() / m.sum().clamp_min(1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trained, 0.5)
            opt.step()
            step += 1
            if step % args.eval_every == 0:
                minutes = (time.monotonic() - started) / 60
                curve.append({"step": step, "minutes": round(minutes, 1), "loss": round(float(loss), 4),
                              **evaluate(head, refs, args.steps)})
                log.info("step %d (%.1f min): loss %.3f, held-out %s", step, minutes, float(loss), curve[-1])
                if best is None or curve[-1]["first"] > best[0]:
                    best = (curve[-1]["first"], step, {k: v.clone() for k, v in head.state_dict().items()})
        epochs += 1
    curve.append({"step": step, "minutes": round((time.monotonic() - started) / 60, 1),
                  **evaluate(head, refs, args.steps)})
    log.info("final: %s", curve[-1])
    kept = step
    if best is not None and best[0] > curve[-1]["first"]:
        head.load_state_dict(best[2])
        kept = best[1]
        log.info("keeping step %d's head (held-out first-position agreement %.4f)", kept, best[0])
    eagle.save_head(head, args.out, skip=("embed_tokens.weight",))
    (args.out / "borrowed.json").write_text(json.dumps(
        {"from": args.target, "tensors": {"model.embed_tokens.weight": "embed_tokens.weight"}, "tokenizer": True},
        indent=2) + "\n")
    (args.out / "training.json").write_text(json.dumps(
        {"args": {k: str(v) for k, v in vars(args).items()}, "records": len(records), "positions": positions,
         "state_extraction_s": round(extract_s), "epochs_started": epochs, "kept_step": kept, "curve": curve},
        indent=1) + "\n")


if __name__ == "__main__":
    main()
