"""Host-memory tier: per-group pools at each group's natural page size.

Every KV cache group gets the same number of slots, one per chunk, each sized
for what that group really stores per chunk: full attention the chunk's pages;
a windowed group only the pages inside its window; a Mamba group one state
page. Nothing is padded to another group's page size (that would waste host
memory on every smaller group), and slot ids of one pool are never used in another.

Eviction is LRU per pool, with one rule that keeps every prefix restorable:
an attention or windowed entry is only evicted together with its
descendants (the entries whose keys chain from it), so presence stays
prefix-closed and the lookup's binary search stays exact. Entries pinned by a
load in flight are never evicted, and in a stack with a tier below, neither is
an entry whose only copy is here (`backed` says whether the tier below holds it)
while its write there may still land.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch

from offload.keys import ChunkKey
from offload.planner import ChunkIndex, GroupIndex, GroupKind, HybridOffloadPlanner
from offload.store.base import (
    Backed,
    ChunkMiss,
    HostChunk,
    MissReason,
    OptionError,
    Placement,
    TierData,
    TierIndex,
    TierSpec,
    TierUsage,
)
from offload.store.buffers import BufferPool
from offload.store.format import ChunkHeader
from offload.store.options import CpuOptions


@dataclass(frozen=True)
class CpuLayout:
    """Slot geometry both halves derive from the same planner and budget."""

    slots: int
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
        per_chunk = sum(p * b for p, b in zip(pages, page_bytes))
        return cls(cpu_bytes // per_chunk, tuple(pages), page_bytes)

    def slot_bytes(self, group: int) -> int:
        return self.pages_per_slot[group] * self.page_bytes[group]

    def describe(self, planner: HybridOffloadPlanner) -> str:
        """Capacity in tokens is tokens of full-attention KV, the only kind that grows
        with the sequence; a model without it reports 0 tokens."""
        grows = any(s.kind.grows_with_sequence for s in planner.groups)
        tokens = self.slots * planner.chunk_size if grows else 0
        per_group = ", ".join(
            f"g{g} {s.kind.value}: {self.slots * self.slot_bytes(g) / 2**20:.1f} MiB "
            f"({self.slot_bytes(g)} B/slot)" for g, s in enumerate(planner.groups))
        return f"{self.slots} chunk slots = {tokens} tokens of full-attention KV; {per_group}"


@dataclass
class _Entry:
    slot: int
    parent: ChunkKey | None
    pins: int = 0
    children: set[ChunkKey] = field(default_factory=set)
    pending: bool = False  # a promotion whose bytes have not landed: neither offered nor evicted
    gone: bool = False  # dropped while held: offered no more, removed once neither pinned nor pending
    sole: bool = False  # its write to the tier below was dropped: evicted without a copy there


class _Pool:
    """Index of one group's pool."""

    def __init__(self, slots: int, prefix_closed: bool, backed: Callable[[ChunkKey], bool] | None = None) -> None:
        self.backed = backed
        self.free = list(range(slots - 1, -1, -1))
        self.entries: OrderedDict[ChunkKey, _Entry] = OrderedDict()  # LRU first
        self.prefix_closed = prefix_closed
        self.evictions = 0
        self.no_room = 0

    def _subtree(self, key: ChunkKey) -> list[ChunkKey] | None:
        """The entry and its descendants, or None if any is pinned or is the
        only copy in a stack."""
        out, stack = [], [key]
        while stack:
            k = stack.pop()
            e = self.entries[k]
            if e.pins or e.pending or (self.backed is not None and not e.sole and not self.backed(k)):
                return None
            out.append(k)
            if self.prefix_closed:
                stack.extend(e.children)
        return out

    def _evict_one(self) -> bool:
        for key in list(self.entries):
            victims = self._subtree(key)
            if victims is None:
                continue
            self.remove(victims)
            self.evictions += len(victims)
            return True
        return False

    def remove(self, keys: list[ChunkKey]) -> None:
        for k in keys:
            e = self.entries.pop(k)
            self.free.append(e.slot)
            if e.parent is not None and e.parent in self.entries:
                self.entries[e.parent].children.discard(k)

    def drop(self, key: ChunkKey) -> None:
        """Stop offering the entry and, prefix-closed, its descendants; each
        leaves once no load holds its slot (`reap`)."""
        if key not in self.entries:
            return
        keys, stack = [], [key]
        while stack:
            k = stack.pop()
            keys.append(k)
            self.entries[k].gone = True
            if self.prefix_closed:
                stack.extend(self.entries[k].children)
        for k in keys:
            self.reap(k)

    def reap(self, key: ChunkKey) -> None:
        e = self.entries.get(key)
        if e is not None and e.gone and not e.pins and not e.pending:
            self.remove([key])

    def _offered(self, parent: ChunkKey | None) -> bool:
        """Can an entry chain from `parent` here (None: the chain's first)?"""
        return parent is None or (parent in self.entries and not self.entries[parent].gone)

    def reserve(self, key: ChunkKey, parent: ChunkKey | None, pending: bool = False) -> int | None:
        if key in self.entries:
            self.entries.move_to_end(key)
            return None
        if self.prefix_closed and not self._offered(parent):
            self.no_room += 1
            return None  # an orphan could never be part of a restorable prefix
        while not self.free:
            if not self._evict_one():
                self.no_room += 1
                return None
            if self.prefix_closed and not self._offered(parent):
                self.no_room += 1
                return None  # the eviction took our own parent
        slot = self.free.pop()
        self.entries[key] = _Entry(slot, parent, pending=pending)
        if self.prefix_closed and parent is not None:
            self.entries[parent].children.add(key)
        return slot


