"""`specdec bench fidelity`'s simulated activation rounding."""

import pytest
import torch

from deploy.bench.fidelity import round_activations


def test_a_linear_layer_sees_its_input_rounded_per_block():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 5))
    weight, bias = model[0].weight.detach().clone(), model[0].bias.detach().clone()
    x = torch.randn(3, 64) * torch.logspace(-2, 1, 64)  # blocks of very different magnitudes
    exact = x.double() @ weight.double().T + bias.double()
    round_activations(model, 8, 32)
    got = model(x)
    blocks = x.double().reshape(3, 2, 32)
    scale = (blocks.abs().amax(-1, keepdim=True) / 127).float().double()
    want = (torch.round(blocks / scale) * scale).reshape(3, 64) @ weight.double().T + bias.double()
    assert torch.allclose(got.double(), want, rtol=0, atol=1e-6)
    assert not torch.allclose(got.double(), exact, rtol=0, atol=1e-4)  # 8 bits lose something
    fine = torch.nn.Sequential(torch.nn.Linear(64, 5))
    fine[0].load_state_dict({"weight": weight, "bias": bias})
    round_activations(fine, 16, 32)
    assert (fine(x).double() - exact).abs().max() < (got.double() - exact).abs().max() / 50


def test_columns_that_are_not_whole_blocks_are_refused():
    with pytest.raises(SystemExit, match="not blocks of 32"):
        round_activations(torch.nn.Sequential(torch.nn.Linear(48, 2)), 8, 32)
