"""Input checks both services make on the session fields of a call."""

from specdec.api.common.v1 import common_pb2
from specdec.errors import InvalidArgument

MAX_DRAFT_TOKENS = 64  # drafts one call may carry or ask for (Propose, Verify, a run's lookup)
MAX_TOP_LOGPROBS = 20  # most likely tokens a position's log-probabilities list (OpenAI's bound)


def check_token_ids(field: str, ids, vocab_size: int) -> None:
    """Every id in [0, vocab_size); vocab_size 0 means any non-negative id."""
    for i, token in enumerate(ids):
        if token < 0 or (vocab_size and token >= vocab_size):
            raise InvalidArgument(f"{field}[{i}]", f"token id {token} is outside the vocabulary [0, {vocab_size})")


def check_length(field: str, length: int, info: common_pb2.ModelInfo) -> None:
    if length > info.max_positions:
        raise InvalidArgument(field, f"the session would hold {length} tokens, the model's limit is {info.max_positions}")
