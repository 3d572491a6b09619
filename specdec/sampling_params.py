"""What a request's sampling parameters may be, and what they say: the checks every
service makes of them, whether they are greedy, where a generation stops. No model
runtime here: the orchestrator checks requests with these too (specdec.sampling holds
the distributions)."""

import math

from specdec.api.common.v1 import common_pb2
from specdec.errors import InvalidArgument


def is_greedy(params: common_pb2.SamplingParams) -> bool:
    return params.temperature == 0.0


# Near 0, logits / temperature overflows float32 (inf, then NaN probabilities); well
# before that, sampling is greedy in all but name.
MIN_TEMPERATURE = 0.01


def until_stop(tokens: list[int], stop: set[int]) -> list[int]:
    """tokens up to and including the first stop token (an end of sequence): what a
    generation keeps of tokens committed together."""
    for i, token in enumerate(tokens):
        if token in stop:
            return tokens[:i + 1]
    return tokens


def check_temperature(field: str, t: float) -> None:
    if not math.isfinite(t) or not (t == 0 or t >= MIN_TEMPERATURE):
        raise InvalidArgument(field, f"must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE}, got {t}")


def validate(params: common_pb2.SamplingParams, field: str = "sampling", vocab_size: int = 0) -> None:
    p = params.top_p
    check_temperature(f"{field}.temperature", params.temperature)
    if math.isnan(p) or not 0.0 < p <= 1.0:
        raise InvalidArgument(f"{field}.top_p", f"must be in (0, 1], got {p}")
    if params.top_k < 0:
        raise InvalidArgument(f"{field}.top_k", f"must be >= 0, got {params.top_k}")
    check_penalties(params, f"{field}.", vocab_size)
    if params.output_start < 0:
        raise InvalidArgument(f"{field}.output_start", f"must be >= 0, got {params.output_start}")


# OpenAI's bounds (vLLM's too); a bias of +-100 already bans or forces a token.
MAX_PENALTY = 2.0
MAX_BIAS = 100.0
MAX_BIASED_TOKENS = 1024
MAX_SAMPLES = 16  # independent samples of one request (GenerateRequest.n, OpenAI's n)


def check_penalties(params: common_pb2.SamplingParams, prefix: str = "", vocab_size: int = 0) -> None:
    """INVALID_ARGUMENT naming the field (`prefix` + its name) unless the penalties and
    biases are in range; token ids are checked against `vocab_size` where it is known."""
    for name in ("frequency_penalty", "presence_penalty"):
        value = getattr(params, name)
        if not -MAX_PENALTY <= value <= MAX_PENALTY:  # NaN fails too
            raise InvalidArgument(prefix + name, f"must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value}")
    r = params.repetition_penalty
    if not (r == 0 or 0 < r <= 100):
        raise InvalidArgument(prefix + "repetition_penalty", f"must be in (0, 100] (1 or 0: none), got {r}")
    bias = params.logit_bias
    if len(bias) > MAX_BIASED_TOKENS:
        raise InvalidArgument(prefix + "logit_bias", f"at most {MAX_BIASED_TOKENS} tokens, got {len(bias)}")
    for token, value in bias.items():
        if token < 0 or (vocab_size and token >= vocab_size):
            raise InvalidArgument(prefix + "logit_bias", f"token {token} is not in the vocabulary [0, {vocab_size})")
        if not -MAX_BIAS <= value <= MAX_BIAS:
            raise InvalidArgument(prefix + "logit_bias", f"token {token}: the bias must be in [-{MAX_BIAS:g}, "
                                                         f"{MAX_BIAS:g}], got {value}")


def penalized(params: common_pb2.SamplingParams) -> bool:
    return bool(params.logit_bias) or params.repetition_penalty not in (0.0, 1.0) \
        or params.frequency_penalty != 0 or params.presence_penalty != 0
