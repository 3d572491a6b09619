"""The target's features (its residual stream at chosen layers) from the engine: what a
feature drafter drafts from. Keeping them changes no logit, and they are what the model
computes at those layers."""

import asyncio

import pytest
import torch

from specdec.runtime import modeling, quantize
from specdec.runtime.engine import Engine

LAYERS = (2, 15, 27)


@pytest.fixture(scope="module")
def models():
    plain, _ = modeling.load_model(modeling.DEFAULT_TARGET)
    gguf, _ = modeling.load_model(modeling.DEFAULT_TARGET)
    return plain, quantize.quantize(gguf, "gguf")


def reference(model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's own forward (transformers, not the engine): hidden states at LAYERS, and
    the last layer's output after the final norm (transformers' last hidden state)."""
    reload, _ = modeling.load_model(modeling.DEFAULT_TARGET)
    with torch.inference_mode():
        out = reload.model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    return torch.cat([out.hidden_states[i][0] for i in LAYERS], -1), out.hidden_states[30][0]


@pytest.mark.parametrize("kind", ["plain", "gguf"])
def test_features_come_with_the_same_logits_bits(models, kind):
    """Features at LAYERS with the logits: the logits are those of a pass without them
    (the GGUF pass runs its layer kernel in pieces then), in one pass and in a prefill
    cut into chunks; features of more positions than logits cost the output head only
    the logits; and a decode's features are one row a step, the position it computed."""
    model = models[0] if kind == "plain" else models[1]
    ids = torch.randint(0, 49152, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    engine = Engine(model, 16 << 20, threads=2, max_batch_tokens=16, prefix_caching=False)
    try:
        plain = engine.new_sequence()
        plain.sync(0, ids)
        want, _ = engine.forward_now(plain, 40)
        featured = engine.new_sequence()
        featured.sync(0, ids)
        got, _, features = engine.submit(featured, 40, layers=LAYERS + (30,)).future.result()
        assert torch.equal(got, want)
        assert features.shape == (40, 4 * 576)
        hf, last = reference(model, ids)
        tol = dict(rtol=1e-4, atol=1e-4) if kind == "plain" else dict(rtol=0.05, atol=0.05)
        torch.testing.assert_close(features[:, :3 * 576], hf, **tol)
        with torch.inference_mode():
            torch.testing.assert_close(model.model.norm(features[:, 3 * 576:]), last, **tol)

        # A prompt's features without its logits: the output head sees only the rows asked
        # for (before, every featured row went through it: 40 rows of 49152 logits here).
        heads = []
        hook = model.lm_head.register_forward_hook(lambda module, inputs, out: heads.append(inputs[0].shape[-2]))
        try:
            few = engine.new_sequence()
            few.sync(0, ids)
            got, _, kept = engine.submit(few, 40, layers=LAYERS + (30,), logits_last=3).future.result()
        finally:
            hook.remove()
        # Against a pass without features that asks the same 3 logits (the head's product over
        # the same 3 rows: torch's fp32 products may round a row otherwise among 40, as MKL
        # does on an AMD CPU); GGUF numerics give them the bits they have among 40 as well.
        alone = engine.new_sequence()
        alone.sync(0, ids)
        want_last, _ = engine.forward_now(alone, 3)
        assert torch.equal(got, want_last) and torch.equal(kept, features)
        assert sum(heads) == 3, heads
        if kind == "gguf":
            assert torch.equal(want_last, want[-3:])
            # Static passes (here eager, invariant ones) compute every row, then pick.
            static = Engine(model, 16 << 20, threads=2, prefix_caching=False, batch_invariant=8)
            try:
                few = static.new_sequence()
                few.sync(0, ids)
                got, _, kept = static.submit(few, 40, layers=LAYERS + (30,), logits_last=3).future.result()
                assert static.runner.static is not None
                assert torch.equal(got, want[-3:]) and torch.equal(kept, features)
            finally:
                static.stop()

        async def decode():
            seq = engine.new_sequence()
            seq.sync(0, ids[:30])
            got = []
            async for token, _, rows in seq.decode(lambda logits: ([int(logits[-1].argmax())], [], len(got) < 3),
                                                   layers=LAYERS, last=10):
                got.append((token, rows))
            return got

        steps = asyncio.run(decode())
        assert [rows.shape[0] for _, rows in steps] == [10, 1, 1, 1]
        # GGUF numerics give a row its bits whatever the pass; torch's fp32 products do not
        exact = dict(rtol=0, atol=0) if kind == "gguf" else dict(rtol=1e-3, atol=1e-3)
        torch.testing.assert_close(steps[0][1], features[20:30, :3 * 576], **exact)
    finally:
        engine.stop()
