"""HybridOffloadPlanner: what to store per chunk and group, and which prefix a
lookup may report as a hit. Pure logic: imports nothing from vLLM."""

from offload.planner.planner import ChunkSizeError, GroupChunk, HybridOffloadPlanner, Lookup, TailProbe
from offload.planner.spec import ChunkIndex, GroupIndex, GroupKind, GroupSpec

__all__ = [
    "ChunkIndex",
    "ChunkSizeError",
    "GroupChunk",
    "GroupIndex",
    "GroupKind",
    "GroupSpec",
    "HybridOffloadPlanner",
    "Lookup",
    "TailProbe",
]
