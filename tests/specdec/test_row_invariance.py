"""Row invariance by construction: every operation of a pass gives a row the same bits
whatever the pass's size, the row's place in it and the number of threads, so a prompt's
keys, values and logits are the same in one pass, in chunks of any size, and in one-token
steps. Thread counts go above this machine's cores on purpose: what changes a row's bits
is how an operation splits its elements between threads, not how many cores run them.

(The default target at 8 threads, before: an 86-token prompt in one pass and in chunks of
40 left keys apart from position 17 on, and last logits 1.5e-3 apart; torch's silu split
its T x 1536 values between threads mid-row.)"""

import contextlib
import functools
import math

import pytest
import torch

from passes import prefill
from specdec.runtime import ggml, kernels, modeling, quantize
from specdec.runtime.engine import Engine
from specdec.runtime.engine.model_runner import rotary

THREADS = (1, 2, 3, 5, 8, 16)
PROMPT = 320  # tokens; a prompt of n tokens is the first n of it (the model is causal)


@contextlib.contextmanager
def threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    kernels.take_threads()
    try:
        yield
    finally:
        torch.set_num_threads(before)
        kernels.take_threads()


def rows_alone_and_together(op, x: torch.Tensor, sizes) -> None:
    """op over the first T rows of x, for each T, against op over each row alone."""
    with threads(1):
        alone = torch.cat([op(x[t:t + 1]) for t in range(len(x))])
    for n in THREADS:
        with threads(n):
            for size in sizes:
                together = op(x[:size])
                assert torch.equal(together, alone[:size]), (n, size)


@pytest.fixture(scope="module")
def target():
    model, _ = modeling.load_model(modeling.DEFAULT_TARGET)
    return quantize.quantize(model, "gguf")


def gelu_tanh_float64(x: torch.Tensor) -> torch.Tensor:
    """0.5 x (1 + tanh(u)) as x sigmoid(2u), in float64: without 1 + tanh(u)'s cancellation
    for x well below 0."""
    x = x.double()
    return (x * torch.sigmoid(2 * math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3))).float()


@pytest.mark.parametrize("ours, exact, theirs", [
    (ggml.SiLU, lambda x: torch.nn.functional.silu(x.double()).float(), torch.nn.functional.silu),
    (ggml.GELUTanh, gelu_tanh_float64, functools.partial(torch.nn.functional.gelu, approximate="tanh"))],
    ids=["silu", "gelu_tanh"])
def test_activation_rows_are_the_same_bits_alone_or_in_any_pass(ours, exact, theirs):
    torch.manual_seed(0)
    x = torch.randn(320, 1536) * 4
    x[0, :10] = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 80.0, -80.0, 800.0, -800.0, 3e38, -3e38])
    op = ours()
    rows_alone_and_together(op, x, range(1, 321))
    # It is the activation: float64's, rounded once; and torch's own within its float32
    # steps' rounding (its gelu_tanh's 1 + tanh(u) is 0 well below 0, where ours is not).
    torch.testing.assert_close(op(x), exact(x), rtol=2e-7, atol=1e-30)
    torch.testing.assert_close(op(x), theirs(x), rtol=2e-6, atol=1e-6)
    assert torch.isnan(op(torch.tensor([float("nan")]))).all()


def test_the_default_targets_operations_give_a_row_the_same_bits_in_any_pass(target):
    """Each operation of the default target's pass on its own: the norm, a GGUF product
    (every tile size the kernel cuts a pass into, and the sizes that split mid-row
    before), the embedding, and the rotary table against the model's own rotary
    embedding of one position."""
    torch.manual_seed(1)
    layer = target.model.layers[0]
    x = torch.randn(320, target.config.hidden_size)
    rows_alone_and_together(layer.input_layernorm, x, range(1, 321))
    sizes = [*range(1, 18), 31, 86, 137, 320]
    rows_alone_and_together(layer.self_attn.shared_q_k_v.linear, x, sizes)
    rows_alone_and_together(layer.mlp.down_proj, torch.randn(320, layer.mlp.down_proj.in_features), sizes)
    rows_alone_and_together(target.lm_head, x, [1, 2, 5, 17, 86])
    ids = torch.randint(0, target.config.vocab_size, (320,))
    rows_alone_and_together(target.model.embed_tokens, ids, [1, 7, 320])

    positions = torch.arange(PROMPT)[None]
    like = torch.empty(0)
    for n in THREADS:
        with threads(n):
            cos, sin = rotary(target, positions.flip(-1), PROMPT)  # a pass's positions in any order
            for p in range(0, PROMPT, 7):
                one_cos, one_sin = target.model.rotary_emb(like, torch.tensor([[p]]))
                assert torch.equal(cos[0, PROMPT - 1 - p], one_cos[0, 0]) and torch.equal(sin[0, PROMPT - 1 - p],
                                                                                          one_sin[0, 0])


@pytest.fixture(scope="module")
def one_token_steps(target):
    """A random 320-token prompt and what one-token steps at one thread leave."""
    ids = torch.randint(0, target.config.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(2)).tolist()
    return ids, prefill(target, ids, 1, 1)


def check_prefill(target, one_token_steps, chunk: int, n_threads: int, length: int = PROMPT) -> None:
    ids, want = one_token_steps
    got = prefill(target, ids[:length], chunk, n_threads)
    for name, ours, steps in zip(("logits", "keys", "values"), got, want):
        steps = steps[:length] if name == "logits" else steps[:, :length]
        assert torch.equal(ours, steps), f"{name} at {n_threads} threads in passes of {chunk}: " \
                                         f"{(ours - steps).abs().max().item():.3g} apart"


@pytest.mark.parametrize("n_threads", THREADS)
def test_a_prompts_keys_values_and_logits_do_not_depend_on_its_chunks_or_threads(target, one_token_steps, n_threads):
    """The default target through the engine: a 320-token prompt in one pass and in
    chunks (86 and 137 are sizes that split mid-row at 5 and more threads before; 31 and 7
    odd ones), and a shorter prompt in one pass, against one-token steps: every
    position's logits, keys and values bit-identical."""
    for chunk in (320, 137, 86, 31, 7):
        check_prefill(target, one_token_steps, chunk, n_threads)
    check_prefill(target, one_token_steps, 256, n_threads, length=86)


@pytest.mark.slow
@pytest.mark.parametrize("n_threads", THREADS)
def test_every_pass_size_from_1_to_320(target, one_token_steps, n_threads):
    for chunk in range(1, PROMPT + 1):
        check_prefill(target, one_token_steps, chunk, n_threads)


def test_a_prefix_cache_hit_serves_what_one_token_steps_computed(target, one_token_steps):
    """Blocks a session computed in chunks of 137 at 8 threads, taken by a later session
    with the same first 300 tokens: its last 12 logits as one-token steps give them."""
    ids, (logits, _, _) = one_token_steps
    engine = Engine(target, 64 << 20, threads=8, max_batch_tokens=137, prefix_caching=True)
    try:
        first = engine.new_sequence()
        first.sync(0, ids)
        engine.forward_now(first, 1)
        second = engine.new_sequence()
        second.sync(0, ids[:300])
        got, done = engine.forward_now(second, 12)
        assert engine.blocks.reused_tokens >= 288  # 18 whole blocks of 16 came from the cache
        assert torch.equal(got, logits[288:300])
    finally:
        engine.stop()
