"""Log entries of one bucket and their versioned msgpack encoding.

An entry is a msgpack array `[ENTRY_FORMAT_VERSION, type, field, ...]`: positional,
so the bytes are canonical without sorting. Constructing an entry validates it and
raises `InvalidArgument`/`LimitExceeded` (edges turn these into clear client
errors before anything is proposed); decoding re-validates and raises
`MalformedEntry`, so no entry that reaches the log can change state unless it is
well-formed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Final

import msgpack

from . import limits
from .emitseq import EmitSeq
from .errors import (
    InvalidArgument,
    LimitExceeded,
    MalformedEntry,
    SevenDBError,
    UnknownEntryType,
    UnsupportedEntryVersion,
)
from .groups import GroupBeat
from .query import Query, QueryKind

ENTRY_FORMAT_VERSION: Final = 1
U64_MAX: Final = 2**64 - 1


class EntryType(IntEnum):
    WRITE = 1
    SUBSCRIBE = 2
    UNSUBSCRIBE = 3
    OUTBOX_WRITE = 4
    OUTBOX_PURGE = 5
    EPOCH_CREATE = 6
    LEASE = 7
    INIT_PRODUCER = 8
    WRITE_BATCH = 9
    SUBSCRIBE_BATCH = 10
    HISTORY_TRIM = 11
    GROUP_BEAT = 16  # a consumer group's member beats (outbox/groups.py)
    TXN = 12
    TXN_WRITE = 13


class OpKind(IntEnum):
    SET = 0
    DEL = 1


#: Each OpKind by its value (a KeyError for an unknown one, where `op_kind` raises
#: ValueError): for a decoding loop that cannot afford a call per change.
OP_KIND_OF: Final[Mapping[int, OpKind]] = {int(kind): kind for kind in OpKind}


def op_kind(value: int) -> OpKind:
    """`OpKind(value)` (ValueError for an unknown value) without the enum's call
    machinery, which was a third of decoding an event in the SDK."""
    kind = OP_KIND_OF.get(value)
    return OpKind(value) if kind is None else kind


class ExpectKind(IntEnum):
    ANY = 0
    NOT_EXISTS = 1
    EXACT = 2


def _check_int(value: object, name: str, lo: int = 0, hi: int = U64_MAX) -> int:
    if type(value) is int and lo <= value <= hi:  # most calls: a plain int in range
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"{name} must be an integer, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise InvalidArgument(f"{name} must be in [{lo}, {hi}], got {value}")
    return value


def _check_str(value: object, name: str, max_bytes: int, *, empty_ok: bool = False) -> str:
    if not isinstance(value, str):
        raise InvalidArgument(f"{name} must be a string, got {type(value).__name__}")
    if not value and not empty_ok:
        raise InvalidArgument(f"{name} must not be empty")
    if value.isascii():  # the common case: one byte per character, valid UTF-8
        if len(value) > max_bytes:
            raise LimitExceeded(f"{name} is {len(value)} bytes; the limit is {max_bytes}")
        return value
    size = len(value.encode("utf-8", "surrogatepass"))
    if size > max_bytes:
        raise LimitExceeded(f"{name} is {size} bytes; the limit is {max_bytes}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidArgument(f"{name} is not valid UTF-8") from None
    return value


def _check_bytes(value: object, name: str, max_bytes: int) -> bytes:
    if not isinstance(value, bytes):
        raise InvalidArgument(f"{name} must be bytes, got {type(value).__name__}")
    if len(value) > max_bytes:
        raise LimitExceeded(f"{name} is {len(value)} bytes; the limit is {max_bytes}")
    return value


def check_key(key: object) -> str:
    return _check_str(key, "key", limits.KEY_BYTES_MAX)


@dataclass(frozen=True, slots=True)
class Expected:
    """A per-key precondition (docs/contract.md §14): any, must-not-exist, or exactly version N."""

    kind: ExpectKind = ExpectKind.ANY
    version: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.kind, ExpectKind):
            raise InvalidArgument(f"unknown expected-version kind {self.kind!r}")
        _check_int(self.version, "expected version")
        if (self.kind is ExpectKind.EXACT) != (self.version > 0):
            raise InvalidArgument("an exact expected version must be >= 1 (and only exact has one)")

    @classmethod
    def exact(cls, version: int) -> Expected:
        return cls(ExpectKind.EXACT, version)

    def __str__(self) -> str:
        if self.kind is ExpectKind.EXACT:
            return f"version {self.version}"
        return "any" if self.kind is ExpectKind.ANY else "not-exists"


ANY: Final = Expected()
NOT_EXISTS: Final = Expected(ExpectKind.NOT_EXISTS)


@dataclass(frozen=True, slots=True)
class Op:
    kind: OpKind
    key: str
    value: bytes = b""
    expected: Expected = ANY

    def __post_init__(self) -> None:
        if not isinstance(self.kind, OpKind):
            raise InvalidArgument(f"unknown op kind {self.kind!r}")
        check_key(self.key)
        _check_bytes(self.value, f"value of {self.key!r}", limits.VALUE_BYTES_MAX)
        if self.kind is OpKind.DEL and self.value:
            raise InvalidArgument(f"DEL of {self.key!r} must not carry a value")
        if not isinstance(self.expected, Expected):
            raise InvalidArgument("expected must be an Expected")


@dataclass(frozen=True, slots=True)
class ProducerRef:
    """Idempotent producer coordinates (docs/contract.md §16): id, epoch, per-bucket sequence."""

    producer_id: int
    epoch: int
    sequence: int
    answered_below: int = 0
    """Every sequence of this epoch below this one was answered and will not be sent
    again, so the bucket may forget its result (0: none known; at most `sequence`)."""

    def __post_init__(self) -> None:
        _check_int(self.producer_id, "producer_id", lo=1)
        _check_int(self.epoch, "producer_epoch", hi=2**32 - 1)
        _check_int(self.sequence, "producer sequence")
        _check_int(self.answered_below, "answered_below", hi=self.sequence)


@dataclass(frozen=True, slots=True)
class Write:
    ops: tuple[Op, ...]
    producer: ProducerRef | None = None
    now_ms: int = 0
    principal: str = ""
    """Who wrote it, when it names a producer: only the producer's owner may use it
    (`InitProducer.principal`). Empty otherwise (and in entries of older builds)."""

    def __post_init__(self) -> None:
        if not isinstance(self.ops, tuple) or not self.ops:
            raise InvalidArgument("a write needs at least one op")
        _check_int(self.now_ms, "now_ms")
        if self.principal:
            _check_str(self.principal, "principal", limits.PRINCIPAL_BYTES_MAX)
        if len(self.ops) == 1 and isinstance(self.ops[0], Op):
            return  # one op: its own checks bound its value below the write's limit
        if len(self.ops) > limits.OPS_PER_WRITE_MAX:
            raise LimitExceeded(
                f"a write has {len(self.ops)} ops; the limit is {limits.OPS_PER_WRITE_MAX}"
            )
        keys = [op.key for op in self.ops]
        if len(set(keys)) != len(keys):
            raise InvalidArgument("a write may touch each key at most once")
        total = sum(len(op.value) for op in self.ops)
        if total > limits.WRITE_VALUE_BYTES_MAX:
            raise LimitExceeded(
                f"a write carries {total} value bytes; the limit is {limits.WRITE_VALUE_BYTES_MAX}"
            )


class StartKind(IntEnum):
    """Where a new subscription's stream starts (docs/core.md, "Start positions")."""

    LATEST = 0
    """After the SUBSCRIBE itself: only what commits after it."""
    AFTER = 1
    """After a given emit_seq of the bucket, within the retained history."""
    EARLIEST = 2
    """After the oldest position the retained history reaches back to."""
    TIME = 3
    """With the first retained change committed at or after a time (ms)."""


