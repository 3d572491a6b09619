"""The distillation data's self-written prompts (data.magpie_prompts): what the target
writes after its template's opening of a user turn becomes a prompt only where the turn
ends, is long enough, new and not held out; a stopped run resumes from its file. The
model is a stand-in that replays fixed continuations: the unit under test is what is
kept of them, not what a model writes."""

import json

import torch

from tools.distill import data, prompts


class Replay:
    """`generate` returning the prompt followed by the next of the given continuations."""

    def __init__(self, rows: list[list[int]]):
        self.rows, self.calls = rows, []

    def generate(self, input_ids, max_new_tokens, eos_token_id, pad_token_id, **kwargs):
        self.calls.append(input_ids)
        out = []
        for i in range(len(input_ids)):
            row = self.rows[(len(self.calls) - 1) * len(input_ids) + i][:max_new_tokens]
            out.append(input_ids[i].tolist() + row + [pad_token_id] * (max_new_tokens - len(row)))
        return torch.tensor(out)


def test_self_written_prompts_keep_ended_new_turns_and_resume(tmp_path, smol_tokenizer):
    end = smol_tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = lambda text: smol_tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    rows = [
        ids("How do I keep basil alive on a windowsill?") + [end],
        ids("How do I keep basil alive on a windowsill?") + [end],  # said twice: kept once
        ids(prompts.HELD_OUT[0]) + [end],  # a held-out prompt: never trained on
        ids("Hi") + [end],  # too short to be a request
        ids(" word" * 80),  # cut off by the budget: not a whole turn
        ids("Write a haiku about rust on an old bicycle.") + [end] + ids(" trailing"),
    ]
    model = Replay(rows + [ids("Name three rivers in Peru.") + [end]] * 3)
    got = data.magpie_prompts(model, smol_tokenizer, tmp_path, count=3, seed=0, minutes=1, batch_size=3)
    assert got == ["How do I keep basil alive on a windowsill?", "Write a haiku about rust on an old bicycle.",
                   "Name three rivers in Peru."]
    # Each call starts where a user's turn starts in the chat template, after the system turn.
    opening = smol_tokenizer.decode(model.calls[0][0])
    assert opening.endswith("<|im_start|>user\n") and "<|im_start|>system" in opening
    assert json.loads((tmp_path / "magpie-prompts.json").read_text()) == got
    # Resumed: the prompts on file are not asked for again.
    again = Replay([])
    assert data.magpie_prompts(again, smol_tokenizer, tmp_path, count=3, seed=0, minutes=1) == got
    assert again.calls == []
