"""The CUDA path: the sampling rule on device tensors, and the engine, exactness and
sampling suites run again with every model (services and references) on the GPU.
Skipped where torch sees no CUDA device; never part of what CI needs."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specdec.sampling import Draws

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]

TESTS = Path(__file__).parent.parent
SUITES = ["specdec/test_engine.py", "e2e/test_exact.py", "e2e/test_sampling.py", "e2e/test_concurrent.py",
          "e2e/test_batch_invariant.py"]


def test_draws_take_device_probabilities():
    """A draw from probabilities on the GPU is the draw from their host copy (the
    generators are host generators keyed by position)."""
    torch.manual_seed(0)
    p = torch.softmax(torch.randn(50, device="cuda"), dim=-1)
    assert [Draws(5, "target").sample(p, i) for i in range(20)] == [Draws(5, "target").sample(p.cpu(), i)
                                                                    for i in range(20)]


def test_penalties_on_the_device_are_the_hosts():
    """A pass's logits on the GPU get the same penalties, to the bit, as their host copy."""
    from specdec import sampling
    from specdec.api.common.v1 import common_pb2

    torch.manual_seed(0)
    logits = torch.randn(4, 300, device="cuda") * 3
    params = common_pb2.SamplingParams(temperature=1.0, top_p=1.0, logit_bias={7: 2.0}, repetition_penalty=1.2,
                                       frequency_penalty=0.5, presence_penalty=0.3, output_start=3)
    got = sampling.penalize(logits, params, [5, 7, 9, 5, 11, 7, 11, 40, 11], 6)
    assert got.device.type == "cuda"
    assert torch.equal(got.cpu(), sampling.penalize(logits.cpu(), params, [5, 7, 9, 5, 11, 7, 11, 40, 11], 6))


@pytest.mark.parametrize("suite", SUITES)
def test_suite_on_cuda(suite):
    env = {**os.environ, "SPECDEC_TEST_DEVICE": "cuda"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", str(TESTS / suite)],
                          env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