@dataclass(frozen=True, slots=True)
class Start:
    """A start position: `kind`, with `after` for AFTER and `time_ms` for TIME."""

    kind: StartKind = StartKind.LATEST
    after: EmitSeq | None = None
    time_ms: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.kind, StartKind):
            raise InvalidArgument(f"unknown start kind {self.kind!r}")
        if (self.after is not None) != (self.kind is StartKind.AFTER):
            raise InvalidArgument("a start AFTER a position, and only that, names one")
        if self.after is not None:
            _check_emit_seq(self.after, "start position")
        _check_int(self.time_ms, "start time_ms")
        if self.time_ms and self.kind is not StartKind.TIME:
            raise InvalidArgument("only a TIME start names a time")

    def pack(self) -> list[object]:
        arg: object = None
        if self.after is not None:
            arg = self.after.pack()
        elif self.kind is StartKind.TIME:
            arg = self.time_ms
        return [int(self.kind), arg]

    @classmethod
    def unpack(cls, raw: object) -> Start:
        items = _as_list(raw, "start", 2)
        _arity(items, 2, "start")
        kind = StartKind(_check_int(items[0], "start kind", hi=3))
        if kind is StartKind.AFTER:
            return cls(kind, _emit_seq(items[1]))
        if kind is StartKind.TIME:
            return cls(kind, time_ms=items[1])  # type: ignore[arg-type]
        if items[1] is not None:
            raise InvalidArgument(f"a {kind.name} start takes no argument")
        return cls(kind)


LATEST: Final = Start()


class Isolation(IntEnum):
    """What a subscription receives of transactions (docs/transactions.md)."""

    READ_COMMITTED = 0
    """A committed transaction's changes in a bucket, as one event at its COMMIT
    marker; nothing of an open or aborted one."""
    READ_UNCOMMITTED = 1
    """Transactional writes as they apply (before any decision; an aborted
    transaction's included), with version 0; nothing at the marker."""


@dataclass(frozen=True, slots=True)
class Subscribe:
    """A subscription to `query`. With `durable` (a name of the principal's), it is
    the principal's named subscription: created under `sub_id` if the name is new,
    otherwise the existing one is resumed (docs/core.md, "Durable names"). A new one
    starts at `start` (docs/core.md, "Start positions")."""

    sub_id: str
    principal: str
    query: Query
    plan_hash: int
    now_ms: int = 0
    durable: str = ""
    start: Start = LATEST
    isolation: Isolation = Isolation.READ_COMMITTED

    def __post_init__(self) -> None:
        if not isinstance(self.isolation, Isolation):
            raise InvalidArgument(f"unknown isolation level {self.isolation!r}")
        _check_str(self.sub_id, "sub_id", limits.ID_BYTES_MAX)
        _check_str(self.principal, "principal", limits.PRINCIPAL_BYTES_MAX)
        _check_str(self.durable, "durable name", limits.ID_BYTES_MAX, empty_ok=True)
        if not isinstance(self.start, Start):
            raise InvalidArgument("start must be a Start")
        if not isinstance(self.query, Query) or not isinstance(self.query.kind, QueryKind):
            raise InvalidArgument("query must be KEY, PREFIX or ALL")
        _check_str(self.query.arg, "query argument", limits.KEY_BYTES_MAX, empty_ok=True)
        if self.query.kind is QueryKind.KEY and not self.query.arg:
            raise InvalidArgument("a KEY query needs a key")
        if self.query.kind is QueryKind.ALL and self.query.arg:
            raise InvalidArgument("an ALL query takes no argument")
        _check_int(self.plan_hash, "plan_hash")
        _check_int(self.now_ms, "now_ms")


