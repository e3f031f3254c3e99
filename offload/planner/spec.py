"""What the planner knows about a model's KV cache: one `GroupSpec` per group.

These are plain values with no vLLM types, so the planner is testable as pure
logic and the same specs feed the layout fingerprint (see `offload.keys`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NewType

# Index of a chunk of `hybrid_chunk_size` tokens: chunk c covers tokens
# [c * chunk_size, (c + 1) * chunk_size).
ChunkIndex = NewType("ChunkIndex", int)
# Index of a KV cache group, as vLLM numbers them in `KVCacheConfig`.
GroupIndex = NewType("GroupIndex", int)


class GroupKind(str, enum.Enum):
    """How a group's memory relates to the sequence, which decides what a
    chunk must store for a hit at a later boundary to be restorable."""

    FULL_ATTENTION = "full_attention"  # KV of every token before the boundary
    SLIDING_WINDOW = "sliding_window"  # KV of the last `window` tokens only
    CHUNKED_LOCAL = "chunked_local"  # KV since the last multiple of `window`
    MAMBA = "mamba"  # one recurrent state, exactly at the boundary

    @property
    def grows_with_sequence(self) -> bool:
        """Only full attention needs memory for every token; windowed KV and a
        Mamba state stay the same size however long the sequence grows."""
        return self is GroupKind.FULL_ATTENTION


@dataclass(frozen=True)
class GroupSpec:
    """One KV cache group as the planner sees it.

    Invariants: `block_size > 0`; `page_bytes` is the natural (unpadded) size
    of one block page summed over the group's layers; `window` is set exactly
    for SLIDING_WINDOW (the sliding window in tokens) and CHUNKED_LOCAL (the
    attention chunk size in tokens).
    """

    kind: GroupKind
    block_size: int
    page_bytes: int
    num_layers: int
    window: int | None = None

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        needs_window = self.kind in (GroupKind.SLIDING_WINDOW, GroupKind.CHUNKED_LOCAL)
        if needs_window and (self.window is None or self.window <= 0):
            raise ValueError(f"{self.kind.value} group needs a positive window, got {self.window}")
        if not needs_window and self.window is not None:
            raise ValueError(f"{self.kind.value} group takes no window, got {self.window}")
