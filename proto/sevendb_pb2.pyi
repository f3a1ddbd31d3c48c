from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EmitSeq(_message.Message):
    __slots__ = ("epoch_id", "commit_index")
    class EpochId(_message.Message):
        __slots__ = ("bucket_uuid", "epoch_counter")
        BUCKET_UUID_FIELD_NUMBER: _ClassVar[int]
        EPOCH_COUNTER_FIELD_NUMBER: _ClassVar[int]
        bucket_uuid: str
        epoch_counter: int
        def __init__(self, bucket_uuid: _Optional[str] = ..., epoch_counter: _Optional[int] = ...) -> None: ...
    EPOCH_ID_FIELD_NUMBER: _ClassVar[int]
    COMMIT_INDEX_FIELD_NUMBER: _ClassVar[int]
    epoch_id: EmitSeq.EpochId
    commit_index: int
    def __init__(self, epoch_id: _Optional[_Union[EmitSeq.EpochId, _Mapping]] = ..., commit_index: _Optional[int] = ...) -> None: ...

class Query(_message.Message):
    __slots__ = ("kind", "arg")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KEY: _ClassVar[Query.Kind]
        PREFIX: _ClassVar[Query.Kind]
        ALL: _ClassVar[Query.Kind]
    KEY: Query.Kind
    PREFIX: Query.Kind
    ALL: Query.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    ARG_FIELD_NUMBER: _ClassVar[int]
    kind: Query.Kind
    arg: str
    def __init__(self, kind: _Optional[_Union[Query.Kind, str]] = ..., arg: _Optional[str] = ...) -> None: ...

class SubscribeRequest(_message.Message):
    __slots__ = ("bucket", "query", "sub_id", "durable", "start", "packed_changes", "isolation", "group")
    class Isolation(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        READ_COMMITTED: _ClassVar[SubscribeRequest.Isolation]
        READ_UNCOMMITTED: _ClassVar[SubscribeRequest.Isolation]
    READ_COMMITTED: SubscribeRequest.Isolation
    READ_UNCOMMITTED: SubscribeRequest.Isolation
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    QUERY_FIELD_NUMBER: _ClassVar[int]
    SUB_ID_FIELD_NUMBER: _ClassVar[int]
    DURABLE_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    PACKED_CHANGES_FIELD_NUMBER: _ClassVar[int]
    ISOLATION_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    bucket: int
    query: Query
    sub_id: str
    durable: str
    start: StartPosition
    packed_changes: bool
    isolation: SubscribeRequest.Isolation
    group: GroupFence
    def __init__(self, bucket: _Optional[int] = ..., query: _Optional[_Union[Query, _Mapping]] = ..., sub_id: _Optional[str] = ..., durable: _Optional[str] = ..., start: _Optional[_Union[StartPosition, _Mapping]] = ..., packed_changes: _Optional[bool] = ..., isolation: _Optional[_Union[SubscribeRequest.Isolation, str]] = ..., group: _Optional[_Union[GroupFence, _Mapping]] = ...) -> None: ...

class GroupFence(_message.Message):
    __slots__ = ("member", "generation")
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    member: str
    generation: int
    def __init__(self, member: _Optional[str] = ..., generation: _Optional[int] = ...) -> None: ...

class GroupBeatRequest(_message.Message):
    __slots__ = ("bucket", "group", "member", "session_timeout_ms", "leaving", "query")
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    SESSION_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    LEAVING_FIELD_NUMBER: _ClassVar[int]
    QUERY_FIELD_NUMBER: _ClassVar[int]
    bucket: int
    group: str
    member: str
    session_timeout_ms: int
    leaving: bool
    query: Query
    def __init__(self, bucket: _Optional[int] = ..., group: _Optional[str] = ..., member: _Optional[str] = ..., session_timeout_ms: _Optional[int] = ..., leaving: _Optional[bool] = ..., query: _Optional[_Union[Query, _Mapping]] = ...) -> None: ...

class GroupBeatResponse(_message.Message):
    __slots__ = ("owner", "generation", "members")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    owner: str
    generation: int
    members: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, owner: _Optional[str] = ..., generation: _Optional[int] = ..., members: _Optional[_Iterable[str]] = ...) -> None: ...

class StartPosition(_message.Message):
    __slots__ = ("earliest", "after", "time_ms")
    EARLIEST_FIELD_NUMBER: _ClassVar[int]
    AFTER_FIELD_NUMBER: _ClassVar[int]
    TIME_MS_FIELD_NUMBER: _ClassVar[int]
    earliest: bool
    after: EmitSeq
    time_ms: int
    def __init__(self, earliest: _Optional[bool] = ..., after: _Optional[_Union[EmitSeq, _Mapping]] = ..., time_ms: _Optional[int] = ...) -> None: ...

class SubAck(_message.Message):
    __slots__ = ("sub_id", "start_emit_seq", "bucket", "plan_hash", "resumed")
    SUB_ID_FIELD_NUMBER: _ClassVar[int]
    START_EMIT_SEQ_FIELD_NUMBER: _ClassVar[int]
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    PLAN_HASH_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FIELD_NUMBER: _ClassVar[int]
    sub_id: str
    start_emit_seq: EmitSeq
    bucket: int
    plan_hash: int
    resumed: bool
    def __init__(self, sub_id: _Optional[str] = ..., start_emit_seq: _Optional[_Union[EmitSeq, _Mapping]] = ..., bucket: _Optional[int] = ..., plan_hash: _Optional[int] = ..., resumed: _Optional[bool] = ...) -> None: ...

