"""`TierUsage`: a tier's figures for metrics, in a module of its own so that
the cache-directory machinery (offload/store/cachedir/housekeeper.py) builds them
without importing the seam (offload/store/base.py, which imports that
machinery's `CacheDirs`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TierUsage:
    """What a tier holds now, and cumulative event counts, per group (for metrics)."""

    entries: tuple[int, ...]
    bytes: tuple[int, ...]
    evictions: tuple[int, ...] = ()  # cumulative since start
    no_room: int = 0  # cumulative stores skipped for lack of room
    capacity_bytes: int | None = None
    budget_bytes: int | None = None  # what eviction keeps the tier within, where it has a budget
    # Recurrent states by the class they were admitted under (offload.planner.worth):
    states: tuple[tuple[str, int, int], ...] = ()  # (class, entries, bytes) held now
    state_hits: tuple[tuple[str, int], ...] = ()  # (class, loads planned from such a state), cumulative
    state_evictions: tuple[tuple[str, str, int], ...] = ()  # (class, "cold" | "lru", count), cumulative
    skipped: int = 0  # stores the state policy declined, cumulative
    warm_hits: int = 0  # loads planned from an entry warm start put here, cumulative
