"""Sampling processing equals transformers' own warpers (temperature, top-k, top-p); the
penalties and biases equal their definitions, a verify pass's rows equal the steps of
the target alone."""

import math

import pytest
import torch
from transformers.generation.logits_process import (RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                                                    TopKLogitsWarper, TopPLogitsWarper)

from specdec import sampling, sampling_params
from specdec.api.common.v1 import common_pb2
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
    ("sampling.frequency_penalty", dict(top_p=1.0, frequency_penalty=2.5)),
    ("sampling.presence_penalty", dict(top_p=1.0, presence_penalty=math.nan)),
    ("sampling.repetition_penalty", dict(top_p=1.0, repetition_penalty=-1.0)),
    ("sampling.logit_bias", dict(top_p=1.0, logit_bias={3: 101.0})),
    ("sampling.logit_bias", dict(top_p=1.0, logit_bias={50: 1.0})),  # beyond the vocabulary of 50
    ("sampling.logit_bias", dict(top_p=1.0, logit_bias={-1: 1.0})),
    ("sampling.output_start", dict(top_p=1.0, output_start=-1)),
])
def test_validate_names_the_field(field, kwargs):
    with pytest.raises(InvalidArgument) as err:
        sampling_params.validate(common_pb2.SamplingParams(**kwargs), vocab_size=50)
    assert err.value.field == field


def penalized_step(logits: torch.Tensor, history: list[int], output_start: int, bias: dict, repetition: float,
                   frequency: float, presence: float) -> torch.Tensor:
    """One position's logits [vocab] after the penalties, from their definitions: the bias,
    transformers' repetition penalty over the whole history, OpenAI's over the output."""
    logits = logits.clone()
    for token, value in bias.items():
        logits[token] += value
    logits = RepetitionPenaltyLogitsProcessor(repetition)(torch.tensor([history]), logits[None])[0]
    for token in set(history[output_start:]):
        count = history[output_start:].count(token)
        logits[token] -= frequency * count + presence
    return logits


@pytest.mark.parametrize("bias,repetition,frequency,presence", [
    ({}, 1.3, 0.0, 0.0), ({}, 1.0, 0.7, 0.0), ({}, 1.0, 0.0, -1.5), ({7: 5.0, 11: -100.0}, 1.0, 0.0, 0.0),
    ({7: 2.0}, 0.8, 0.4, 1.1),
])
def test_a_passs_rows_are_the_steps_of_the_target_alone(bias, repetition, frequency, presence):
    """Row i of a pass over drafts counts the history and drafts[:i]: each equals the one
    step the target alone takes there, with the penalties as defined."""
    torch.manual_seed(1)
    history, drafts, output_start = [3, 7, 7, 20, 5, 11, 7], [5, 5, 30, 7], 3
    logits = torch.randn(len(drafts) + 1, 50) * 4
    params = common_pb2.SamplingParams(temperature=1.0, top_p=1.0, logit_bias=bias, repetition_penalty=repetition,
                                       frequency_penalty=frequency, presence_penalty=presence,
                                       output_start=output_start)
    got = sampling.penalize(logits, params, history + drafts, len(history))
    for i in range(len(drafts) + 1):
        want = penalized_step(logits[i], history + drafts[:i], output_start, bias, repetition, frequency, presence)
        torch.testing.assert_close(got[i], want, rtol=0, atol=1e-6)
    assert not torch.equal(got, logits)


def test_penalties_read_a_cut_head_at_its_token_ids():
    """A draft model whose head holds some tokens only (logits indexed by `columns`): the
    same values as the full vocabulary's, at those tokens."""
    torch.manual_seed(2)
    full = torch.randn(3, 64) * 3
    columns = torch.tensor([0, 5, 7, 9, 40, 63])
    params = common_pb2.SamplingParams(temperature=0.0, top_p=1.0, logit_bias={7: 3.0, 12: -9.0},
                                       repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.25)
    history, drafts = [5, 9, 12, 63, 5], [7, 40]
    want = sampling.penalize(full, params, history + drafts, len(history))[:, columns]
    got = sampling.penalize(full[:, columns], params, history + drafts, len(history), columns)
    torch.testing.assert_close(got, want)
    # A request's first draft: no output yet, nothing to count.
    first = common_pb2.SamplingParams(temperature=0.0, top_p=1.0, frequency_penalty=0.5, output_start=5)
    assert torch.equal(sampling.penalize(full[:1, columns], first, history, None, columns), full[:1, columns])


def test_no_penalty_leaves_the_logits_as_they_are():
    logits = torch.randn(2, 10)
    for params in (common_pb2.SamplingParams(top_p=1.0), common_pb2.SamplingParams(top_p=1.0, repetition_penalty=1.0)):
        assert sampling.penalize(logits, params, [1, 2, 3], 2) is logits


def test_the_greedy_token_is_torchs_argmax_in_every_dtype():
    """sampling.argmax (numpy on a CPU) picks what torch's argmax picks, the first of
    equal logits included, for a pass's rows and for one row."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(9, 49152, generator=g)
    logits[1, 7] = logits[1, 4000] = logits[1].max() + 1  # a tie: the first wins
    logits[2] = 0.0  # all equal
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        x = logits.to(dtype)
        assert sampling.argmax(x) == x.argmax(dim=-1).tolist(), dtype
        assert sampling.argmax(x[3]) == [int(x[3].argmax())]
    assert sampling.argmax(logits)[1:3] == [7, 0]
