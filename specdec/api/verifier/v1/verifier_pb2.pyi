from specdec.api.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class VerifyRequest(_message.Message):
    __slots__ = ("session_id", "start", "new_tokens", "draft_tokens", "draft_probs", "sampling", "features", "constraint", "constraint_start", "logprobs", "top_logprobs")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_START_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    start: int
    new_tokens: _containers.RepeatedScalarFieldContainer[int]
    draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    draft_probs: _containers.RepeatedCompositeFieldContainer[_common_pb2.SparseDistribution]
    sampling: _common_pb2.SamplingParams
    features: FeatureRequest
    constraint: _common_pb2.Constraint
    constraint_start: int
    logprobs: bool
    top_logprobs: int
    def __init__(self, session_id: _Optional[str] = ..., start: _Optional[int] = ..., new_tokens: _Optional[_Iterable[int]] = ..., draft_tokens: _Optional[_Iterable[int]] = ..., draft_probs: _Optional[_Iterable[_Union[_common_pb2.SparseDistribution, _Mapping]]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., features: _Optional[_Union[FeatureRequest, _Mapping]] = ..., constraint: _Optional[_Union[_common_pb2.Constraint, _Mapping]] = ..., constraint_start: _Optional[int] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ...) -> None: ...

class FeatureRequest(_message.Message):
    __slots__ = ("layers", "first_position")
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    FIRST_POSITION_FIELD_NUMBER: _ClassVar[int]
    layers: _containers.RepeatedScalarFieldContainer[int]
    first_position: int
    def __init__(self, layers: _Optional[_Iterable[int]] = ..., first_position: _Optional[int] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("num_accepted", "next_token", "batch_pass", "features", "logprobs")
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    BATCH_PASS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    num_accepted: int
    next_token: int
    batch_pass: BatchPass
    features: _common_pb2.Features
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    def __init__(self, num_accepted: _Optional[int] = ..., next_token: _Optional[int] = ..., batch_pass: _Optional[_Union[BatchPass, _Mapping]] = ..., features: _Optional[_Union[_common_pb2.Features, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("session_id", "token_ids", "top_logprobs")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: int
    def __init__(self, session_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[int] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("logprobs", "batch_pass")
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    BATCH_PASS_FIELD_NUMBER: _ClassVar[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    batch_pass: BatchPass
    def __init__(self, logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., batch_pass: _Optional[_Union[BatchPass, _Mapping]] = ...) -> None: ...

class BatchPass(_message.Message):
    __slots__ = ("rows", "tokens", "seconds", "free_kv_blocks", "waiting_sessions")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    FREE_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    WAITING_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    rows: int
    tokens: int
    seconds: float
    free_kv_blocks: int
    waiting_sessions: int
    def __init__(self, rows: _Optional[int] = ..., tokens: _Optional[int] = ..., seconds: _Optional[float] = ..., free_kv_blocks: _Optional[int] = ..., waiting_sessions: _Optional[int] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("session_id", "start", "new_tokens", "sampling", "max_tokens", "stop_token_ids", "features", "constraint", "constraint_start", "draft_forced", "logprobs", "top_logprobs", "draft_lookup", "offer")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_START_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FORCED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_LOOKUP_FIELD_NUMBER: _ClassVar[int]
    OFFER_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    start: int
    new_tokens: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    max_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    features: FeatureRequest
    constraint: _common_pb2.Constraint
    constraint_start: int
    draft_forced: bool
    logprobs: bool
    top_logprobs: int
    draft_lookup: LookupRule
    offer: DraftOffer
    def __init__(self, session_id: _Optional[str] = ..., start: _Optional[int] = ..., new_tokens: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., max_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., features: _Optional[_Union[FeatureRequest, _Mapping]] = ..., constraint: _Optional[_Union[_common_pb2.Constraint, _Mapping]] = ..., constraint_start: _Optional[int] = ..., draft_forced: _Optional[bool] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., draft_lookup: _Optional[_Union[LookupRule, _Mapping]] = ..., offer: _Optional[_Union[DraftOffer, _Mapping]] = ...) -> None: ...

class DraftOffer(_message.Message):
    __slots__ = ("position", "tokens", "probs")
    POSITION_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    position: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedCompositeFieldContainer[_common_pb2.SparseDistribution]
    def __init__(self, position: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[_Union[_common_pb2.SparseDistribution, _Mapping]]] = ...) -> None: ...

class LookupRule(_message.Message):
    __slots__ = ("min_match", "max_match", "max_drafts")
    MIN_MATCH_FIELD_NUMBER: _ClassVar[int]
    MAX_MATCH_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    min_match: int
    max_match: int
    max_drafts: int
    def __init__(self, min_match: _Optional[int] = ..., max_match: _Optional[int] = ..., max_drafts: _Optional[int] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("token_id", "batch_pass", "features", "drafted", "drafts_rejected", "logprobs", "lookup_drafts", "offered_drafts")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    BATCH_PASS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_REJECTED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    OFFERED_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    batch_pass: BatchPass
    features: _common_pb2.Features
    drafted: bool
    drafts_rejected: int
    logprobs: _common_pb2.TokenLogprobs
    lookup_drafts: bool
    offered_drafts: bool
    def __init__(self, token_id: _Optional[int] = ..., batch_pass: _Optional[_Union[BatchPass, _Mapping]] = ..., features: _Optional[_Union[_common_pb2.Features, _Mapping]] = ..., drafted: _Optional[bool] = ..., drafts_rejected: _Optional[int] = ..., logprobs: _Optional[_Union[_common_pb2.TokenLogprobs, _Mapping]] = ..., lookup_drafts: _Optional[bool] = ..., offered_drafts: _Optional[bool] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ("closed",)
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    closed: bool
    def __init__(self, closed: _Optional[bool] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetModelInfoResponse(_message.Message):
    __slots__ = ("info",)
    INFO_FIELD_NUMBER: _ClassVar[int]
    info: _common_pb2.ModelInfo
    def __init__(self, info: _Optional[_Union[_common_pb2.ModelInfo, _Mapping]] = ...) -> None: ...

class ListSessionsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListSessionsResponse(_message.Message):
    __slots__ = ("sessions",)
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[_common_pb2.SessionInfo]
    def __init__(self, sessions: _Optional[_Iterable[_Union[_common_pb2.SessionInfo, _Mapping]]] = ...) -> None: ...
