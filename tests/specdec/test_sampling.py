"""Sampling processing equals transformers' own warpers (temperature, top-k, top-p)."""

import math

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from specdec import sampling
from specdec.common.v1 import common_pb2
from specdec.errors import InvalidArgument


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.9, 10, 0.5)])
def test_probs_match_transformers(temperature, top_k, top_p):
    torch.manual_seed(0)
    logits = torch.randn(3, 50) * 3
    params = common_pb2.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    want = TemperatureLogitsWarper(temperature)(None, logits)
    if top_k:
        want = TopKLogitsWarper(top_k)(None, want)
    if top_p < 1:
        want = TopPLogitsWarper(top_p)(None, want)
    torch.testing.assert_close(sampling.probs(logits, params), want.softmax(-1))


@pytest.mark.parametrize("field,kwargs", [
    ("sampling.temperature", dict(temperature=-1.0, top_p=1.0)),
    ("sampling.temperature", dict(temperature=math.nan, top_p=1.0)),
    ("sampling.top_p", dict(top_p=0.0)),
    ("sampling.top_p", dict(top_p=1.5)),
    ("sampling.top_k", dict(top_k=-2, top_p=1.0)),
])
def test_validate_names_the_field(field, kwargs):
    with pytest.raises(InvalidArgument) as err:
        sampling.validate(common_pb2.SamplingParams(**kwargs))
    assert err.value.field == field
