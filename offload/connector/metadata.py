"""What the scheduler half tells the worker half each step.

Plain frozen dataclasses: they are pickled from the engine core to every
worker process once per step, so they carry ids and keys, never tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from offload.planner import GroupKind


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
class LoadJob:
    """Restore one request's hit: read each file, scatter chosen pages.

    `pages[i]` pairs with `files[i]`: (page index in the file, destination
    block id). A job with `fail_reason` set is reported failed without I/O.
    """

    req_id: str
    files: tuple[FileRef, ...]
    pages: tuple[tuple[tuple[int, int], ...], ...]
    slots: tuple[int | None, ...] = ()  # per file: pool slot in a host-memory tier
    fail_reason: str | None = None


@dataclass(frozen=True)
class StoreJob:
    """Store one (chunk, group) entry from `block_ids`, in page order."""

    req_id: str
    file: FileRef
    block_ids: tuple[int, ...]
    slot: int | None = None  # pool slot in a host-memory tier


@dataclass
class OffloadMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    stores: list[StoreJob] = field(default_factory=list)
