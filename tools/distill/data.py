"""Distillation data: the target's next-token distributions (top-k of its logits) at
every position we train on, from two sources.

- chat: the target answers the training prompts (batched `generate`, half greedy, half
  sampled at temperature 0.8, 128 new tokens at most); its logits at each generated step
  come with the answer. The prompts are the templates of prompts.py, or (`--chat-source
  magpie`) prompts the target writes itself (`magpie_prompts`).
- text: teacher-forced passes of the target over text that is installed here (package
  documentation and the Python reference), which give a distribution per position at a
  fraction of generation's cost.

Each stage appends shards to a work directory and stops after its time budget, so a run
can be stopped and resumed."""

import glob
import json
import logging
import os
import random
import site
import sys
import time
from pathlib import Path

import torch

from tools.distill import prompts as prompt_sets

log = logging.getLogger(__name__)

TOP_K = 20  # teacher logits kept per position; the rest of the mass is dropped


def _top(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k token ids and their log-probabilities under the full softmax."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    top = torch.topk(logprobs, TOP_K, dim=-1)
    return top.indices.to(torch.int32), top.values.to(torch.float16)


def _shards(work: Path, kind: str) -> list[Path]:
    return sorted(work.glob(f"{kind}-*.pt"))


def _save(work: Path, kind: str, records: list[dict]) -> None:
    index = len(_shards(work, kind))
    partial = work / f"{kind}-{index:05d}.pt.partial"
    torch.save(records, partial)
    partial.rename(work / f"{kind}-{index:05d}.pt")


def chat_ids(tokenizer, prompt: str) -> list[int]:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True,
        return_dict=False)


def magpie_prompts(model, tokenizer, work: Path, count: int, seed: int, minutes: float,
                   batch_size: int = 48, max_new_tokens: int = 64) -> list[str]:
    """Prompts the target writes itself (Magpie, Xu et al. 2024): its chat template up to
    where a user's turn begins, sampled at temperature 1 until the turn ends: the kinds of
    request an instruction-tuned target was tuned on, not the templates' few. (Measured on
    the default target's head: 1152 of them moved its first draft 0.449 -> 0.457 on held-out
    chat and 0.506 -> 0.491 on unseen template prompts; its model card.) Kept: turns that end within
    `max_new_tokens`, of 4 tokens or more, each once, none a held-out prompt. Saved to
    --work as they come (`magpie-prompts.json`), so a stopped run resumes."""
    path = work / "magpie-prompts.json"
    prompts = json.loads(path.read_text()) if path.exists() else []
    marker = "\x00"
    template = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False,
                                             add_generation_prompt=False)
    pre = tokenizer(template[:template.index(marker)], add_special_tokens=False).input_ids
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ends = {end_of_turn, tokenizer.eos_token_id} - {None}
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    seen = {p.lower() for p in prompts} | {p.lower() for p in prompt_sets.HELD_OUT}
    deadline = time.monotonic() + minutes * 60
    batch_index = len(prompts) // batch_size
    while len(prompts) < count and time.monotonic() < deadline:
        torch.manual_seed(seed * 100003 + 7919 * batch_index)
        batch_index += 1
        input_ids = torch.tensor([pre] * batch_size)
        with torch.inference_mode():
            out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=True,
                                 temperature=1.0, top_p=1.0, top_k=None, max_new_tokens=max_new_tokens,
                                 eos_token_id=sorted(ends), pad_token_id=pad)
        for row in out[:, len(pre):].tolist():
            end = next((i for i, t in enumerate(row) if t in ends), None)
            if end is None or end < 4:
                continue  # cut off by the budget, or too short to be a request
            text = tokenizer.decode(row[:end]).strip()
            if text and text.lower() not in seen:
                seen.add(text.lower())
                prompts.append(text)
        path.write_text(json.dumps(prompts, indent=0))
        log.info("magpie: %d prompts", len(prompts))
    return prompts[:count]


