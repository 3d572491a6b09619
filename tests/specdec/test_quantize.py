"""int8 weights and per-row int8 activations (`--quantize int8`): a row's result does not
depend on the other rows of a pass, it stays close to float, and the engine, exactness
and concurrency suites hold with every model int8, against the int8 target alone."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdec.runtime import quantize as quantize_module
from specdec.runtime.quantize import Int8Linear, kernel, quantize

TESTS = Path(__file__).parent.parent


PRODUCTS = ["int_mm"] + (["fbgemm"] if kernel() == "fbgemm" else [])


@pytest.mark.parametrize("product", PRODUCTS)
def test_a_row_gives_the_same_result_alone_or_among_others(product):
    torch.manual_seed(0)
    layer = Int8Linear(torch.nn.Linear(96, 200, bias=True), product)
    rows = torch.randn(7, 96) * torch.tensor([0.01, 1, 100, 1, 5, 0.1, 30])[:, None]  # scales far apart
    together = layer(rows[None])[0]
    for i in range(7):
        assert torch.equal(layer(rows[i:i + 1]), together[i:i + 1])


@pytest.mark.parametrize("product", PRODUCTS)
def test_close_to_float(product):
    torch.manual_seed(0)
    linear = torch.nn.Linear(576, 1536, bias=False)
    x = torch.randn(5, 576)
    want = linear(x)
    error = (Int8Linear(linear, product)(x) - want).norm() / want.norm()
    assert error < 0.02, error


def test_the_two_integer_products_agree():
    """fbgemm and torch._int_mm compute the same integer sums; only the order of the two
    float scalings differs (a last-bit difference)."""
    if kernel() != "fbgemm":
        pytest.skip("fbgemm is not exact on this CPU: only torch._int_mm is used")
    torch.manual_seed(0)
    linear = torch.nn.Linear(576, 1536, bias=False)
    x = torch.randn(5, 576) * 3
    a, b = Int8Linear(linear, "fbgemm")(x), Int8Linear(linear, "int_mm")(x)
    assert torch.allclose(a, b, rtol=1e-6, atol=1e-6)


def test_every_linear_layer_and_the_head_are_quantized():
    config = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = quantize(LlamaForCausalLM(config).eval(), "int8")
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert isinstance(model.get_output_embeddings(), Int8Linear)
    assert model.model.embed_tokens.weight.dtype == torch.float32  # the embedding stays as it was
    out = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 7)
    with pytest.raises(ValueError, match="quantize must be one of"):
        quantize(model, "int4")


@pytest.mark.parametrize("bias", [False, True])
def test_layers_that_share_an_input_give_what_they_give_apart(bias, monkeypatch):
    """q, k and v (and gate and up) quantized as one product: the logits are bit for bit
    those of each layer quantized alone, over a prefill and steps with a cache."""
    config = LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attention_bias=bias, mlp_bias=bias)
    torch.manual_seed(0)
    fused = LlamaForCausalLM(config).eval()
    apart = LlamaForCausalLM(config).eval()
    apart.load_state_dict(fused.state_dict())
    quantize(fused, "int8")
    monkeypatch.setattr(quantize_module, "SHARED_INPUT", ())
    quantize(apart, "int8")
    attention = fused.model.layers[0].self_attn
    assert isinstance(attention.shared_q_k_v, quantize_module._Shared)
    assert isinstance(fused.model.layers[1].mlp.shared_gate_up, quantize_module._Shared)
    assert isinstance(apart.model.layers[0].self_attn.k_proj, Int8Linear)
    with torch.no_grad():
        ids = torch.tensor([[5, 17, 3, 99, 42, 8, 8, 1]])
        want = apart.generate(ids, max_new_tokens=12, do_sample=False, output_logits=True, return_dict_in_generate=True)
        got = fused.generate(ids, max_new_tokens=12, do_sample=False, output_logits=True, return_dict_in_generate=True)
    assert torch.equal(got.sequences, want.sequences)
    assert all(torch.equal(a, b) for a, b in zip(got.logits, want.logits))
    assert attention.shared_q_k_v.input is None  # nothing held between passes


def test_suites_with_int8():
    """The engine's and the services' exactness suites again, the services and the
    references under int8; in one run, so that the e2e suites share one start of their
    deployment (tests/e2e/conftest.py's, package-scoped) and the session's models."""
    env = {**os.environ, "SPECDEC_TEST_QUANTIZE": "int8"}
    suites = [str(TESTS / suite) for suite in ("specdec/test_engine.py", "e2e/test_exact.py", "e2e/test_concurrent.py")]
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *suites],
                          env=env, capture_output=True, text=True, timeout=2400)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
