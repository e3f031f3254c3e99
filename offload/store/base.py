"""The seam between the connector and a tier: an index the scheduler asks,
and the bytes the worker moves.

The scheduler half runs in the engine-core process and the worker half in each
worker process; they share nothing but the per-step metadata. So a tier is two
small objects: `TierIndex` (scheduler: what is stored, where a new entry goes,
pinning during a load) and `TierData` (worker: stage a store on the forward
path, commit it off it, load into blocks).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from offload.keys import ChunkKey


@dataclass(frozen=True)
class Placement:
    """Where one (chunk, group) entry lives in a tier: a pool slot for host
    memory; None for files, which are addressed by key."""

    slot: int | None = None


@dataclass(frozen=True)
class TierUsage:
    """What a tier holds now, and cumulative event counts, per group (for metrics)."""

    entries: tuple[int, ...]
    bytes: tuple[int, ...]
    evictions: tuple[int, ...] = ()  # cumulative since start
    no_room: int = 0  # cumulative stores skipped for lack of room
    capacity_bytes: int | None = None


class TierIndex(ABC):
    """Scheduler-side view of a tier. Must be cheap: it runs on the scheduling path."""

    @abstractmethod
    def contains(self, group: int, key: ChunkKey) -> bool:
        """Is the entry stored and restorable?"""

    @abstractmethod
    def reserve(self, group: int, key: ChunkKey, parent: ChunkKey | None) -> Placement | None:
        """Where to store a new entry; None when it is already stored or there
        is no room (the store is skipped)."""

    @abstractmethod
    def pin(self, group: int, key: ChunkKey) -> Placement | None:
        """Hold an entry for a load until `unpin`; None if it is gone."""

    def unpin(self, group: int, key: ChunkKey) -> None:
        return None

    def usage(self) -> TierUsage | None:
        """Current usage, cheap to call every step; None while unknown."""
        return None


class TierData(ABC):
    """Worker-side bytes of a tier. `pages` is an `offload.copier.GroupPages`."""

    # Whether staged stores wait in memory for `commit` (and so count against
    # the pending-bytes budget); a tier that stages in place does not queue.
    queues_stores: bool = True

    def record_layout(self, description: dict[str, Any]) -> None:
        """Persist what the fingerprint stands for, where the tier outlives the process."""
        return None

    @abstractmethod
    def stage(self, header: Any, pages: Any, block_ids: Sequence[int], placement: Placement) -> Any:
        """Copy the pages out of the KV cache, on the forward path. Returns
        what `commit` needs, or None when the store is complete already."""

    @abstractmethod
    def commit(self, header: Any, staged: Any) -> bool:
        """Make a staged store durable, off the forward path. False if the
        entry existed already."""

    @abstractmethod
    def load(self, header: Any, pages: Any, pairs: Sequence[tuple[int, int]], placement: Placement) -> int:
        """Restore pages into blocks; returns bytes moved. Raises
        `offload.store.fs.ChunkMiss` when the entry cannot be restored."""