@dataclass(frozen=True, slots=True)
class Unsubscribe:
    sub_id: str
    principal: str
    now_ms: int = 0

    def __post_init__(self) -> None:
        _check_str(self.sub_id, "sub_id", limits.ID_BYTES_MAX)
        _check_str(self.principal, "principal", limits.PRINCIPAL_BYTES_MAX)
        _check_int(self.now_ms, "now_ms")


@dataclass(frozen=True, slots=True)
class OutboxWrite:
    """Makes the computed rows of source entries in (from_index, through_index] durable.

    Carries a digest of the rows instead of the rows: every replica computed them
    itself, and checks the digest against its own (mismatch: quarantine).
    """

    lease_index: int
    from_index: int
    through_index: int
    row_count: int
    digest: int
    now_ms: int = 0

    def __post_init__(self) -> None:
        for name in ("lease_index", "from_index", "through_index", "row_count", "digest", "now_ms"):
            _check_int(getattr(self, name), name)
        if self.through_index <= self.from_index:
            raise InvalidArgument("an OUTBOX_WRITE range must not be empty")


@dataclass(frozen=True, slots=True)
class Ack:
    """A cumulative acknowledgement: everything up to `up_to` was processed."""

    sub_id: str
    principal: str
    up_to: EmitSeq

    def __post_init__(self) -> None:
        _check_str(self.sub_id, "sub_id", limits.ID_BYTES_MAX)
        _check_str(self.principal, "principal", limits.PRINCIPAL_BYTES_MAX)
        _check_emit_seq(self.up_to, "ack emit_seq")


@dataclass(frozen=True, slots=True)
class OutboxPurge:
    """The lease holder's housekeeping entry: a batch of acknowledgements, the
    subscriptions idle past the stall window to expire (delete), keep-alives for
    subscriptions with a client attached and nothing to acknowledge (`touch`), and
    the producers idle past `producer_idle_ms` to forget. Every replica re-checks
    each expiry against the entry's own `now_ms` and windows: a name that does not
    qualify changes nothing (docs/core.md, lifecycles)."""

    lease_index: int
    acks: tuple[Ack, ...] = ()
    expire: tuple[str, ...] = ()
    stall_window_ms: int = limits.STALL_WINDOW_MS_DEFAULT
    now_ms: int = 0
    touch: tuple[str, ...] = ()
    expire_producers: tuple[int, ...] = ()
    producer_idle_ms: int = limits.PRODUCER_IDLE_MS_DEFAULT

    def __post_init__(self) -> None:
        _check_int(self.lease_index, "lease_index")
        if len(self.acks) > limits.ACKS_PER_PURGE_MAX:
            raise LimitExceeded(f"{len(self.acks)} acks; the limit is {limits.ACKS_PER_PURGE_MAX}")
        for name, items, most in (
            ("expiries", self.expire, limits.EXPIRES_PER_PURGE_MAX),
            ("keep-alives", self.touch, limits.TOUCHES_PER_PURGE_MAX),
            ("producer expiries", self.expire_producers, limits.EXPIRES_PER_PURGE_MAX),
        ):
            if len(items) > most:
                raise LimitExceeded(f"{len(items)} {name}; the limit is {most}")
        for sub_id in (*self.expire, *self.touch):
            _check_str(sub_id, "expired or kept-alive sub_id", limits.ID_BYTES_MAX)
        for pid in self.expire_producers:
            _check_int(pid, "expired producer_id", lo=1)
        _check_int(self.stall_window_ms, "stall_window_ms", lo=1)
        _check_int(self.producer_idle_ms, "producer_idle_ms", lo=1)
        _check_int(self.now_ms, "now_ms")

    @property
    def lifecycle_fields(self) -> bool:
        """Does it carry keep-alives, producer expiries or a non-default producer idle
        time? (Only then are they encoded: a purge without them keeps the five
        fields it always had.)"""
        return bool(
            self.touch
            or self.expire_producers
            or self.producer_idle_ms != limits.PRODUCER_IDLE_MS_DEFAULT
        )


@dataclass(frozen=True, slots=True)
class EpochCreate:
    epoch_counter: int
    now_ms: int = 0

    def __post_init__(self) -> None:
        _check_int(self.epoch_counter, "epoch_counter", lo=1)
        _check_int(self.now_ms, "now_ms")


@dataclass(frozen=True, slots=True)
class Lease:
    """Names the replica that emits for this bucket from this entry on (fencing)."""

    holder: str
    now_ms: int = 0

    def __post_init__(self) -> None:
        _check_str(self.holder, "lease holder", limits.ID_BYTES_MAX)
        _check_int(self.now_ms, "now_ms")


@dataclass(frozen=True, slots=True)
class HistoryTrim:
    """Drops the retained history's changes at or below `through_index` (the lease
    holder's housekeeping, from its retention settings; docs/core.md, "Retained
    history")."""

    through_index: int
    now_ms: int = 0

    def __post_init__(self) -> None:
        _check_int(self.through_index, "through_index")
        _check_int(self.now_ms, "now_ms")