class CpuIndex(TierIndex):
    def __init__(self, planner: HybridOffloadPlanner, layout: CpuLayout, backed: Backed | None = None) -> None:
        self.pools = [
            _Pool(layout.slots, s.kind is not GroupKind.MAMBA,
                  None if backed is None else partial(backed, g))
            for g, s in enumerate(planner.groups)
        ]
        self.layout = layout

    def contains(self, group: int, key: ChunkKey) -> bool:
        e = self.pools[group].entries.get(key)
        return e is not None and not e.pending and not e.gone

    def reserve(self, group: int, key: ChunkKey, parent: ChunkKey | None) -> Placement | None:
        slot = self.pools[group].reserve(key, parent)
        return None if slot is None else Placement(slot)

    def reserve_promotion(self, group: int, key: ChunkKey, parent: ChunkKey | None) -> Placement | None:
        slot = self.pools[group].reserve(key, parent, pending=True)
        return None if slot is None else Placement(slot)

    def promotion_done(self, group: int, key: ChunkKey, landed: bool) -> None:
        """Offer the entry from now on; where its load failed (the bytes may
        not have landed) drop it instead, with any entry stored behind it
        meanwhile."""
        pool = self.pools[group]
        e = pool.entries.get(key)
        if e is None or not e.pending:
            return
        e.pending = False
        if not landed:  # (never pinned: `pin` refuses a pending entry)
            pool.drop(key)
        pool.reap(key)

    def pin(self, group: int, key: ChunkKey) -> Placement | None:
        pool = self.pools[group]
        e = pool.entries.get(key)
        if e is None or e.pending or e.gone:
            return None
        e.pins += 1
        pool.entries.move_to_end(key)
        return Placement(e.slot)

    def unpin(self, group: int, key: ChunkKey) -> None:
        pool = self.pools[group]
        e = pool.entries.get(key)
        if e is not None and e.pins > 0:
            e.pins -= 1
            pool.reap(key)

    def store_dropped(self, group: int, key: ChunkKey) -> None:
        """Its slot does not hold it: offered no more, with the chain behind it.
        (A failed load is no reason to `forget`: host memory holds what it
        stored, and the failure may be another tier's or the KV cache's.)"""
        self.pools[group].drop(key)

    def copy_below_dropped(self, group: int, key: ChunkKey) -> None:
        e = self.pools[group].entries.get(key)
        if e is not None:
            e.sole = True

    @property
    def evictions(self) -> int:
        return sum(p.evictions for p in self.pools)

    def usage(self) -> TierUsage:
        n = [len(p.entries) for p in self.pools]
        return TierUsage(
            entries=tuple(n), bytes=tuple(k * self.layout.slot_bytes(g) for g, k in enumerate(n)),
            evictions=tuple(p.evictions for p in self.pools), no_room=sum(p.no_room for p in self.pools),
            capacity_bytes=sum(self.layout.slots * self.layout.slot_bytes(g) for g in range(len(self.pools))),
        )


