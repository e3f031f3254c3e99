"""What the scheduler half tells the worker half each step.

Plain frozen dataclasses: they are pickled from the engine core to every
worker process once per step, so they carry ids and keys, never tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

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


@dataclass(frozen=True)
class TierSlot:
    """An entry's place in one tier of the stack: the tier's position, and
    its pool slot where the tier has slots (host memory)."""

    tier: int
    slot: int | None = None


@dataclass(frozen=True)
class LoadJob:
    """Restore one request's hit: read each entry from its tier, scatter
    chosen pages, and put the same bytes into the `promote` tiers.

    `pages[i]` pairs with `files[i]`: (page index in the entry, destination
    block id). A job with `fail_reason` set is reported failed without I/O.
    """

    req_id: str
    files: tuple[FileRef, ...]
    pages: tuple[tuple[tuple[int, int], ...], ...]
    sources: tuple[TierSlot, ...] = ()  # per file
    promote: tuple[tuple[TierSlot, ...], ...] = ()  # per file
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