@dataclass(frozen=True, slots=True)
class InitProducer:
    producer_id: int
    now_ms: int = 0
    principal: str = ""
    """Who asks: the first INIT_PRODUCER of an id makes its principal the producer's
    owner, and only the owner may init (fence) it again or write with it. Empty in
    entries of older builds (an unowned producer: the next principal to init it owns it)."""

    def __post_init__(self) -> None:
        _check_int(self.producer_id, "producer_id", lo=1)
        _check_int(self.now_ms, "now_ms")
        if self.principal:
            _check_str(self.principal, "principal", limits.PRINCIPAL_BYTES_MAX)


@dataclass(frozen=True, slots=True)
class WriteBatch:
    """Several independent client writes committed as one Raft entry.

    Each write keeps its own atomicity, preconditions and producer sequence; they
    apply in order and share the entry's commit index, and each subscription gets
    one delta for the whole entry (docs/contract.md §4: a delta is what one committed source
    entry changed for a subscription). This amortises per-entry Raft cost.
    """

    writes: tuple[Write, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.writes, tuple) or not self.writes:
            raise InvalidArgument("a write batch needs at least one write")
        if len(self.writes) > limits.WRITES_PER_BATCH_MAX:
            raise LimitExceeded(
                f"a batch has {len(self.writes)} writes; the limit is {limits.WRITES_PER_BATCH_MAX}"
            )
        for write in self.writes:
            if not isinstance(write, Write):
                raise InvalidArgument("a write batch holds only writes")


@dataclass(frozen=True, slots=True)
class SubscribeBatch:
    """Several SUBSCRIBEs committed as one Raft entry (subscriptions set up in bulk).

    Each applies as a SUBSCRIBE of its own would, in order, with its own result; the
    new ones all start at the entry's emit_seq. This amortises per-entry Raft cost.
    """

    subscribes: tuple[Subscribe, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.subscribes, tuple) or not self.subscribes:
            raise InvalidArgument("a subscribe batch needs at least one SUBSCRIBE")
        if len(self.subscribes) > limits.SUBSCRIBES_PER_BATCH_MAX:
            raise LimitExceeded(
                f"a batch has {len(self.subscribes)} subscribes; the limit is "
                f"{limits.SUBSCRIBES_PER_BATCH_MAX}"
            )
        for subscribe in self.subscribes:
            if not isinstance(subscribe, Subscribe):
                raise InvalidArgument("a subscribe batch holds only SUBSCRIBEs")


class TxnAction(IntEnum):
    """What a TXN entry does (docs/transactions.md). INIT..RESOLVE apply in the
    transactional id's coordinator bucket; JOIN and MARK in a participant bucket."""

    INIT = 0
    """Register the transactional id (its owner) or bump its epoch: fences the
    previous instance, whose open transaction is decided ABORT."""
    ADD = 1
    """Begin a transaction (`number` 0) or add `buckets` to the open one."""
    END = 2
    """Decide the open transaction: `outcome` COMMIT or ABORT (the PREPARE record)."""
    COMPLETE = 3
    """Every participant has its marker: forget the decided transaction."""
    EXPIRE = 4
    """Abort the open transaction if it is older than its timeout at `now_ms`."""
    RESOLVE = 5
    """An administrator decides an open transaction (`outcome`), whoever owns it."""
    JOIN = 6
    """A participant bucket learns it is part of transaction `number`."""
    MARK = 7
    """A participant bucket applies (COMMIT) or discards (ABORT_*) its pending writes."""
    PREPARE = 8
    """Before a COMMIT is decided: a participant bucket checks that it holds exactly
    the `writes` the producer sent it (it refuses otherwise, and the transaction is
    aborted instead). Changes nothing."""


class TxnOutcome(IntEnum):
    NONE = 0
    COMMIT = 1
    ABORT = 2
    ABORT_TIMED_OUT = 3
    """Aborted by the coordinator because its timeout passed."""
    ABORT_FENCED = 4
    """Aborted because a newer instance of its transactional id initialised."""


TXN_TIMEOUT_MS_DEFAULT: Final = 60_000
_COORDINATOR_ACTIONS: Final = frozenset(
    {
        TxnAction.INIT,
        TxnAction.ADD,
        TxnAction.END,
        TxnAction.COMPLETE,
        TxnAction.EXPIRE,
        TxnAction.RESOLVE,
    }
)


def check_txn_id(value: object) -> str:
    return _check_str(value, "transactional_id", limits.ID_BYTES_MAX)


