"""HybridOffloadPlanner: what to store per chunk and group, and which prefix a
lookup may report as a hit. Pure logic: imports nothing from vLLM."""

from offload.planner.planner import ChunkSizeError, GroupChunk, HybridOffloadPlanner, Lookup, TailProbe
from offload.planner.spec import ChunkIndex, GroupIndex, GroupKind, GroupSpec
from offload.planner.worth import DEFAULT_STATE_POLICY, Admission, StateClass, StatePolicy, admission

__all__ = [
    "DEFAULT_STATE_POLICY",
    "Admission",
    "ChunkIndex",
    "ChunkSizeError",
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
]
