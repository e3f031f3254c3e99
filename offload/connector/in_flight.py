"""The writes on their way to the tiers below, by entry: what the store path
and the load pipeline both need to know of them.

The store path (stores.py) registers each write as it queues it and forgets
it when it lands; the load pipeline (loads.py) and the tiers only ask. Made
by the worker, which hands the one instance to both, so neither reaches into
the other:

- `queued_write(tier)`: the write still taking an entry to a tier, which a
  file tier consults so that a child whose parent was evicted while it
  waited is dropped, while a parent still queued counts as present;
- `queued_copy`: the pooled host copy of a queued write, which a load
  planned meanwhile reads instead of racing the write (the scheduler plans
  a load from a tier's reservation, before the write lands);
- `wait_reading`: a host slot a write-through still reads, which a later
  gather or promotion into the slot awaits.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from functools import partial

from offload.connector.metadata import TierSlot
from offload.store.base import HostChunk
from offload.store.format import ChunkHeader


class WritesInFlight:
    """The registry of writes in flight; every method may be called from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # Every write queued or running (a drain waits for them).
        self.futures: set[Future[None]] = set()
        # Host slots a write-through is still copying out of: a later gather
        # into the same slot (after the scheduler evicted and reused it) waits.
        self._reading: dict[tuple[int, int, int | None], Future[None]] = {}
        # Pooled copies queued for the lower tiers, by (tier, group, key).
        self._copies: dict[tuple[int, int, bytes], HostChunk] = {}
        # Every entry on its way to a lower tier, either path, by (tier, group,
        # key) -> the write: a child's write finds its parent here (not yet a
        # file) or in the tier, and is dropped where it finds neither.
        self._queued_keys: dict[tuple[int, int, bytes], Future[None]] = {}

    # ---- the store path tells -------------------------------------------------------

    def copy_queued(self, header: ChunkHeader, chunk: HostChunk, targets: list[TierSlot]) -> None:
        """`chunk` is queued for `targets`: a load planned meanwhile reads it."""
        with self._lock:
            for t in targets:
                self._copies[(t.tier, header.group, bytes(header.key))] = chunk

    def copy_written(self, header: ChunkHeader, chunk: HostChunk, targets: list[TierSlot]) -> None:
        """The write of `chunk` to `targets` ended (landed or dropped); the caller releases it after."""
        with self._lock:
            for t in targets:
                k = (t.tier, header.group, bytes(header.key))
                if self._copies.get(k) is chunk:
                    del self._copies[k]

    def slot_read(self, slot: TierSlot, group: int, fut: Future[None]) -> None:
        """The write-through `fut` reads host slot `slot` until it is done."""
        with self._lock:
            self._reading[(slot.tier, group, slot.slot)] = fut

    def track(self, fut: Future[None], header: ChunkHeader, targets: list[TierSlot]) -> None:
        """`fut` takes the entry to `targets`; forgotten when it is done."""
        keys = [(t.tier, header.group, bytes(header.key)) for t in targets]
        with self._lock:
            self.futures.add(fut)
            # Registered before any later store is submitted: a child finds its parent's write.
            for k in keys:
                self._queued_keys[k] = fut
        fut.add_done_callback(partial(self._forget, keys=keys))

    def _forget(self, fut: Future[None], keys: list[tuple[int, int, bytes]]) -> None:
        with self._lock:
            self.futures.discard(fut)
            for k in keys:
                if self._queued_keys.get(k) is fut:
                    del self._queued_keys[k]

    # ---- the others ask ---------------------------------------------------------------

    def pending(self) -> set[Future[None]]:
        """The writes queued or running now."""
        with self._lock:
            return set(self.futures)

    def queued_write(self, tier: int) -> partial[Future[None] | None]:
        """Tier `tier`'s view of the registry: (group, key) -> the write still
        taking that entry to it, if one is queued or running."""
        return partial(self._queued_write, tier)

    def _queued_write(self, tier: int, group: int, key: bytes) -> Future[None] | None:
        with self._lock:
            fut = self._queued_keys.get((tier, group, key))
        return fut if fut is not None and not fut.done() else None

    def queued_copy(self, tier: int, header: ChunkHeader) -> HostChunk | None:
        """The entry's bytes while its write to `tier` is still queued (held), else None."""
        with self._lock:
            chunk = self._copies.get((tier, header.group, bytes(header.key)))
            return chunk.hold() if chunk is not None else None

    def wait_reading(self, t: TierSlot, group: int) -> None:
        """Wait for a write-through still reading host slot `t` (before a gather or promotion into it)."""
        with self._lock:
            fut = self._reading.pop((t.tier, group, t.slot), None)
        if fut is not None:
            fut.result()  # rare: the slot was evicted and reused while its write-through ran