class Change(_message.Message):
    __slots__ = ("key", "op", "value", "version")
    class Op(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        SET: _ClassVar[Change.Op]
        DEL: _ClassVar[Change.Op]
    SET: Change.Op
    DEL: Change.Op
    KEY_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    key: str
    op: Change.Op
    value: bytes
    version: int
    def __init__(self, key: _Optional[str] = ..., op: _Optional[_Union[Change.Op, str]] = ..., value: _Optional[bytes] = ..., version: _Optional[int] = ...) -> None: ...

class Delta(_message.Message):
    __slots__ = ("changes", "commit_time_ms")
    CHANGES_FIELD_NUMBER: _ClassVar[int]
    COMMIT_TIME_MS_FIELD_NUMBER: _ClassVar[int]
    changes: _containers.RepeatedCompositeFieldContainer[Change]
    commit_time_ms: int
    def __init__(self, changes: _Optional[_Iterable[_Union[Change, _Mapping]]] = ..., commit_time_ms: _Optional[int] = ...) -> None: ...

class DataEvent(_message.Message):
    __slots__ = ("sub_id", "emit_seq", "prev_emit_seq", "delta", "packed_changes")
    SUB_ID_FIELD_NUMBER: _ClassVar[int]
    EMIT_SEQ_FIELD_NUMBER: _ClassVar[int]
    PREV_EMIT_SEQ_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    PACKED_CHANGES_FIELD_NUMBER: _ClassVar[int]
    sub_id: str
    emit_seq: EmitSeq
    prev_emit_seq: EmitSeq
    delta: Delta
    packed_changes: bytes
    def __init__(self, sub_id: _Optional[str] = ..., emit_seq: _Optional[_Union[EmitSeq, _Mapping]] = ..., prev_emit_seq: _Optional[_Union[EmitSeq, _Mapping]] = ..., delta: _Optional[_Union[Delta, _Mapping]] = ..., packed_changes: _Optional[bytes] = ...) -> None: ...

class EventBatch(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[DataEvent]
    def __init__(self, events: _Optional[_Iterable[_Union[DataEvent, _Mapping]]] = ...) -> None: ...

class CaughtUp(_message.Message):
    __slots__ = ("sub_id", "head_emit_seq")
    SUB_ID_FIELD_NUMBER: _ClassVar[int]
    HEAD_EMIT_SEQ_FIELD_NUMBER: _ClassVar[int]
    sub_id: str
    head_emit_seq: EmitSeq
    def __init__(self, sub_id: _Optional[str] = ..., head_emit_seq: _Optional[_Union[EmitSeq, _Mapping]] = ...) -> None: ...

class ReconnectRequest(_message.Message):
    __slots__ = ("sub_id", "last_processed_emit_seq", "bucket", "packed_changes", "group")
    SUB_ID_FIELD_NUMBER: _ClassVar[int]
    LAST_PROCESSED_EMIT_SEQ_FIELD_NUMBER: _ClassVar[int]
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    PACKED_CHANGES_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    sub_id: str
    last_processed_emit_seq: EmitSeq
    bucket: int
    packed_changes: bool
    group: GroupFence
    def __init__(self, sub_id: _Optional[str] = ..., last_processed_emit_seq: _Optional[_Union[EmitSeq, _Mapping]] = ..., bucket: _Optional[int] = ..., packed_changes: _Optional[bool] = ..., group: _Optional[_Union[GroupFence, _Mapping]] = ...) -> None: ...

class ReconnectAck(_message.Message):
    __slots__ = ("status", "current_epoch_id", "next_commit_index")
    class Status(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        OK: _ClassVar[ReconnectAck.Status]
        STALE_SEQUENCE: _ClassVar[ReconnectAck.Status]
        INVALID_SEQUENCE: _ClassVar[ReconnectAck.Status]
        SUBSCRIPTION_NOT_FOUND: _ClassVar[ReconnectAck.Status]
    OK: ReconnectAck.Status
    STALE_SEQUENCE: ReconnectAck.Status
    INVALID_SEQUENCE: ReconnectAck.Status
    SUBSCRIPTION_NOT_FOUND: ReconnectAck.Status
    STATUS_FIELD_NUMBER: _ClassVar[int]
    CURRENT_EPOCH_ID_FIELD_NUMBER: _ClassVar[int]
    NEXT_COMMIT_INDEX_FIELD_NUMBER: _ClassVar[int]
    status: ReconnectAck.Status
    current_epoch_id: EmitSeq.EpochId
    next_commit_index: int
    def __init__(self, status: _Optional[_Union[ReconnectAck.Status, str]] = ..., current_epoch_id: _Optional[_Union[EmitSeq.EpochId, _Mapping]] = ..., next_commit_index: _Optional[int] = ...) -> None: ...

class StreamMessage(_message.Message):
    __slots__ = ("sub_ack", "reconnect_ack", "events", "caught_up")
    SUB_ACK_FIELD_NUMBER: _ClassVar[int]
    RECONNECT_ACK_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    CAUGHT_UP_FIELD_NUMBER: _ClassVar[int]
    sub_ack: SubAck
    reconnect_ack: ReconnectAck
    events: EventBatch
    caught_up: CaughtUp
    def __init__(self, sub_ack: _Optional[_Union[SubAck, _Mapping]] = ..., reconnect_ack: _Optional[_Union[ReconnectAck, _Mapping]] = ..., events: _Optional[_Union[EventBatch, _Mapping]] = ..., caught_up: _Optional[_Union[CaughtUp, _Mapping]] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("stream_id", "subscribe", "reconnect", "close")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIBE_FIELD_NUMBER: _ClassVar[int]
    RECONNECT_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    stream_id: int
    subscribe: SubscribeRequest
    reconnect: ReconnectRequest
    close: bool
    def __init__(self, stream_id: _Optional[int] = ..., subscribe: _Optional[_Union[SubscribeRequest, _Mapping]] = ..., reconnect: _Optional[_Union[ReconnectRequest, _Mapping]] = ..., close: _Optional[bool] = ...) -> None: ...

class SessionRequests(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[SessionRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[SessionRequest, _Mapping]]] = ...) -> None: ...

class StreamEnd(_message.Message):
    __slots__ = ("code", "message", "leader", "error", "retry_after_ms")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_MS_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    leader: str
    error: str
    retry_after_ms: int
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., leader: _Optional[str] = ..., error: _Optional[str] = ..., retry_after_ms: _Optional[int] = ...) -> None: ...

class SessionItem(_message.Message):
    __slots__ = ("stream_id", "message", "end")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    stream_id: int
    message: StreamMessage
    end: StreamEnd
    def __init__(self, stream_id: _Optional[int] = ..., message: _Optional[_Union[StreamMessage, _Mapping]] = ..., end: _Optional[_Union[StreamEnd, _Mapping]] = ...) -> None: ...

class SessionResponse(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[SessionItem]
    def __init__(self, items: _Optional[_Iterable[_Union[SessionItem, _Mapping]]] = ...) -> None: ...

class ClientAck(_message.Message):
    __slots__ = ("sub_id", "up_to_emit_seq", "group")
    SUB_ID_FIELD_NUMBER: _ClassVar[int]
    UP_TO_EMIT_SEQ_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    sub_id: str
    up_to_emit_seq: EmitSeq
    group: GroupFence
    def __init__(self, sub_id: _Optional[str] = ..., up_to_emit_seq: _Optional[_Union[EmitSeq, _Mapping]] = ..., group: _Optional[_Union[GroupFence, _Mapping]] = ...) -> None: ...

class AckBatch(_message.Message):
    __slots__ = ("acks", "wait_applied")
    ACKS_FIELD_NUMBER: _ClassVar[int]
    WAIT_APPLIED_FIELD_NUMBER: _ClassVar[int]
    acks: _containers.RepeatedCompositeFieldContainer[ClientAck]
    wait_applied: bool
    def __init__(self, acks: _Optional[_Iterable[_Union[ClientAck, _Mapping]]] = ..., wait_applied: _Optional[bool] = ...) -> None: ...

class AckResult(_message.Message):
    __slots__ = ("sub_id", "status", "message", "holder")
    class Status(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        ACCEPTED: _ClassVar[AckResult.Status]
        REGRESSIVE: _ClassVar[AckResult.Status]
        DUPLICATE: _ClassVar[AckResult.Status]
        FUTURE: _ClassVar[AckResult.Status]
        NOT_OWNER: _ClassVar[AckResult.Status]
        SUBSCRIPTION_NOT_FOUND: _ClassVar[AckResult.Status]
        STALE: _ClassVar[AckResult.Status]
        NOT_HOLDER: _ClassVar[AckResult.Status]
        PENDING: _ClassVar[AckResult.Status]
        GROUP_FENCED: _ClassVar[AckResult.Status]
    ACCEPTED: AckResult.Status
    REGRESSIVE: AckResult.Status
    DUPLICATE: AckResult.Status
    FUTURE: AckResult.Status
    NOT_OWNER: AckResult.Status
    SUBSCRIPTION_NOT_FOUND: AckResult.Status
    STALE: AckResult.Status
    NOT_HOLDER: AckResult.Status
    PENDING: AckResult.Status
    GROUP_FENCED: AckResult.Status
    SUB_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    sub_id: str
    status: AckResult.Status
    message: str
    holder: str
    def __init__(self, sub_id: _Optional[str] = ..., status: _Optional[_Union[AckResult.Status, str]] = ..., message: _Optional[str] = ..., holder: _Optional[str] = ...) -> None: ...

class AckResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[AckResult]
    def __init__(self, results: _Optional[_Iterable[_Union[AckResult, _Mapping]]] = ...) -> None: ...

class UnsubscribeRequest(_message.Message):
    __slots__ = ("sub_id", "bucket")
    SUB_ID_FIELD_NUMBER: _ClassVar[int]
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    sub_id: str
    bucket: int
    def __init__(self, sub_id: _Optional[str] = ..., bucket: _Optional[int] = ...) -> None: ...

class UnsubscribeResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ExpectedVersion(_message.Message):
    __slots__ = ("any", "not_exists", "exact")
    ANY_FIELD_NUMBER: _ClassVar[int]
    NOT_EXISTS_FIELD_NUMBER: _ClassVar[int]
    EXACT_FIELD_NUMBER: _ClassVar[int]
    any: bool
    not_exists: bool
    exact: int
    def __init__(self, any: _Optional[bool] = ..., not_exists: _Optional[bool] = ..., exact: _Optional[int] = ...) -> None: ...

class Op(_message.Message):
    __slots__ = ("kind", "key", "value", "expected")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        SET: _ClassVar[Op.Kind]
        DEL: _ClassVar[Op.Kind]
    SET: Op.Kind
    DEL: Op.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FIELD_NUMBER: _ClassVar[int]
    kind: Op.Kind
    key: str
    value: bytes
    expected: ExpectedVersion
    def __init__(self, kind: _Optional[_Union[Op.Kind, str]] = ..., key: _Optional[str] = ..., value: _Optional[bytes] = ..., expected: _Optional[_Union[ExpectedVersion, _Mapping]] = ...) -> None: ...

class ProducerRef(_message.Message):
    __slots__ = ("producer_id", "producer_epoch", "sequence", "answered_below")
    PRODUCER_ID_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    ANSWERED_BELOW_FIELD_NUMBER: _ClassVar[int]
    producer_id: int
    producer_epoch: int
    sequence: int
    answered_below: int
    def __init__(self, producer_id: _Optional[int] = ..., producer_epoch: _Optional[int] = ..., sequence: _Optional[int] = ..., answered_below: _Optional[int] = ...) -> None: ...

class WriteRequest(_message.Message):
    __slots__ = ("ops", "producer", "txn", "txn_acks")
    OPS_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_FIELD_NUMBER: _ClassVar[int]
    TXN_FIELD_NUMBER: _ClassVar[int]
    TXN_ACKS_FIELD_NUMBER: _ClassVar[int]
    ops: _containers.RepeatedCompositeFieldContainer[Op]
    producer: ProducerRef
    txn: TxnRef
    txn_acks: _containers.RepeatedCompositeFieldContainer[ClientAck]
    def __init__(self, ops: _Optional[_Iterable[_Union[Op, _Mapping]]] = ..., producer: _Optional[_Union[ProducerRef, _Mapping]] = ..., txn: _Optional[_Union[TxnRef, _Mapping]] = ..., txn_acks: _Optional[_Iterable[_Union[ClientAck, _Mapping]]] = ...) -> None: ...

class KeyVersion(_message.Message):
    __slots__ = ("key", "version")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    key: str
    version: int
    def __init__(self, key: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class WriteResponse(_message.Message):
    __slots__ = ("bucket", "committed", "versions", "duplicate")
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    bucket: int
    committed: EmitSeq
    versions: _containers.RepeatedCompositeFieldContainer[KeyVersion]
    duplicate: bool
    def __init__(self, bucket: _Optional[int] = ..., committed: _Optional[_Union[EmitSeq, _Mapping]] = ..., versions: _Optional[_Iterable[_Union[KeyVersion, _Mapping]]] = ..., duplicate: _Optional[bool] = ...) -> None: ...

class WriteManyRequest(_message.Message):
    __slots__ = ("writes", "id")
    WRITES_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    writes: _containers.RepeatedCompositeFieldContainer[WriteRequest]
    id: int
    def __init__(self, writes: _Optional[_Iterable[_Union[WriteRequest, _Mapping]]] = ..., id: _Optional[int] = ...) -> None: ...

class WriteOutcome(_message.Message):
    __slots__ = ("ok", "code", "message", "error", "leader", "retry_after_ms")
    OK_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_MS_FIELD_NUMBER: _ClassVar[int]
    ok: WriteResponse
    code: int
    message: str
    error: str
    leader: str
    retry_after_ms: int
    def __init__(self, ok: _Optional[_Union[WriteResponse, _Mapping]] = ..., code: _Optional[int] = ..., message: _Optional[str] = ..., error: _Optional[str] = ..., leader: _Optional[str] = ..., retry_after_ms: _Optional[int] = ...) -> None: ...

class WriteManyResponse(_message.Message):
    __slots__ = ("outcomes", "id")
    OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    outcomes: _containers.RepeatedCompositeFieldContainer[WriteOutcome]
    id: int
    def __init__(self, outcomes: _Optional[_Iterable[_Union[WriteOutcome, _Mapping]]] = ..., id: _Optional[int] = ...) -> None: ...

class WriteStreamResponse(_message.Message):
    __slots__ = ("answers",)
    ANSWERS_FIELD_NUMBER: _ClassVar[int]
    answers: _containers.RepeatedCompositeFieldContainer[WriteManyResponse]
    def __init__(self, answers: _Optional[_Iterable[_Union[WriteManyResponse, _Mapping]]] = ...) -> None: ...

class InitProducerRequest(_message.Message):
    __slots__ = ("producer_id", "bucket")
    PRODUCER_ID_FIELD_NUMBER: _ClassVar[int]
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    producer_id: int
    bucket: int
    def __init__(self, producer_id: _Optional[int] = ..., bucket: _Optional[int] = ...) -> None: ...

class InitProducerResponse(_message.Message):
    __slots__ = ("producer_id", "producer_epoch", "bucket")
    PRODUCER_ID_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    producer_id: int
    producer_epoch: int
    bucket: int
    def __init__(self, producer_id: _Optional[int] = ..., producer_epoch: _Optional[int] = ..., bucket: _Optional[int] = ...) -> None: ...

class TxnRef(_message.Message):
    __slots__ = ("transactional_id", "epoch", "number", "sequence")
    TRANSACTIONAL_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NUMBER_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    transactional_id: str
    epoch: int
    number: int
    sequence: int
    def __init__(self, transactional_id: _Optional[str] = ..., epoch: _Optional[int] = ..., number: _Optional[int] = ..., sequence: _Optional[int] = ...) -> None: ...

class TxnRequest(_message.Message):
    __slots__ = ("action", "transactional_id", "epoch", "number", "buckets", "timeout_ms", "resolve_commit", "writes")
    class Action(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        INIT: _ClassVar[TxnRequest.Action]
        ADD: _ClassVar[TxnRequest.Action]
        COMMIT: _ClassVar[TxnRequest.Action]
        ABORT: _ClassVar[TxnRequest.Action]
        RESOLVE: _ClassVar[TxnRequest.Action]
    INIT: TxnRequest.Action
    ADD: TxnRequest.Action
    COMMIT: TxnRequest.Action
    ABORT: TxnRequest.Action
    RESOLVE: TxnRequest.Action
    ACTION_FIELD_NUMBER: _ClassVar[int]
    TRANSACTIONAL_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NUMBER_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    RESOLVE_COMMIT_FIELD_NUMBER: _ClassVar[int]
    WRITES_FIELD_NUMBER: _ClassVar[int]
    action: TxnRequest.Action
    transactional_id: str
    epoch: int
    number: int
    buckets: _containers.RepeatedScalarFieldContainer[int]
    timeout_ms: int
    resolve_commit: bool
    writes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, action: _Optional[_Union[TxnRequest.Action, str]] = ..., transactional_id: _Optional[str] = ..., epoch: _Optional[int] = ..., number: _Optional[int] = ..., buckets: _Optional[_Iterable[int]] = ..., timeout_ms: _Optional[int] = ..., resolve_commit: _Optional[bool] = ..., writes: _Optional[_Iterable[int]] = ...) -> None: ...

class TxnResponse(_message.Message):
    __slots__ = ("epoch", "number", "coordinator", "buckets")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NUMBER_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    number: int
    coordinator: int
    buckets: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, epoch: _Optional[int] = ..., number: _Optional[int] = ..., coordinator: _Optional[int] = ..., buckets: _Optional[_Iterable[int]] = ...) -> None: ...

class TxnMarkRequest(_message.Message):
    __slots__ = ("bucket", "txn", "outcome", "owner", "prepare", "writes")
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    TXN_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    PREPARE_FIELD_NUMBER: _ClassVar[int]
    WRITES_FIELD_NUMBER: _ClassVar[int]
    bucket: int
    txn: TxnRef
    outcome: int
    owner: str
    prepare: bool
    writes: int
    def __init__(self, bucket: _Optional[int] = ..., txn: _Optional[_Union[TxnRef, _Mapping]] = ..., outcome: _Optional[int] = ..., owner: _Optional[str] = ..., prepare: _Optional[bool] = ..., writes: _Optional[int] = ...) -> None: ...

class TxnMarkResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListTransactionsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TransactionInfo(_message.Message):
    __slots__ = ("transactional_id", "owner", "epoch", "number", "phase", "outcome", "buckets", "started_ms", "timeout_ms", "coordinator")
    TRANSACTIONAL_ID_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NUMBER_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    STARTED_MS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_FIELD_NUMBER: _ClassVar[int]
    transactional_id: str
    owner: str
    epoch: int
    number: int
    phase: str
    outcome: str
    buckets: _containers.RepeatedScalarFieldContainer[int]
    started_ms: int
    timeout_ms: int
    coordinator: int
    def __init__(self, transactional_id: _Optional[str] = ..., owner: _Optional[str] = ..., epoch: _Optional[int] = ..., number: _Optional[int] = ..., phase: _Optional[str] = ..., outcome: _Optional[str] = ..., buckets: _Optional[_Iterable[int]] = ..., started_ms: _Optional[int] = ..., timeout_ms: _Optional[int] = ..., coordinator: _Optional[int] = ...) -> None: ...

class ListTransactionsResponse(_message.Message):
    __slots__ = ("transactions",)
    TRANSACTIONS_FIELD_NUMBER: _ClassVar[int]
    transactions: _containers.RepeatedCompositeFieldContainer[TransactionInfo]
    def __init__(self, transactions: _Optional[_Iterable[_Union[TransactionInfo, _Mapping]]] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: str
    def __init__(self, key: _Optional[str] = ...) -> None: ...

class GetResponse(_message.Message):
    __slots__ = ("found", "value", "version", "mod_commit_index")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MOD_COMMIT_INDEX_FIELD_NUMBER: _ClassVar[int]
    found: bool
    value: bytes
    version: int
    mod_commit_index: int
    def __init__(self, found: _Optional[bool] = ..., value: _Optional[bytes] = ..., version: _Optional[int] = ..., mod_commit_index: _Optional[int] = ...) -> None: ...

class SyncRequest(_message.Message):
    __slots__ = ("bucket", "since_commit_index", "since_key", "limit")
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    SINCE_COMMIT_INDEX_FIELD_NUMBER: _ClassVar[int]
    SINCE_KEY_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    bucket: int
    since_commit_index: int
    since_key: str
    limit: int
    def __init__(self, bucket: _Optional[int] = ..., since_commit_index: _Optional[int] = ..., since_key: _Optional[str] = ..., limit: _Optional[int] = ...) -> None: ...

class KeyValue(_message.Message):
    __slots__ = ("key", "value", "version", "mod_commit_index")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MOD_COMMIT_INDEX_FIELD_NUMBER: _ClassVar[int]
    key: str
    value: bytes
    version: int
    mod_commit_index: int
    def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ..., version: _Optional[int] = ..., mod_commit_index: _Optional[int] = ...) -> None: ...

class SyncResponse(_message.Message):
    __slots__ = ("items", "has_more", "next_since_commit_index", "next_since_key", "applied_index")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    HAS_MORE_FIELD_NUMBER: _ClassVar[int]
    NEXT_SINCE_COMMIT_INDEX_FIELD_NUMBER: _ClassVar[int]
    NEXT_SINCE_KEY_FIELD_NUMBER: _ClassVar[int]
    APPLIED_INDEX_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[KeyValue]
    has_more: bool
    next_since_commit_index: int
    next_since_key: str
    applied_index: int
    def __init__(self, items: _Optional[_Iterable[_Union[KeyValue, _Mapping]]] = ..., has_more: _Optional[bool] = ..., next_since_commit_index: _Optional[int] = ..., next_since_key: _Optional[str] = ..., applied_index: _Optional[int] = ...) -> None: ...

class HistoryRequest(_message.Message):
    __slots__ = ("bucket", "query", "after", "through_commit_index", "limit")
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    QUERY_FIELD_NUMBER: _ClassVar[int]
    AFTER_FIELD_NUMBER: _ClassVar[int]
    THROUGH_COMMIT_INDEX_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    bucket: int
    query: Query
    after: EmitSeq
    through_commit_index: int
    limit: int
    def __init__(self, bucket: _Optional[int] = ..., query: _Optional[_Union[Query, _Mapping]] = ..., after: _Optional[_Union[EmitSeq, _Mapping]] = ..., through_commit_index: _Optional[int] = ..., limit: _Optional[int] = ...) -> None: ...

class HistoryEvent(_message.Message):
    __slots__ = ("emit_seq", "delta")
    EMIT_SEQ_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    emit_seq: EmitSeq
    delta: Delta
    def __init__(self, emit_seq: _Optional[_Union[EmitSeq, _Mapping]] = ..., delta: _Optional[_Union[Delta, _Mapping]] = ...) -> None: ...

class HistoryResponse(_message.Message):
    __slots__ = ("events", "more", "next_after", "retained_after")
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    NEXT_AFTER_FIELD_NUMBER: _ClassVar[int]
    RETAINED_AFTER_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[HistoryEvent]
    more: bool
    next_after: EmitSeq
    retained_after: EmitSeq
    def __init__(self, events: _Optional[_Iterable[_Union[HistoryEvent, _Mapping]]] = ..., more: _Optional[bool] = ..., next_after: _Optional[_Union[EmitSeq, _Mapping]] = ..., retained_after: _Optional[_Union[EmitSeq, _Mapping]] = ...) -> None: ...

class RangeRequest(_message.Message):
    __slots__ = ("prefix", "start", "end", "limit", "page_token", "serializable", "bucket")
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SERIALIZABLE_FIELD_NUMBER: _ClassVar[int]
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    prefix: str
    start: str
    end: str
    limit: int
    page_token: str
    serializable: bool
    bucket: int
    def __init__(self, prefix: _Optional[str] = ..., start: _Optional[str] = ..., end: _Optional[str] = ..., limit: _Optional[int] = ..., page_token: _Optional[str] = ..., serializable: _Optional[bool] = ..., bucket: _Optional[int] = ...) -> None: ...

class RangeResponse(_message.Message):
    __slots__ = ("items", "next_page_token")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[KeyValue]
    next_page_token: str
    def __init__(self, items: _Optional[_Iterable[_Union[KeyValue, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("with_digests",)
    WITH_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    with_digests: bool
    def __init__(self, with_digests: _Optional[bool] = ...) -> None: ...

class ReplicaStatus(_message.Message):
    __slots__ = ("bucket", "bucket_uuid", "address", "leader", "is_leader", "term", "commit_index", "applied_index", "log_len", "epoch_counter", "digest", "quarantined", "members", "fsyncs", "lease_holder", "emitting", "subscriptions", "outbox_rows", "connected", "producers")
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    BUCKET_UUID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    IS_LEADER_FIELD_NUMBER: _ClassVar[int]
    TERM_FIELD_NUMBER: _ClassVar[int]
    COMMIT_INDEX_FIELD_NUMBER: _ClassVar[int]
    APPLIED_INDEX_FIELD_NUMBER: _ClassVar[int]
    LOG_LEN_FIELD_NUMBER: _ClassVar[int]
    EPOCH_COUNTER_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    FSYNCS_FIELD_NUMBER: _ClassVar[int]
    LEASE_HOLDER_FIELD_NUMBER: _ClassVar[int]
    EMITTING_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIPTIONS_FIELD_NUMBER: _ClassVar[int]
    OUTBOX_ROWS_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    PRODUCERS_FIELD_NUMBER: _ClassVar[int]
    bucket: int
    bucket_uuid: str
    address: str
    leader: str
    is_leader: bool
    term: int
    commit_index: int
    applied_index: int
    log_len: int
    epoch_counter: int
    digest: str
    quarantined: str
    members: _containers.RepeatedScalarFieldContainer[str]
    fsyncs: int
    lease_holder: str
    emitting: bool
    subscriptions: int
    outbox_rows: int
    connected: _containers.RepeatedScalarFieldContainer[str]
    producers: int
    def __init__(self, bucket: _Optional[int] = ..., bucket_uuid: _Optional[str] = ..., address: _Optional[str] = ..., leader: _Optional[str] = ..., is_leader: _Optional[bool] = ..., term: _Optional[int] = ..., commit_index: _Optional[int] = ..., applied_index: _Optional[int] = ..., log_len: _Optional[int] = ..., epoch_counter: _Optional[int] = ..., digest: _Optional[str] = ..., quarantined: _Optional[str] = ..., members: _Optional[_Iterable[str]] = ..., fsyncs: _Optional[int] = ..., lease_holder: _Optional[str] = ..., emitting: _Optional[bool] = ..., subscriptions: _Optional[int] = ..., outbox_rows: _Optional[int] = ..., connected: _Optional[_Iterable[str]] = ..., producers: _Optional[int] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("node_id", "replicas", "meta_version", "meta_voter", "meta")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    META_VERSION_FIELD_NUMBER: _ClassVar[int]
    META_VOTER_FIELD_NUMBER: _ClassVar[int]
    META_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaStatus]
    meta_version: int
    meta_voter: bool
    meta: ReplicaStatus
    def __init__(self, node_id: _Optional[str] = ..., replicas: _Optional[_Iterable[_Union[ReplicaStatus, _Mapping]]] = ..., meta_version: _Optional[int] = ..., meta_voter: _Optional[bool] = ..., meta: _Optional[_Union[ReplicaStatus, _Mapping]] = ...) -> None: ...

class ClusterInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BucketInfo(_message.Message):
    __slots__ = ("bucket", "bucket_uuid", "nodes")
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    BUCKET_UUID_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    bucket: int
    bucket_uuid: str
    nodes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, bucket: _Optional[int] = ..., bucket_uuid: _Optional[str] = ..., nodes: _Optional[_Iterable[str]] = ...) -> None: ...

class ClusterInfoResponse(_message.Message):
    __slots__ = ("cluster_id", "buckets", "nodes")
    CLUSTER_ID_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    cluster_id: str
    buckets: _containers.RepeatedCompositeFieldContainer[BucketInfo]
    nodes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, cluster_id: _Optional[str] = ..., buckets: _Optional[_Iterable[_Union[BucketInfo, _Mapping]]] = ..., nodes: _Optional[_Iterable[str]] = ...) -> None: ...

class MemberRequest(_message.Message):
    __slots__ = ("bucket", "address")
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    bucket: int
    address: str
    def __init__(self, bucket: _Optional[int] = ..., address: _Optional[str] = ...) -> None: ...

class MemberResponse(_message.Message):
    __slots__ = ("members",)
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    members: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, members: _Optional[_Iterable[str]] = ...) -> None: ...

class EpochRequest(_message.Message):
    __slots__ = ("bucket", "epoch_counter")
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    EPOCH_COUNTER_FIELD_NUMBER: _ClassVar[int]
    bucket: int
    epoch_counter: int
    def __init__(self, bucket: _Optional[int] = ..., epoch_counter: _Optional[int] = ...) -> None: ...

class EpochResponse(_message.Message):
    __slots__ = ("epoch_id", "commit_index")
    EPOCH_ID_FIELD_NUMBER: _ClassVar[int]
    COMMIT_INDEX_FIELD_NUMBER: _ClassVar[int]
    epoch_id: EmitSeq.EpochId
    commit_index: int
    def __init__(self, epoch_id: _Optional[_Union[EmitSeq.EpochId, _Mapping]] = ..., commit_index: _Optional[int] = ...) -> None: ...

class RecoverRequest(_message.Message):
    __slots__ = ("bucket", "accept_loss")
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_LOSS_FIELD_NUMBER: _ClassVar[int]
    bucket: int
    accept_loss: bool
    def __init__(self, bucket: _Optional[int] = ..., accept_loss: _Optional[bool] = ...) -> None: ...

class RecoverResponse(_message.Message):
    __slots__ = ("has_replica", "state")
    HAS_REPLICA_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    has_replica: bool
    state: str
    def __init__(self, has_replica: _Optional[bool] = ..., state: _Optional[str] = ...) -> None: ...

class BackupRequest(_message.Message):
    __slots__ = ("bucket",)
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    bucket: int
    def __init__(self, bucket: _Optional[int] = ...) -> None: ...

class BackupChunk(_message.Message):
    __slots__ = ("bucket", "bucket_uuid", "applied_index", "epoch_counter", "total_bytes", "digest", "data")
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    BUCKET_UUID_FIELD_NUMBER: _ClassVar[int]
    APPLIED_INDEX_FIELD_NUMBER: _ClassVar[int]
    EPOCH_COUNTER_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    bucket: int
    bucket_uuid: str
    applied_index: int
    epoch_counter: int
    total_bytes: int
    digest: str
    data: bytes
    def __init__(self, bucket: _Optional[int] = ..., bucket_uuid: _Optional[str] = ..., applied_index: _Optional[int] = ..., epoch_counter: _Optional[int] = ..., total_bytes: _Optional[int] = ..., digest: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

class MetaRecord(_message.Message):
    __slots__ = ("key", "value", "version")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    key: str
    value: bytes
    version: int
    def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ..., version: _Optional[int] = ...) -> None: ...

class MetaReadRequest(_message.Message):
    __slots__ = ("after_version", "wait_ms", "linearizable")
    AFTER_VERSION_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    LINEARIZABLE_FIELD_NUMBER: _ClassVar[int]
    after_version: int
    wait_ms: int
    linearizable: bool
    def __init__(self, after_version: _Optional[int] = ..., wait_ms: _Optional[int] = ..., linearizable: _Optional[bool] = ...) -> None: ...

class MetaReadResponse(_message.Message):
    __slots__ = ("version", "records", "genesis")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    GENESIS_FIELD_NUMBER: _ClassVar[int]
    version: int
    records: _containers.RepeatedCompositeFieldContainer[MetaRecord]
    genesis: str
    def __init__(self, version: _Optional[int] = ..., records: _Optional[_Iterable[_Union[MetaRecord, _Mapping]]] = ..., genesis: _Optional[str] = ...) -> None: ...

class MetaOp(_message.Message):
    __slots__ = ("key", "value", "delete", "expected_version")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    DELETE_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_VERSION_FIELD_NUMBER: _ClassVar[int]
    key: str
    value: bytes
    delete: bool
    expected_version: int
    def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ..., delete: _Optional[bool] = ..., expected_version: _Optional[int] = ...) -> None: ...

class MetaWriteRequest(_message.Message):
    __slots__ = ("ops",)
    OPS_FIELD_NUMBER: _ClassVar[int]
    ops: _containers.RepeatedCompositeFieldContainer[MetaOp]
    def __init__(self, ops: _Optional[_Iterable[_Union[MetaOp, _Mapping]]] = ...) -> None: ...

class MetaWriteResponse(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class MintTokenRequest(_message.Message):
    __slots__ = ("principal", "ttl_s")
    PRINCIPAL_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    principal: str
    ttl_s: int
    def __init__(self, principal: _Optional[str] = ..., ttl_s: _Optional[int] = ...) -> None: ...

class MintTokenResponse(_message.Message):
    __slots__ = ("token", "key_id", "expires_ms")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_MS_FIELD_NUMBER: _ClassVar[int]
    token: str
    key_id: str
    expires_ms: int
    def __init__(self, token: _Optional[str] = ..., key_id: _Optional[str] = ..., expires_ms: _Optional[int] = ...) -> None: ...

class JoinBundleRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class JoinBundleResponse(_message.Message):
    __slots__ = ("genesis", "secrets")
    GENESIS_FIELD_NUMBER: _ClassVar[int]
    SECRETS_FIELD_NUMBER: _ClassVar[int]
    genesis: str
    secrets: str
    def __init__(self, genesis: _Optional[str] = ..., secrets: _Optional[str] = ...) -> None: ...

class SubscriptionInfo(_message.Message):
    __slots__ = ("sub_id", "bucket", "owner", "query", "start", "head", "acked", "lag", "last_active_ms", "rows", "row_bytes", "pending_rows", "attached", "attached_known")
    SUB_ID_FIELD_NUMBER: _ClassVar[int]
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    QUERY_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    HEAD_FIELD_NUMBER: _ClassVar[int]
    ACKED_FIELD_NUMBER: _ClassVar[int]
    LAG_FIELD_NUMBER: _ClassVar[int]
    LAST_ACTIVE_MS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    ROW_BYTES_FIELD_NUMBER: _ClassVar[int]
    PENDING_ROWS_FIELD_NUMBER: _ClassVar[int]
    ATTACHED_FIELD_NUMBER: _ClassVar[int]
    ATTACHED_KNOWN_FIELD_NUMBER: _ClassVar[int]
    sub_id: str
    bucket: int
    owner: str
    query: Query
    start: EmitSeq
    head: EmitSeq
    acked: EmitSeq
    lag: int
    last_active_ms: int
    rows: int
    row_bytes: int
    pending_rows: int
    attached: bool
    attached_known: bool
    def __init__(self, sub_id: _Optional[str] = ..., bucket: _Optional[int] = ..., owner: _Optional[str] = ..., query: _Optional[_Union[Query, _Mapping]] = ..., start: _Optional[_Union[EmitSeq, _Mapping]] = ..., head: _Optional[_Union[EmitSeq, _Mapping]] = ..., acked: _Optional[_Union[EmitSeq, _Mapping]] = ..., lag: _Optional[int] = ..., last_active_ms: _Optional[int] = ..., rows: _Optional[int] = ..., row_bytes: _Optional[int] = ..., pending_rows: _Optional[int] = ..., attached: _Optional[bool] = ..., attached_known: _Optional[bool] = ...) -> None: ...

class ListSubscriptionsRequest(_message.Message):
    __slots__ = ("bucket", "owner", "after_sub_id", "limit")
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    AFTER_SUB_ID_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    bucket: int
    owner: str
    after_sub_id: str
    limit: int
    def __init__(self, bucket: _Optional[int] = ..., owner: _Optional[str] = ..., after_sub_id: _Optional[str] = ..., limit: _Optional[int] = ...) -> None: ...

class ListSubscriptionsResponse(_message.Message):
    __slots__ = ("subscriptions", "has_more")
    SUBSCRIPTIONS_FIELD_NUMBER: _ClassVar[int]
    HAS_MORE_FIELD_NUMBER: _ClassVar[int]
    subscriptions: _containers.RepeatedCompositeFieldContainer[SubscriptionInfo]
    has_more: bool
    def __init__(self, subscriptions: _Optional[_Iterable[_Union[SubscriptionInfo, _Mapping]]] = ..., has_more: _Optional[bool] = ...) -> None: ...

class SubscriptionRequest(_message.Message):
    __slots__ = ("bucket", "sub_id")
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    SUB_ID_FIELD_NUMBER: _ClassVar[int]
    bucket: int
    sub_id: str
    def __init__(self, bucket: _Optional[int] = ..., sub_id: _Optional[str] = ...) -> None: ...

class DeleteSubscriptionResponse(_message.Message):
    __slots__ = ("rows_dropped",)
    ROWS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    rows_dropped: int
    def __init__(self, rows_dropped: _Optional[int] = ...) -> None: ...