@dataclass(frozen=True, slots=True)
class Txn:
    """One step of the transaction protocol (see `TxnAction`). Fields an action does
    not use must be zero/empty (so every entry has one canonical encoding)."""

    action: TxnAction
    txn_id: str
    epoch: int = 0
    number: int = 0
    buckets: tuple[int, ...] = ()
    outcome: TxnOutcome = TxnOutcome.NONE
    principal: str = ""
    now_ms: int = 0
    timeout_ms: int = 0
    writes: int = 0
    """PREPARE: how many writes (TXN_WRITE sequences) the producer sent this bucket."""

    def __post_init__(self) -> None:
        if not isinstance(self.action, TxnAction):
            raise InvalidArgument(f"unknown transaction action {self.action!r}")
        if not isinstance(self.outcome, TxnOutcome):
            raise InvalidArgument(f"unknown transaction outcome {self.outcome!r}")
        check_txn_id(self.txn_id)
        _check_int(self.epoch, "transaction epoch", hi=2**32 - 1)
        _check_int(self.number, "transaction number")
        _check_int(self.now_ms, "now_ms")
        _check_int(self.timeout_ms, "transaction timeout_ms", hi=limits.TXN_TIMEOUT_MS_MAX)
        _check_int(self.writes, "transaction writes")
        if self.principal:
            _check_str(self.principal, "principal", limits.PRINCIPAL_BYTES_MAX)
        if not isinstance(self.buckets, tuple) or len(self.buckets) > limits.TXN_BUCKETS_MAX:
            raise LimitExceeded(f"a transaction spans at most {limits.TXN_BUCKETS_MAX} buckets")
        for bucket in self.buckets:
            _check_int(bucket, "bucket", hi=2**32 - 1)
        if list(self.buckets) != sorted(set(self.buckets)):
            raise InvalidArgument("a transaction's buckets are listed once each, in order")
        self._check_shape()

    def _check_shape(self) -> None:
        action, outcome = self.action, self.outcome
        if (self.timeout_ms > 0) != (action is TxnAction.INIT):
            raise InvalidArgument("only INIT (and every INIT) names a timeout_ms >= 1")
        if bool(self.buckets) != (action is TxnAction.ADD):
            raise InvalidArgument("only ADD (and every ADD) names buckets")
        wants_outcome = action in (TxnAction.END, TxnAction.RESOLVE, TxnAction.MARK)
        if action is TxnAction.ADD and self.number < 1:
            raise InvalidArgument("ADD names a transaction number >= 1 (the next one begins it)")
        if (outcome is not TxnOutcome.NONE) != wants_outcome:
            need = "needs" if wants_outcome else "takes no"
            raise InvalidArgument(f"{action.name} {need} outcome")
        if action in (TxnAction.END, TxnAction.RESOLVE) and outcome not in (
            TxnOutcome.COMMIT,
            TxnOutcome.ABORT,
        ):
            raise InvalidArgument(f"{action.name} decides COMMIT or ABORT")
        if action in (
            TxnAction.END,
            TxnAction.COMPLETE,
            TxnAction.JOIN,
            TxnAction.MARK,
            TxnAction.PREPARE,
        ) and (self.number < 1):
            raise InvalidArgument(f"{action.name} names a transaction number >= 1")
        if self.writes and action is not TxnAction.PREPARE:
            raise InvalidArgument("only PREPARE names writes")

    @property
    def coordinator_side(self) -> bool:
        return self.action in _COORDINATOR_ACTIONS


@dataclass(frozen=True, slots=True)
class TxnWrite:
    """Writes of transaction `number` of `txn_id` (epoch `epoch`) to this bucket:
    kept pending, applied at its COMMIT marker, discarded at an ABORT one."""

    txn_id: str
    epoch: int
    number: int
    ops: tuple[Op, ...]
    principal: str = ""
    now_ms: int = 0
    sequence: int = 1
    """Its place among the transaction's writes to this bucket (1, 2, ...): a retried
    write is taken once."""
    acks: tuple[Ack, ...] = ()
    """Acknowledgements of subscriptions in this bucket that commit with the
    transaction, or not at all (consume-transform-produce, docs/transactions.md)."""

    def __post_init__(self) -> None:
        check_txn_id(self.txn_id)
        _check_int(self.epoch, "transaction epoch", hi=2**32 - 1)
        _check_int(self.number, "transaction number", lo=1)
        _check_int(self.sequence, "transactional write sequence", lo=1)
        _check_int(self.now_ms, "now_ms")
        if self.principal:
            _check_str(self.principal, "principal", limits.PRINCIPAL_BYTES_MAX)
        if not isinstance(self.acks, tuple) or len(self.acks) > limits.TXN_ACKS_PER_WRITE_MAX:
            raise LimitExceeded(
                f"a transactional write carries at most {limits.TXN_ACKS_PER_WRITE_MAX} acks"
            )
        for ack in self.acks:
            if not isinstance(ack, Ack):
                raise InvalidArgument("a transactional write's acks must be Ack values")
        if len({ack.sub_id for ack in self.acks}) != len(self.acks):
            raise InvalidArgument("a transactional write acks each subscription at most once")
        if self.ops or not self.acks:
            Write(self.ops)  # the same checks as a plain write's ops


Entry = (
    Write
    | WriteBatch
    | Subscribe
    | SubscribeBatch
    | Unsubscribe
    | OutboxWrite
    | OutboxPurge
    | EpochCreate
    | Lease
    | InitProducer
    | HistoryTrim
    | GroupBeat
    | Txn
    | TxnWrite
)

_TYPE_OF: Final[dict[type, EntryType]] = {
    Write: EntryType.WRITE,
    Subscribe: EntryType.SUBSCRIBE,
    Unsubscribe: EntryType.UNSUBSCRIBE,
    OutboxWrite: EntryType.OUTBOX_WRITE,
    OutboxPurge: EntryType.OUTBOX_PURGE,
    EpochCreate: EntryType.EPOCH_CREATE,
    Lease: EntryType.LEASE,
    InitProducer: EntryType.INIT_PRODUCER,
    WriteBatch: EntryType.WRITE_BATCH,
    SubscribeBatch: EntryType.SUBSCRIBE_BATCH,
    HistoryTrim: EntryType.HISTORY_TRIM,
    GroupBeat: EntryType.GROUP_BEAT,
    Txn: EntryType.TXN,
    TxnWrite: EntryType.TXN_WRITE,
}


