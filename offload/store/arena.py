"""The host-memory arena's geometry: frames as large as the largest group's slot, and how
many slots of each group a frame holds. Both halves of the host-memory tier derive it from the
same planner and budget; the LMCache tier sizes its objects by it too.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from offload.planner import ChunkIndex, GroupIndex, GroupKind, HybridOffloadPlanner


@dataclass(frozen=True)
class CpuLayout:
    """Arena geometry both halves derive from the same planner and budget.
    A slot id is `frame * slots_per_frame_max + index in the frame`."""

    frames: int
    frame_bytes: int
    pages_per_slot: tuple[int, ...]  # per group
    page_bytes: tuple[int, ...]  # per group

    @classmethod
    def plan(cls, planner: HybridOffloadPlanner, cpu_bytes: int) -> CpuLayout:
        pages = []
        for g, spec in enumerate(planner.groups):
            if spec.kind is GroupKind.MAMBA:
                pages.append(1)
            else:  # the largest file of this group (windowed: the first chunks past the window)
                horizon = (spec.window or 0) // planner.chunk_size + 2
                pages.append(max(len(planner.stored(GroupIndex(g), ChunkIndex(c)).blocks) for c in range(horizon)))
        page_bytes = tuple(s.page_bytes for s in planner.groups)
        frame = max(p * b for p, b in zip(pages, page_bytes))
        return cls(cpu_bytes // frame, frame, tuple(pages), page_bytes)

    def slot_bytes(self, group: int) -> int:
        return self.pages_per_slot[group] * self.page_bytes[group]

    def per_frame(self, group: int) -> int:
        return self.frame_bytes // self.slot_bytes(group)

    @property
    def stride(self) -> int:
        return max(self.per_frame(g) for g in range(len(self.page_bytes)))

    def chunks(self) -> int:
        """Whole chunks (every group's entry) the arena holds at once."""
        need = sum(Fraction(1, self.per_frame(g)) for g in range(len(self.page_bytes)))
        return int(self.frames / need)

    def describe(self, planner: HybridOffloadPlanner) -> str:
        """Capacity in tokens is tokens of full-attention KV, the only kind that grows
        with the sequence; a model without it reports 0 tokens."""
        grows = any(s.kind.grows_with_sequence for s in planner.groups)
        chunks = self.chunks()
        tokens = chunks * planner.chunk_size if grows else 0
        per_group = ", ".join(
            f"g{g} {s.kind.value}: {self.slot_bytes(g)} B/slot, {self.per_frame(g)}/frame"
            for g, s in enumerate(planner.groups))
        return (f"{self.frames} frames of {self.frame_bytes} B shared by every group = {chunks} whole chunks "
                f"= {tokens} tokens of full-attention KV with every state kept; {per_group}")
