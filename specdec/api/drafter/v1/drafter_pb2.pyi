from specdec.api.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProposeRequest(_message.Message):
    __slots__ = ("session_id", "start", "new_tokens", "num_draft_tokens", "sampling", "features", "draw_position")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    DRAW_POSITION_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    start: int
    new_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_draft_tokens: int
    sampling: _common_pb2.SamplingParams
    features: _common_pb2.Features
    draw_position: int
    def __init__(self, session_id: _Optional[str] = ..., start: _Optional[int] = ..., new_tokens: _Optional[_Iterable[int]] = ..., num_draft_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., features: _Optional[_Union[_common_pb2.Features, _Mapping]] = ..., draw_position: _Optional[int] = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("token_ids", "qs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    QS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    qs: _containers.RepeatedCompositeFieldContainer[_common_pb2.SparseDistribution]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., qs: _Optional[_Iterable[_Union[_common_pb2.SparseDistribution, _Mapping]]] = ...) -> None: ...

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