def entry_type(entry: Entry) -> EntryType:
    return _TYPE_OF[type(entry)]


def _check_emit_seq(seq: object, name: str) -> EmitSeq:
    if not isinstance(seq, EmitSeq):
        raise InvalidArgument(f"{name} must be an EmitSeq")
    _check_str(seq.bucket_uuid, f"{name} bucket_uuid", limits.ID_BYTES_MAX)
    _check_int(seq.epoch_counter, f"{name} epoch_counter")
    _check_int(seq.commit_index, f"{name} commit_index")
    return seq


def _write_fields(entry: Write) -> list[object]:
    ops = [
        [int(op.kind), op.key, op.value, int(op.expected.kind), op.expected.version]
        for op in entry.ops
    ]
    ref = entry.producer
    producer = (
        None
        if ref is None
        else [ref.producer_id, ref.epoch, ref.sequence]
        + ([ref.answered_below] if ref.answered_below else [])
    )
    if entry.principal:
        return [ops, producer, entry.now_ms, entry.principal]
    return [ops, producer, entry.now_ms]


def _subscribe_fields(entry: Subscribe) -> list[object]:
    """Six fields, a seventh (the durable name) only when there is one or a start, and
    an eighth (the start) only when it is not LATEST: a SUBSCRIBE without either has
    the six it always had."""
    query = entry.query
    fields: list[object] = [
        entry.sub_id,
        entry.principal,
        int(query.kind),
        query.arg,
        entry.plan_hash,
        entry.now_ms,
    ]
    uncommitted = entry.isolation is not Isolation.READ_COMMITTED
    if entry.durable or entry.start != LATEST or uncommitted:
        fields.append(entry.durable)
    if entry.start != LATEST or uncommitted:
        fields.append(entry.start.pack())
    if uncommitted:  # a ninth field, only for a non-default isolation level
        fields.append(int(entry.isolation))
    return fields


def _fields(entry: Entry) -> list[object]:
    if isinstance(entry, Write):
        return _write_fields(entry)
    if isinstance(entry, WriteBatch):
        return [[_write_fields(w) for w in entry.writes]]
    if isinstance(entry, Subscribe):
        return _subscribe_fields(entry)
    if isinstance(entry, SubscribeBatch):
        return [[_subscribe_fields(s) for s in entry.subscribes]]
    if isinstance(entry, Unsubscribe):
        return [entry.sub_id, entry.principal, entry.now_ms]
    if isinstance(entry, OutboxWrite):
        return [
            entry.lease_index,
            entry.from_index,
            entry.through_index,
            entry.row_count,
            entry.digest,
            entry.now_ms,
        ]
    if isinstance(entry, OutboxPurge):
        acks = [[a.sub_id, a.principal, a.up_to.pack()] for a in entry.acks]
        fields = [entry.lease_index, acks, list(entry.expire), entry.stall_window_ms, entry.now_ms]
        if entry.lifecycle_fields:
            fields += [list(entry.touch), list(entry.expire_producers), entry.producer_idle_ms]
        return fields
    if isinstance(entry, EpochCreate):
        return [entry.epoch_counter, entry.now_ms]
    if isinstance(entry, Lease):
        return [entry.holder, entry.now_ms]
    if isinstance(entry, HistoryTrim):
        return [entry.through_index, entry.now_ms]
    if isinstance(entry, GroupBeat):
        return entry.fields()
    if isinstance(entry, Txn | TxnWrite):
        return _txn_fields(entry)
    if entry.principal:
        return [entry.producer_id, entry.now_ms, entry.principal]
    return [entry.producer_id, entry.now_ms]


def _txn_fields(entry: Txn | TxnWrite) -> list[object]:
    if isinstance(entry, TxnWrite):
        ops = [
            [int(op.kind), op.key, op.value, int(op.expected.kind), op.expected.version]
            for op in entry.ops
        ]
        fields: list[object] = [
            entry.txn_id,
            entry.epoch,
            entry.number,
            ops,
            entry.principal,
            entry.now_ms,
            entry.sequence,
        ]
        if entry.acks:  # an eighth field only with acks
            fields.append([[a.sub_id, a.principal, a.up_to.pack()] for a in entry.acks])
        return fields
    return [
        int(entry.action),
        entry.txn_id,
        entry.epoch,
        entry.number,
        list(entry.buckets),
        int(entry.outcome),
        entry.principal,
        entry.now_ms,
        entry.timeout_ms,
        *([entry.writes] if entry.action is TxnAction.PREPARE else []),  # a tenth: PREPARE's
    ]


def _decode_txn(kind: EntryType, f: list[object]) -> Txn | TxnWrite:
    if kind is EntryType.TXN_WRITE:
        if len(f) != 8:
            _arity(f, 7, "TXN_WRITE")
        ops = tuple(_decode_op(raw) for raw in _as_list(f[3], "ops", limits.OPS_PER_WRITE_MAX))
        acks = (
            tuple(_decode_ack(raw) for raw in _as_list(f[7], "acks", limits.TXN_ACKS_PER_WRITE_MAX))
            if len(f) == 8
            else ()
        )
        if len(f) == 8 and not acks:
            raise InvalidArgument("TXN_WRITE with no acks must have seven fields")
        return TxnWrite(f[0], f[1], f[2], ops, f[4], f[5], f[6], acks)  # type: ignore[arg-type]
    if len(f) not in (9, 10):
        _arity(f, 9, "TXN")
    action = TxnAction(_check_int(f[0], "transaction action", hi=len(TxnAction) - 1))
    _arity(f, 10 if action is TxnAction.PREPARE else 9, f"TXN {action.name}")
    outcome = TxnOutcome(_check_int(f[5], "transaction outcome", hi=len(TxnOutcome) - 1))
    buckets = tuple(_as_list(f[4], "buckets", limits.TXN_BUCKETS_MAX))
    writes = f[9] if action is TxnAction.PREPARE else 0
    return Txn(action, f[1], f[2], f[3], buckets, outcome, f[6], f[7], f[8], writes)  # type: ignore[arg-type]


