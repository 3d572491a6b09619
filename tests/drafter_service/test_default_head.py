"""The shipped EAGLE-3 head for the default target: it assembles with the target's own
embedding, and on held-out prompts (never trained on) its first draft agrees with the
target's greedy token above a floor (its model card: 0.45 on 16 prompts x 128 tokens)."""

import torch

from tools.distill import prompts
from tools.distill.data import chat_ids
from tools.distill.eagle_head import target_states
from specdec import model_files
from specdec.runtime import eagle, modeling

HEAD = "smollm2-135m-eagle3"


def test_the_shipped_head_drafts_what_the_target_says_on_held_out_prompts():
    target, tokenizer = modeling.load_model(modeling.DEFAULT_TARGET)
    head = eagle.load_head(model_files.resolve(HEAD))
    assert head.embed_tokens.weight.dtype == torch.float32
    torch.testing.assert_close(head.embed_tokens.weight, target.model.embed_tokens.weight, rtol=1e-3, atol=1e-3)
    agree = total = 0
    for prompt in prompts.HELD_OUT[:4]:
        ids = torch.tensor([chat_ids(tokenizer, prompt)])
        with torch.inference_mode():
            tokens = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=48, do_sample=False,
                                     pad_token_id=tokenizer.pad_token_id)[0]
        features, _ = target_states(target, tokens[None], head.aux_layers)
        with torch.inference_mode():
            out = head.unrolled(tokens[None, 1:], features[:, :-1].half().float(), 1)[0][0]
        at = torch.arange(ids.shape[1] - 2, len(tokens) - 2)
        agree += int((head.token_ids[head.logits(out[at]).argmax(-1)] == tokens[at + 2]).sum())
        total += len(at)
    assert agree / total > 0.3, agree / total