class CpuData(TierData):
    """Worker-side pools; pinned host memory where the KV cache is on CUDA.

    The worker records which key each slot really holds, and a load checks
    it: if a store was dropped or failed after the scheduler's index counted
    it, the load is a miss (a recompute), never a scatter of another chunk.
    """

    def __init__(self, layout: CpuLayout, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.layout = layout
        self.pools = [
            torch.empty((layout.slots, layout.slot_bytes(g)), dtype=torch.uint8, pin_memory=pin)
            for g in range(len(layout.pages_per_slot))
        ]
        self.holding: list[list[tuple[bytes, int] | None]] = [[None] * layout.slots for _ in self.pools]

    def _view(self, group: int, slot: int, n_pages: int) -> torch.Tensor:
        return self.pools[group][slot, : n_pages * self.layout.page_bytes[group]]

    def gather_target(self, header: ChunkHeader, placement: Placement) -> torch.Tensor:
        assert placement.slot is not None
        self.holding[header.group][placement.slot] = None  # being overwritten
        return self._view(header.group, placement.slot, header.num_pages)

    def gathered(self, header: ChunkHeader, placement: Placement) -> None:
        assert placement.slot is not None
        self.holding[header.group][placement.slot] = (header.key, header.num_pages)

    def holds(self, header: ChunkHeader, placement: Placement) -> bool:
        return placement.slot is not None and \
            self.holding[header.group][placement.slot] == (header.key, header.num_pages)

    def put(self, header: ChunkHeader, chunk: HostChunk, placement: Placement) -> bool:
        """A promotion: copy a payload read from a tier below into the slot."""
        view = self.gather_target(header, placement)
        view.copy_(chunk.payload)
        self.gathered(header, placement)
        return True

    def get(self, header: ChunkHeader, placement: Placement, pool: BufferPool) -> HostChunk:
        if not self.holds(header, placement):
            raise ChunkMiss(MissReason.CORRUPT, f"group {header.group} slot {placement.slot} does not hold this chunk")
        assert placement.slot is not None
        return HostChunk(self._view(header.group, placement.slot, header.num_pages))


class CpuTier(TierSpec[CpuOptions]):
    """Host memory: `cpu_bytes` split into per-group slot pools."""

    store = "cpu"
    hit_source = "HOST"

    def __init__(self, options: CpuOptions, ctx) -> None:
        super().__init__(options, ctx)
        self.layout = CpuLayout.plan(ctx.planner, options.cpu_bytes)

    def check(self) -> None:
        if self.layout.slots < 1:
            need = sum(self.layout.slot_bytes(g) for g in range(len(self.ctx.planner.groups)))
            raise OptionError(f"cpu_bytes={self.options.cpu_bytes}: holds no chunk of this model; "
                              f"one chunk of every group needs {need} bytes")

    def describe(self) -> str:
        return f"{self.options.cpu_bytes} bytes: {self.layout.describe(self.ctx.planner)}"

    def index(self, backed: Backed | None) -> CpuIndex:
        return CpuIndex(self.ctx.planner, self.layout, backed)

    def data(self, device: torch.device) -> CpuData:
        return CpuData(self.layout, device)