def encode_entry(entry: Entry) -> bytes:
    """Canonical bytes for `entry` (what the replica adapter proposes to Raft)."""
    packed = msgpack.packb(
        [ENTRY_FORMAT_VERSION, int(entry_type(entry)), *_fields(entry)], use_bin_type=True
    )
    assert isinstance(packed, bytes)
    return packed


def _arity(items: Sequence[object], n: int, what: str) -> None:
    if len(items) != n:
        raise InvalidArgument(f"{what} has {len(items)} fields, expected {n}")


def _as_list(value: object, what: str, max_len: int) -> list[object]:
    if not isinstance(value, list):
        raise InvalidArgument(f"{what} must be an array")
    if len(value) > max_len:
        raise LimitExceeded(f"{what} has {len(value)} items; the limit is {max_len}")
    return value


def _emit_seq(value: object) -> EmitSeq:
    items = _as_list(value, "emit_seq", 3)
    _arity(items, 3, "emit_seq")
    uuid, epoch, index = items
    return _check_emit_seq(EmitSeq(uuid, epoch, index), "emit_seq")  # type: ignore[arg-type]


_OP_KINDS: Final = tuple(OpKind)
_EXPECT_KINDS: Final = tuple(ExpectKind)


def _decode_op(raw: object) -> Op:
    item = _as_list(raw, "op", 5)
    _arity(item, 5, "op")
    op_kind, key, value, exp_kind, exp_version = item
    if type(exp_kind) is int and exp_kind == 0 and type(exp_version) is int and exp_version == 0:
        expected = ANY  # most ops: no precondition, no object to build and check
    else:
        kind = _EXPECT_KINDS[_check_int(exp_kind, "expected kind", hi=2)]
        expected = Expected(kind, exp_version)  # type: ignore[arg-type]
    return Op(_OP_KINDS[_check_int(op_kind, "op kind", hi=1)], key, value, expected)  # type: ignore[arg-type]


def _decode_write(f: list[object]) -> Write:
    """Three fields, or four with the principal of a producer's write (an empty
    fourth is not canonical, and refused)."""
    if len(f) != 4 or not f[3]:
        _arity(f, 3, "WRITE")
    ops = [_decode_op(raw) for raw in _as_list(f[0], "ops", limits.OPS_PER_WRITE_MAX)]
    producer = None
    if f[1] is not None:
        p = _as_list(f[1], "producer", 4)
        if len(p) != 4 or not p[3]:  # a fourth (answered_below) only when not 0
            _arity(p, 3, "producer")
        producer = ProducerRef(*p)  # type: ignore[arg-type]
    principal = f[3] if len(f) == 4 else ""
    return Write(tuple(ops), producer, f[2], principal)  # type: ignore[arg-type]


def _decode_subscribe(f: list[object]) -> Subscribe:
    """Six fields, seven with a durable name, eight with a start; fields that encode
    shorter (an empty name and no start, a LATEST start) are not canonical, and
    refused."""
    if len(f) not in (7, 8, 9):
        _arity(f, 6, "SUBSCRIBE")
    query = Query(QueryKind(_check_int(f[2], "query kind", hi=2)), f[3])  # type: ignore[arg-type]
    durable = f[6] if len(f) >= 7 else ""
    start = Start.unpack(f[7]) if len(f) >= 8 else LATEST
    isolation = Isolation.READ_COMMITTED
    if len(f) == 9:
        isolation = Isolation(_check_int(f[8], "isolation", hi=1))
        if isolation is Isolation.READ_COMMITTED:
            raise InvalidArgument("SUBSCRIBE with the default isolation must not carry it")
    if len(f) == 7 and not durable:
        raise InvalidArgument("SUBSCRIBE with an empty durable name must have six fields")
    if len(f) == 8 and start == LATEST:
        raise InvalidArgument("SUBSCRIBE with a LATEST start must not carry it")
    return Subscribe(f[0], f[1], query, f[4], f[5], durable, start, isolation)  # type: ignore[arg-type]