def generate_chat(model, tokenizer, work: Path, minutes: float, seed: int, max_prompts: int | None = None,
                  batch_size: int = 48, max_new_tokens: int = 128, progress=None,
                  prompts: list[str] | None = None) -> None:
    """Target answers to training prompts (`prompts`, else the templates'), with the
    target's top-k at every answer token."""
    prompts = (prompts if prompts is not None else prompt_sets.training_prompts(seed))[:max_prompts]
    done = sum(len(torch.load(s)) for s in _shards(work, "chat"))
    eos = set(model.generation_config.eos_token_id if isinstance(model.generation_config.eos_token_id, list)
              else [model.generation_config.eos_token_id])
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    deadline = time.monotonic() + minutes * 60
    batch_index = done // batch_size
    while time.monotonic() < deadline and done < len(prompts):
        batch = prompts[done:done + batch_size]
        ids = [chat_ids(tokenizer, p) for p in batch]
        width = max(map(len, ids))
        input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids])
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
        sampled = batch_index % 2 == 1
        torch.manual_seed(seed * 100003 + batch_index)
        with torch.inference_mode():
            out = model.generate(
                input_ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                do_sample=sampled, temperature=0.8 if sampled else None, top_p=0.95 if sampled else None,
                top_k=None, pad_token_id=pad, output_logits=True, return_dict_in_generate=True)
        logits = torch.stack(out.logits, dim=1)  # [batch, steps, vocab]
        top_ids, top_lp = _top(logits)
        records, tokens = [], 0
        for row, prompt_ids in enumerate(ids):
            answer = out.sequences[row, width:].tolist()
            n = next((i + 1 for i, t in enumerate(answer) if t in eos), len(answer))
            records.append({"tokens": prompt_ids + answer[:n], "start": len(prompt_ids),
                            "top_ids": top_ids[row, :n].clone(), "top_lp": top_lp[row, :n].clone(),
                            "sampled": sampled})
            tokens += n
        _save(work, "chat", records)
        done += len(batch)
        batch_index += 1
        if progress is not None:
            progress.update(tokens)
        log.info("chat: %d prompts answered, %d tokens in this batch (%s)", done, tokens,
                 "sampled" if sampled else "greedy")


def installed_text() -> list[str]:
    """Permissively licensed prose and code that ships with the installed packages:
    package descriptions (their READMEs) and the Python language reference topics."""
    texts = []
    roots = site.getsitepackages() + [site.getusersitepackages()]
    for root in roots:
        for path in sorted(glob.glob(os.path.join(root, "*.dist-info", "METADATA"))):
            body = Path(path).read_text(errors="ignore").split("\n\n", 1)[-1]
            if len(body) > 500:
                texts.append(body)
    try:
        from pydoc_data import topics
        texts += list(topics.topics.values())
    except ImportError:
        pass
    return texts


def teacher_text(model, tokenizer, work: Path, minutes: float, seed: int, max_windows: int | None = None,
                 window: int = 256, batch_size: int = 8, progress=None) -> None:
    """The target's top-k at every position of installed text, in windows."""
    texts = installed_text()
    random.Random(seed).shuffle(texts)
    stream = []
    for text in texts:
        stream += tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]
    windows = [stream[i:i + window] for i in range(0, len(stream) - window, window)][:max_windows]
    done = sum(len(torch.load(s)) for s in _shards(work, "text"))
    log.info("text: %d windows of %d tokens available, %d done", len(windows), window, done)
    deadline = time.monotonic() + minutes * 60
    while time.monotonic() < deadline and done < len(windows):
        batch = torch.tensor(windows[done:done + batch_size])
        with torch.inference_mode():
            logits = model(batch).logits
        top_ids, top_lp = _top(logits[:, :-1])  # position i predicts token i + 1
        _save(work, "text", [{"tokens": batch[r].tolist(), "start": 1, "top_ids": top_ids[r],
                              "top_lp": top_lp[r], "sampled": False} for r in range(len(batch))])
        done += len(batch)
        if progress is not None:
            progress.update(batch.numel())


def load(work: Path, kind: str) -> list[dict]:
    records = []
    for shard in _shards(work, kind):
        records += torch.load(shard)
    return records


def main(argv=None):
    import argparse

    from tqdm import tqdm

    from specdec.runtime import modeling

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--target", default=modeling.DEFAULT_TARGET)
    parser.add_argument("--chat-prompts", type=int, default=960, help="training prompts the target answers")
    parser.add_argument("--chat-minutes", type=float, default=60, help="time budget of the chat stage")
    parser.add_argument("--chat-source", choices=("templates", "magpie"), default="templates",
                        help="the training prompts: prompts.py's templates, or written by the target itself")
    parser.add_argument("--text-windows", type=int, default=1440, help="256-token windows of installed text")
    parser.add_argument("--text-minutes", type=float, default=60, help="time budget of the text stage")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    args.work.mkdir(parents=True, exist_ok=True)
    model, tokenizer = modeling.load_model(args.target)
    started, prompts = time.monotonic(), None
    if args.chat_source == "magpie":
        prompts = magpie_prompts(model, tokenizer, args.work, args.chat_prompts, args.seed, args.chat_minutes)
    minutes = args.chat_minutes - (time.monotonic() - started) / 60
    with tqdm(desc="chat tokens", unit="tok", mininterval=30) as bar:
        generate_chat(model, tokenizer, args.work, minutes, args.seed, args.chat_prompts, progress=bar,
                      prompts=prompts)
    with tqdm(desc="text tokens", unit="tok", mininterval=30) as bar:
        teacher_text(model, tokenizer, args.work, args.text_minutes, args.seed, args.text_windows, progress=bar)


if __name__ == "__main__":
    main()
