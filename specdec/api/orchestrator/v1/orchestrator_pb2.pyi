from specdec.api.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_CONSTRAINT: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_CONSTRAINT: FinishReason

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class Chat(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "chat", "token_ids", "max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop", "num_speculative_tokens", "constraint", "logprobs", "top_logprobs", "frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias", "n", "prompt_logprobs")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    chat: Chat
    token_ids: TokenIds
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    num_speculative_tokens: int
    constraint: _common_pb2.Constraint
    logprobs: bool
    top_logprobs: int
    frequency_penalty: float
    presence_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    n: int
    prompt_logprobs: bool
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., chat: _Optional[_Union[Chat, _Mapping]] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., max_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., num_speculative_tokens: _Optional[int] = ..., constraint: _Optional[_Union[_common_pb2.Constraint, _Mapping]] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., n: _Optional[int] = ..., prompt_logprobs: _Optional[bool] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("token_ids", "text", "logprobs", "index")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    index: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., index: _Optional[int] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ...) -> None: ...

class SpeculationStats(_message.Message):
    __slots__ = ("rounds", "draft_tokens", "accepted_tokens", "acceptance_rate", "resyncs", "drafter_failovers", "accepted_per_position", "lookaheads", "lookahead_hits", "draft_seconds", "verify_seconds", "mean_batch_rows", "verifier_moves", "feature_bytes_received", "feature_bytes_sent", "run_offers", "offered_accepted")
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    RESYNCS_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FAILOVERS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    LOOKAHEADS_FIELD_NUMBER: _ClassVar[int]
    LOOKAHEAD_HITS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MEAN_BATCH_ROWS_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_MOVES_FIELD_NUMBER: _ClassVar[int]
    FEATURE_BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    FEATURE_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    RUN_OFFERS_FIELD_NUMBER: _ClassVar[int]
    OFFERED_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    rounds: int
    draft_tokens: int
    accepted_tokens: int
    acceptance_rate: float
    resyncs: int
    drafter_failovers: int
    accepted_per_position: _containers.RepeatedScalarFieldContainer[int]
    lookaheads: int
    lookahead_hits: int
    draft_seconds: float
    verify_seconds: float
    mean_batch_rows: float
    verifier_moves: int
    feature_bytes_received: int
    feature_bytes_sent: int
    run_offers: int
    offered_accepted: int
    def __init__(self, rounds: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., acceptance_rate: _Optional[float] = ..., resyncs: _Optional[int] = ..., drafter_failovers: _Optional[int] = ..., accepted_per_position: _Optional[_Iterable[int]] = ..., lookaheads: _Optional[int] = ..., lookahead_hits: _Optional[int] = ..., draft_seconds: _Optional[float] = ..., verify_seconds: _Optional[float] = ..., mean_batch_rows: _Optional[float] = ..., verifier_moves: _Optional[int] = ..., feature_bytes_received: _Optional[int] = ..., feature_bytes_sent: _Optional[int] = ..., run_offers: _Optional[int] = ..., offered_accepted: _Optional[int] = ...) -> None: ...