def _decode_fields(kind: EntryType, f: list[object]) -> Entry:
    if kind is EntryType.WRITE:
        return _decode_write(f)
    if kind is EntryType.WRITE_BATCH:
        _arity(f, 1, "WRITE_BATCH")
        writes = _as_list(f[0], "writes", limits.WRITES_PER_BATCH_MAX)
        return WriteBatch(tuple(_decode_write(_as_list(w, "write", 4)) for w in writes))
    if kind is EntryType.SUBSCRIBE:
        return _decode_subscribe(f)
    if kind is EntryType.SUBSCRIBE_BATCH:
        _arity(f, 1, "SUBSCRIBE_BATCH")
        subscribes = _as_list(f[0], "subscribes", limits.SUBSCRIBES_PER_BATCH_MAX)
        return SubscribeBatch(
            tuple(_decode_subscribe(_as_list(s, "subscribe", 9)) for s in subscribes)
        )
    if kind is EntryType.UNSUBSCRIBE:
        _arity(f, 3, "UNSUBSCRIBE")
        return Unsubscribe(f[0], f[1], f[2])  # type: ignore[arg-type]
    if kind is EntryType.OUTBOX_WRITE:
        _arity(f, 6, "OUTBOX_WRITE")
        return OutboxWrite(*f)  # type: ignore[arg-type]
    if kind is EntryType.OUTBOX_PURGE:
        return _decode_purge(f)
    if kind is EntryType.EPOCH_CREATE:
        _arity(f, 2, "EPOCH_CREATE")
        return EpochCreate(*f)  # type: ignore[arg-type]
    if kind is EntryType.LEASE:
        _arity(f, 2, "LEASE")
        return Lease(*f)  # type: ignore[arg-type]
    if kind is EntryType.HISTORY_TRIM:
        _arity(f, 2, "HISTORY_TRIM")
        return HistoryTrim(*f)  # type: ignore[arg-type]
    if kind is EntryType.GROUP_BEAT:
        return GroupBeat.from_fields(f)
    if kind in (EntryType.TXN, EntryType.TXN_WRITE):
        return _decode_txn(kind, f)
    if len(f) != 3 or not f[2]:  # the principal is optional; an empty one not canonical
        _arity(f, 2, "INIT_PRODUCER")
    return InitProducer(*f)  # type: ignore[arg-type]


def _decode_ack(raw: object) -> Ack:
    item = _as_list(raw, "ack", 3)
    _arity(item, 3, "ack")
    seq = _as_list(item[2], "emit_seq", 3)
    _arity(seq, 3, "emit_seq")
    # `Ack` checks its position's fields itself (`_emit_seq` would check them twice).
    return Ack(item[0], item[1], EmitSeq(*seq))  # type: ignore[arg-type]


def _decode_purge(f: list[object]) -> OutboxPurge:
    """Five fields, or eight with the lifecycle fields (`OutboxPurge.lifecycle_fields`);
    eight that encode as five are not canonical, and refused."""
    if len(f) != 8:
        _arity(f, 5, "OUTBOX_PURGE")
    acks = [_decode_ack(raw) for raw in _as_list(f[1], "acks", limits.ACKS_PER_PURGE_MAX)]
    expire = tuple(_as_list(f[2], "expire", limits.EXPIRES_PER_PURGE_MAX))
    if len(f) == 5:
        return OutboxPurge(f[0], tuple(acks), expire, f[3], f[4])  # type: ignore[arg-type]
    touch = tuple(_as_list(f[5], "touch", limits.TOUCHES_PER_PURGE_MAX))
    producers = tuple(_as_list(f[6], "expire_producers", limits.EXPIRES_PER_PURGE_MAX))
    entry = OutboxPurge(f[0], tuple(acks), expire, f[3], f[4], touch, producers, f[7])  # type: ignore[arg-type]
    if not entry.lifecycle_fields:
        raise InvalidArgument("OUTBOX_PURGE with empty lifecycle fields must have five fields")
    return entry


def decode_entry(data: bytes) -> Entry:
    """Decode and validate; raises an `EntryError` subclass for anything but a valid entry."""
    if not isinstance(data, bytes):
        raise MalformedEntry(f"an entry must be bytes, got {type(data).__name__}")
    if len(data) > limits.ENTRY_BYTES_MAX:
        raise MalformedEntry(f"entry is {len(data)} bytes; the limit is {limits.ENTRY_BYTES_MAX}")
    try:
        raw = msgpack.unpackb(data, raw=False, use_list=True, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise MalformedEntry(f"entry is not valid msgpack: {exc}") from None
    if not isinstance(raw, list) or len(raw) < 2:
        raise MalformedEntry("entry must be an array [version, type, ...]")
    version, kind = raw[0], raw[1]
    if version != ENTRY_FORMAT_VERSION or isinstance(version, bool):
        raise UnsupportedEntryVersion(
            f"entry format version {version!r}; this build reads {ENTRY_FORMAT_VERSION}"
        )
    if isinstance(kind, bool) or kind not in EntryType._value2member_map_:
        raise UnknownEntryType(f"unknown entry type {kind!r}")
    try:
        return _decode_fields(EntryType(kind), raw[2:])
    except SevenDBError as exc:
        raise MalformedEntry(f"{EntryType(kind).name}: {exc}") from None
    except (TypeError, ValueError) as exc:
        raise MalformedEntry(f"{EntryType(kind).name}: {exc}") from None


__all__ = [
    "op_kind",
    "ANY",
    "ENTRY_FORMAT_VERSION",
    "NOT_EXISTS",
    "Ack",
    "Entry",
    "EntryType",
    "EpochCreate",
    "ExpectKind",
    "Expected",
    "HistoryTrim",
    "InitProducer",
    "Isolation",
    "LATEST",
    "Lease",
    "Op",
    "OpKind",
    "OutboxPurge",
    "OutboxWrite",
    "ProducerRef",
    "Start",
    "StartKind",
    "Subscribe",
    "SubscribeBatch",
    "TXN_TIMEOUT_MS_DEFAULT",
    "Txn",
    "TxnAction",
    "TxnOutcome",
    "TxnWrite",
    "Unsubscribe",
    "Write",
    "WriteBatch",
    "check_key",
    "check_txn_id",
    "decode_entry",
    "encode_entry",
    "entry_type",
]
