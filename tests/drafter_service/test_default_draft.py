"""The shipped draft, distilled from the default target: it is assembled and loaded
through the same path as any model, shares the target's vocabulary, and still agrees
with the target on held-out prompts. The floor is a regression guard set well below the
measured value (see the model card), not a benchmark."""

import torch

from tools.distill.data import chat_ids
from tools.distill.prompts import HELD_OUT
from specdec import model_files
from specdec.runtime import modeling

FLOOR = 0.15  # measured 0.271 here (52 of 192); untrained, the same layers score about 0.05
MAX_NEW = 48


def test_default_draft_agrees_with_the_default_target():
    shipped = model_files._SHIPPED / modeling.DEFAULT_DRAFT
    assert sum(p.stat().st_size for p in shipped.iterdir()) <= 40 * 2 ** 20
    target, tokenizer = modeling.load_model(modeling.DEFAULT_TARGET)
    draft, draft_tokenizer = modeling.load_model(modeling.DEFAULT_DRAFT)
    assert model_files.vocab_fingerprint(draft_tokenizer) == model_files.vocab_fingerprint(tokenizer)
    assert draft.config.vocab_size == target.config.vocab_size
    assert draft.config.num_hidden_layers < target.config.num_hidden_layers
    output_ids = modeling.restrict_output(draft, modeling.DEFAULT_DRAFT)
    assert output_ids is not None and len(output_ids) < target.config.vocab_size
    assert set(modeling.eos_token_ids(target, tokenizer)) <= set(output_ids.tolist())

    agree = total = 0
    with torch.inference_mode():
        for prompt in HELD_OUT[:4]:
            ids = torch.tensor([chat_ids(tokenizer, prompt)])
            out = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_NEW)
            answer = out[0, ids.shape[1]:]
            logits = draft(out).logits[0, ids.shape[1] - 1:-1]  # [answer, draft vocabulary]
            agree += int((output_ids[logits.argmax(-1)] == answer).sum())
            total += len(answer)
    assert agree / total >= FLOOR, f"greedy agreement {agree / total:.3f} on {total} held-out tokens"