class Result(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "finish_reason", "stop_sequence", "usage", "stats", "index", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: FinishReason
    stop_sequence: str
    usage: Usage
    stats: SpeculationStats
    index: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., stop_sequence: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., stats: _Optional[_Union[SpeculationStats, _Mapping]] = ..., index: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("chunk", "result")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    chunk: Chunk
    result: Result
    def __init__(self, chunk: _Optional[_Union[Chunk, _Mapping]] = ..., result: _Optional[_Union[Result, _Mapping]] = ...) -> None: ...

class ScaleDraftersRequest(_message.Message):
    __slots__ = ("replicas",)
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    replicas: int
    def __init__(self, replicas: _Optional[int] = ...) -> None: ...

class ScaleDraftersResponse(_message.Message):
    __slots__ = ("replicas", "pending", "detail", "starting")
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    STARTING_FIELD_NUMBER: _ClassVar[int]
    replicas: int
    pending: int
    detail: str
    starting: int
    def __init__(self, replicas: _Optional[int] = ..., pending: _Optional[int] = ..., detail: _Optional[str] = ..., starting: _Optional[int] = ...) -> None: ...

class ListDraftersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrafterReplica(_message.Message):
    __slots__ = ("address", "sessions", "healthy")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    address: str
    sessions: int
    healthy: bool
    def __init__(self, address: _Optional[str] = ..., sessions: _Optional[int] = ..., healthy: _Optional[bool] = ...) -> None: ...

class ListDraftersResponse(_message.Message):
    __slots__ = ("replicas", "source", "last_scaling_decision", "starting", "pending")
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    LAST_SCALING_DECISION_FIELD_NUMBER: _ClassVar[int]
    STARTING_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    replicas: _containers.RepeatedCompositeFieldContainer[DrafterReplica]
    source: str
    last_scaling_decision: str
    starting: int
    pending: int
    def __init__(self, replicas: _Optional[_Iterable[_Union[DrafterReplica, _Mapping]]] = ..., source: _Optional[str] = ..., last_scaling_decision: _Optional[str] = ..., starting: _Optional[int] = ..., pending: _Optional[int] = ...) -> None: ...

class ListRequestsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RequestInFlight(_message.Message):
    __slots__ = ("request_id", "session_id", "drafter", "generated_tokens", "verifier", "elapsed_seconds")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    session_id: str
    drafter: str
    generated_tokens: int
    verifier: str
    elapsed_seconds: float
    def __init__(self, request_id: _Optional[str] = ..., session_id: _Optional[str] = ..., drafter: _Optional[str] = ..., generated_tokens: _Optional[int] = ..., verifier: _Optional[str] = ..., elapsed_seconds: _Optional[float] = ...) -> None: ...

class ListRequestsResponse(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[RequestInFlight]
    def __init__(self, requests: _Optional[_Iterable[_Union[RequestInFlight, _Mapping]]] = ...) -> None: ...

class ScaleVerifiersRequest(_message.Message):
    __slots__ = ("replicas",)
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    replicas: int
    def __init__(self, replicas: _Optional[int] = ...) -> None: ...

class ListVerifiersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class VerifierReplica(_message.Message):
    __slots__ = ("address", "sessions", "healthy", "free_kv_blocks", "waiting_sessions", "pass_seconds", "routed_by_prefix", "routed_by_load", "moved_away", "in_set")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    FREE_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    WAITING_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    PASS_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ROUTED_BY_PREFIX_FIELD_NUMBER: _ClassVar[int]
    ROUTED_BY_LOAD_FIELD_NUMBER: _ClassVar[int]
    MOVED_AWAY_FIELD_NUMBER: _ClassVar[int]
    IN_SET_FIELD_NUMBER: _ClassVar[int]
    address: str
    sessions: int
    healthy: bool
    free_kv_blocks: int
    waiting_sessions: int
    pass_seconds: float
    routed_by_prefix: int
    routed_by_load: int
    moved_away: int
    in_set: bool
    def __init__(self, address: _Optional[str] = ..., sessions: _Optional[int] = ..., healthy: _Optional[bool] = ..., free_kv_blocks: _Optional[int] = ..., waiting_sessions: _Optional[int] = ..., pass_seconds: _Optional[float] = ..., routed_by_prefix: _Optional[int] = ..., routed_by_load: _Optional[int] = ..., moved_away: _Optional[int] = ..., in_set: _Optional[bool] = ...) -> None: ...

class ListVerifiersResponse(_message.Message):
    __slots__ = ("replicas", "source", "last_scaling_decision")
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    LAST_SCALING_DECISION_FIELD_NUMBER: _ClassVar[int]
    replicas: _containers.RepeatedCompositeFieldContainer[VerifierReplica]
    source: str
    last_scaling_decision: str
    def __init__(self, replicas: _Optional[_Iterable[_Union[VerifierReplica, _Mapping]]] = ..., source: _Optional[str] = ..., last_scaling_decision: _Optional[str] = ...) -> None: ...
