"""What the scheduler half tells the worker half each step, and the one
thing the worker half tells back (`WorkerReport`).

Plain frozen dataclasses: they are pickled between the engine core and every
worker process once per step, so they carry ids and keys, never tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from offload.planner import GroupKind
from offload.store.base import MissReason


@dataclass(frozen=True)
class FileRef:
    """One (chunk, group) file: its identity, as its header must state it."""

    group: int
    kind: GroupKind
    key: bytes
    token_start: int
    token_end: int
    num_pages: int
    parent: bytes = bytes(8)  # first 8 bytes of the parent chunk's key; zeros for chunk 0
    # The whole key of the entry it chains from (attention and windowed groups; None for a
    # state or a chain's first entry): a file write checks it is still there (ParentGone).
    parent_key: bytes | None = None


@dataclass(frozen=True)
class TierSlot:
    """An entry's place in one tier of the stack: the tier's position, and
    its pool slot where the tier has slots (host memory)."""

    tier: int
    slot: int | None = None
    cold: bool = False  # a new entry that enters the tier's eviction order cold (offload.store.base.Placement)


@dataclass(frozen=True)
class WarmEntry:
    """Warm start: read (`group`, `key`) from tier `source`, put it into `slot` (host memory)."""

    group: int
    key: bytes
    source: int
    slot: TierSlot


@dataclass(frozen=True)
class LoadEntry:
    """One file of a load: read `file` from `source`, scatter its `pages`
    ((page index in the entry, destination block id) pairs), and put the same
    bytes into the `promote` tiers (the slots the scheduler reserved there)."""

    file: FileRef
    pages: tuple[tuple[int, int], ...]
    source: TierSlot
    promote: tuple[TierSlot, ...] = ()


@dataclass(frozen=True)
class LoadJob:
    """Restore one request's hit: every entry, or none (a miss). A job with
    `fail_reason` set is reported failed without I/O."""

    req_id: str
    entries: tuple[LoadEntry, ...] = ()
    fail_reason: MissReason | None = None
    fail_detail: str = ""


@dataclass(frozen=True)
class StoreJob:
    """Store one (chunk, group) entry from `block_ids`, in page order, into
    `targets` (one gather; every target is written from that host copy)."""

    req_id: str
    file: FileRef
    block_ids: tuple[int, ...]
    targets: tuple[TierSlot, ...]


@dataclass
class OffloadMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    stores: list[StoreJob] = field(default_factory=list)
    warm: tuple[WarmEntry, ...] = ()  # warm start's plan, once (offload/connector/warm.py)


@dataclass(frozen=True)
class WorkerReport(KVConnectorWorkerMetadata):
    """Worker to scheduler, with a step's output. `dropped`: the stores and
    promotions that will not land, as (tier, group, key). The scheduler's
    indices counted each entry when it planned the store; without this, a tier
    that models its contents (host memory, LMCache's ledger) would go on
    offering it, and host memory would keep the copy above a dropped write as
    an only copy, never evicted, until a restart. `warmed`: warm start's
    entries settled, as (group, key, landed) (offload/connector/warm.py).
    Ranks' reports are concatenated."""

    dropped: tuple[tuple[int, int, bytes], ...] = ()
    warmed: tuple[tuple[int, bytes, bool], ...] = ()

    def aggregate(self, other: KVConnectorWorkerMetadata) -> WorkerReport:
        assert isinstance(other, WorkerReport)
        return WorkerReport(self.dropped + other.dropped, self.warmed + other.warmed)
