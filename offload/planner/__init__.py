"""HybridOffloadPlanner: what to store per chunk and group, and which prefix a
lookup may report as a hit. Pure logic: imports nothing from vLLM."""

from offload.planner.planner import ChunkSizeError, GroupChunk, HybridOffloadPlanner, Lookup, TailProbe
from offload.planner.spec import ChunkIndex, GroupIndex, GroupKind, GroupSpec
from offload.planner.worth import (
    DEFAULT_STATE_POLICY,
    Admission,
    EvictionReason,
    StateClass,
    StatePolicy,
    admission,
    cold_after,
    cold_classes,
    enters_cold,
    eviction_reason,
    is_cold,
    marked_admission,
    may_displace,
    own_lru_admits,
    refreshes,
    tick_rank,
    time_rank,
)

__all__ = [
    "DEFAULT_STATE_POLICY",
    "Admission",
    "ChunkIndex",
    "ChunkSizeError",
    "EvictionReason",
    "GroupChunk",
    "GroupIndex",
    "GroupKind",
    "GroupSpec",
    "HybridOffloadPlanner",
    "Lookup",
    "StateClass",
    "StatePolicy",
    "TailProbe",
    "admission",
    "cold_after",
    "cold_classes",
    "enters_cold",
    "eviction_reason",
    "is_cold",
    "marked_admission",
    "may_displace",
    "own_lru_admits",
    "refreshes",
    "tick_rank",
    "time_rank",
]
