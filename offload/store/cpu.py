"""Host-memory tier: one arena of equal frames, shared by every KV cache group.

An entry of a group takes a slot in a frame: full attention the chunk's
pages, a windowed group only the pages inside its window, a Mamba group one
state page. A frame is as large as the largest group's slot and holds as many
slots of one group as fit (one on a hybrid at its default chunk size: vLLM
sizes the attention block so that its page is about a state's page). Frames
are not split by group up front, so the bytes follow what is admitted: where
states are evicted first, attention KV gets the room they leave.

Eviction is the one evictor's order (`offload.store.evictor.LeafQueue`): the
least recent leaf first. Presence stays prefix-closed, so the lookup's binary
search stays exact: an attention or windowed entry is a leaf only once no
entry of its group chains from it and no state at its own boundary is held;
a state is a leaf of its own and may go while the attention KV of its chunk
stays. Where a new entry enters that order, what it may displace and what a
hit refreshes is the worth model's (`offload.planner.worth`): hot at the
recent end; cold (a state at a prompt's internal boundary, under the `by_use`
policy) below every hot entry, first to go unless a load reads it, and stored
only in a free slot or one a colder entry leaves (it never displaces an entry
in use). Entries pinned by a load in flight are
never evicted, and in a stack with a tier below, neither is an entry whose
only copy is here (`backed` says whether the tier below holds it) while its
write there may still land.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from offload.keys import ChunkKey
from offload.planner import (
    Admission,
    GroupKind,
    HybridOffloadPlanner,
    StateClass,
    cold_after,
    enters_cold,
    eviction_reason,
    may_displace,
    refreshes,
    tick_rank,
)
from offload.store.arena import CpuLayout
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
    host_copy,
)
from offload.store.buffers import BufferPool, Prefault
from offload.store.evictor import LeafQueue
from offload.store.format import ChunkHeader
from offload.store.options import CpuOptions

Node = tuple[int, ChunkKey]  # (group, key)


@dataclass
class _Entry:
    slot: int
    parent: ChunkKey | None
    state: StateClass | None = None  # the class a state was admitted under (None: not a state)
    recency: int = 0
    cold: bool = False  # admitted cold and not read since
    pins: int = 0
    children: set[ChunkKey] = field(default_factory=set)  # same-group entries chaining from it
    pending: bool = False  # a promotion whose bytes have not landed: neither offered nor evicted
    gone: bool = False  # dropped while held: offered no more, removed once neither pinned nor pending
    sole: bool = False  # its write to the tier below was dropped: evicted without a copy there
    warm: bool = False  # put here by warm start (its hits are counted)


class CpuIndex(TierIndex):
    """The scheduler's view of the arena: entries by (group, key), free
    frames and slots, and the eviction order."""

    def __init__(self, planner: HybridOffloadPlanner, layout: CpuLayout, backed: Backed | None = None) -> None:
        self.layout = layout
        self.backed = backed
        kinds = [s.kind for s in planner.groups]
        self.chained = [k is not GroupKind.MAMBA for k in kinds]  # presence kept prefix-closed
        # The group a state's chunk is named by in the eviction order: a chunk's
        # attention entry stays while a state at its boundary is held.
        full = [g for g, k in enumerate(kinds) if k is GroupKind.FULL_ATTENTION]
        self.anchor = full[0] if full else None
        self.entries: dict[Node, _Entry] = {}
        self.queue: LeafQueue[Node, Node] = LeafQueue()
        self._tick = 0
        self.free_frames = list(range(layout.frames - 1, -1, -1))
        self._open: list[dict[int, list[int]]] = [{} for _ in kinds]  # group -> frame -> its free slot indices
        self._per_frame = [layout.per_frame(g) for g in range(len(kinds))]
        self.evictions = [0] * len(kinds)
        self.no_room = 0
        self.skipped = 0  # stores the admission policy declined
        self.warm_hits = 0  # loads planned from an entry warm start put here
        self.state_hits: Counter[str] = Counter()  # loads planned from a state, by its class
        self.state_evictions: Counter[tuple[str, str]] = Counter()  # (class, "cold" | "lru")
        self._count = [0] * len(kinds)  # entries per group
        self._states: Counter[str] = Counter()  # state entries per class
        self._state_bytes: Counter[str] = Counter()

    # ---- slots ---------------------------------------------------------------------

    def _take_slot(self, group: int) -> int | None:
        frames = self._open[group]
        if not frames:
            if not self.free_frames:
                return None
            frames[self.free_frames.pop()] = list(range(self._per_frame[group] - 1, -1, -1))
        frame, free = next(iter(frames.items()))
        i = free.pop()
        if not free:
            del frames[frame]
        return frame * self.layout.stride + i

    def _free_slot(self, group: int, slot: int) -> None:
        frame, i = divmod(slot, self.layout.stride)
        free = self._open[group].setdefault(frame, [])
        free.append(i)
        if len(free) == self._per_frame[group]:
            del self._open[group][frame]
            self.free_frames.append(frame)

    # ---- eviction order --------------------------------------------------------------

    def _touch(self, node: Node, e: _Entry, cold: bool = False) -> None:
        self._tick += 1
        e.recency = tick_rank(self._tick, cold)
        e.cold = cold
        self.queue.push(e.recency, node)
        if len(self.queue) > 2 * len(self.entries) + 4096:  # superseded recencies pile up where nothing is evicted
            self.queue.rebuild([(x.recency, n) for n, x in self.entries.items()])

    def _current(self, node: Node) -> int | None:
        e = self.entries.get(node)
        return None if e is None else e.recency

    def _link_of(self, node: Node) -> Node | None:
        return node if self.chained[node[0]] else None

    def _parent_link(self, node: Node, e: _Entry) -> Node | None:
        g, key = node
        if self.chained[g]:
            return None if e.parent is None else (g, e.parent)
        return None if self.anchor is None else (self.anchor, key)

    def _evictable(self, node: Node, e: _Entry) -> bool:
        return not (e.pins or e.pending or (self.backed is not None and not e.sole and not self.backed(*node)))

    def _evict_one(self, admission: Admission = Admission.HOT) -> bool:
        """Evict the oldest evictable leaf that a new entry admitted so may
        displace (cold ones rank first, so the first it may not ends the search)."""
        held = []
        try:
            while (node := self.queue.pop(self._current, self._link_of)) is not None:
                e = self.entries[node]
                if not may_displace(admission, e.cold):
                    held.append((e.recency, node))
                    return False
                if not self._evictable(node, e):
                    held.append((e.recency, node))
                    continue
                self._evict(node, e)
                return True
            return False
        finally:
            for item in held:
                self.queue.push(*item)

    def _evict(self, node: Node, e: _Entry) -> None:
        if e.state is not None:
            self.state_evictions[e.state.value, eviction_reason(e.cold).value] += 1
        self.evictions[node[0]] += 1
        self._remove(node)

    def _count_entry(self, node: Node, e: _Entry, n: int) -> None:
        self._count[node[0]] += n
        if e.state is not None:
            self._states[e.state.value] += n
            self._state_bytes[e.state.value] += n * self.layout.slot_bytes(node[0])

    def _remove(self, node: Node) -> None:
        e = self.entries.pop(node)
        self._count_entry(node, e, -1)
        self._free_slot(node[0], e.slot)
        link = self._parent_link(node, e)
        if link is None:
            return
        if self.chained[node[0]]:
            p = self.entries.get(link)
            if p is not None:
                p.children.discard(node[1])
        self._unlink(link)  # its parent may be a leaf now

    def _offered(self, group: int, parent: ChunkKey | None) -> bool:
        """Can an entry chain from `parent` here (None: the chain's first)?"""
        if parent is None:
            return True
        p = self.entries.get((group, parent))
        return p is not None and not p.gone

    # ---- the index -------------------------------------------------------------------

    def contains(self, group: int, key: ChunkKey) -> bool:
        e = self.entries.get((group, key))
        # A warm entry is offered before its bytes land: the worker's load waits for them, or reads them itself.
        return e is not None and (not e.pending or e.warm) and not e.gone

    def reserve(self, group: int, key: ChunkKey, parent: ChunkKey | None,
                admission: Admission = Admission.HOT, state: StateClass | None = None) -> Placement | None:
        slot = self._reserve(group, key, parent, admission, state, pending=False)
        return None if slot is None else Placement(slot)

    def reserve_promotion(self, group: int, key: ChunkKey, parent: ChunkKey | None) -> Placement | None:
        # Bytes a load just read are in use: hot, whatever the class they were stored under.
        slot = self._reserve(group, key, parent, Admission.HOT, None, pending=True)
        return None if slot is None else Placement(slot)

    def reserve_warm(self, group: int, key: ChunkKey, parent: ChunkKey | None) -> Placement | None:
        slot = self._reserve(group, key, parent, Admission.HOT, None, pending=True, evict=False)
        if slot is None:
            return None
        self.entries[(group, key)].warm = True
        return Placement(slot)

    def _reserve(self, group: int, key: ChunkKey, parent: ChunkKey | None, admission: Admission,
                 state: StateClass | None, pending: bool, evict: bool = True) -> int | None:
        node = (group, key)
        e = self.entries.get(node)
        if e is not None:
            if refreshes(admission) and not e.gone:
                self._touch(node, e)  # another prompt stored it again, hot: in use
            return None
        if admission is Admission.SKIP:
            self.skipped += 1
            return None
        chained = self.chained[group]
        if chained and not self._offered(group, parent):
            self.no_room += 1
            return None  # an orphan could never be part of a restorable prefix
        e = _Entry(-1, parent, state, pending=pending)
        link = self._parent_link(node, e)
        if link is not None:
            self.queue.link(link)  # from now on: the evictions below must not take what it chains from
        while (slot := self._take_slot(group)) is None:
            if not evict:
                self._unlink(link)
                return None
            if not self._evict_one(admission):
                if enters_cold(admission):
                    self.skipped += 1  # the policy's choice, not a lack of room
                else:
                    self.no_room += 1
                self._unlink(link)
                return None
        e.slot = slot
        self.entries[node] = e
        self._count_entry(node, e, 1)
        self._touch(node, e, cold=enters_cold(admission))
        if link is not None and chained:
            self.entries[link].children.add(key)
        return slot

    def _unlink(self, link: Node | None) -> None:
        if link is None:
            return
        back = self.queue.unlink(link)
        if back is not None and back in self.entries:
            self.queue.push(self.entries[back].recency, back)

    def promotion_done(self, group: int, key: ChunkKey, landed: bool) -> None:
        """Offer the entry from now on; where its load failed (the bytes may
        not have landed) drop it instead, with any entry stored behind it
        meanwhile."""
        e = self.entries.get((group, key))
        if e is None or not e.pending:
            return
        e.pending = False
        if not landed:  # (never pinned: `pin` refuses a pending entry)
            self._drop(group, key)
        self._reap((group, key))

    def pin(self, group: int, key: ChunkKey) -> Placement | None:
        node = (group, key)
        e = self.entries.get(node)
        if e is None or (e.pending and not e.warm) or e.gone:
            return None
        if e.state is not None:
            self.state_hits[e.state.value] += 1
        self.warm_hits += e.warm
        e.pins += 1
        self._touch(node, e, cold_after(e.cold))  # a hit: hot
        return Placement(e.slot)

    def unpin(self, group: int, key: ChunkKey) -> None:
        e = self.entries.get((group, key))
        if e is not None and e.pins > 0:
            e.pins -= 1
            self._reap((group, key))

    def _drop(self, group: int, key: ChunkKey) -> None:
        """Stop offering the entry and, in a chained group, its descendants;
        each leaves once no load holds its slot (`_reap`)."""
        if (group, key) not in self.entries:
            return
        nodes, stack = [], [key]
        while stack:
            k = stack.pop()
            e = self.entries[(group, k)]
            e.gone = True
            nodes.append((group, k))
            stack.extend(e.children)
        for node in nodes:
            self._reap(node)

    def _reap(self, node: Node) -> None:
        e = self.entries.get(node)
        if e is not None and e.gone and not e.pins and not e.pending:
            self._remove(node)

    def store_dropped(self, group: int, key: ChunkKey) -> None:
        """Its slot does not hold it: offered no more, with the chain behind it.
        (A failed load is no reason to `forget`: host memory holds what it
        stored, and the failure may be another tier's or the KV cache's.)"""
        self._drop(group, key)

    def copy_below_dropped(self, group: int, key: ChunkKey) -> None:
        e = self.entries.get((group, key))
        if e is not None:
            e.sole = True

    def usage(self) -> TierUsage:
        n = self._count
        return TierUsage(
            entries=tuple(n), bytes=tuple(k * self.layout.slot_bytes(g) for g, k in enumerate(n)),
            evictions=tuple(self.evictions), no_room=self.no_room,
            capacity_bytes=self.layout.frames * self.layout.frame_bytes,
            states=tuple((c, k, self._state_bytes[c]) for c, k in sorted(self._states.items())),
            state_hits=tuple(sorted(self.state_hits.items())),
            state_evictions=tuple((c, r, k) for (c, r), k in sorted(self.state_evictions.items())),
            skipped=self.skipped, warm_hits=self.warm_hits,
        )


class CpuData(TierData):
    """Worker-side arena; pinned host memory where the KV cache is on CUDA.

    The worker records which key each slot really holds, and a load checks
    it: if a store was dropped or failed after the scheduler's index counted
    it, the load is a miss (a recompute), never a scatter of another chunk.
    """

    def __init__(self, layout: CpuLayout, device: torch.device) -> None:
        self.layout = layout
        # Small pages, unlike the I/O buffers: on a VM that returns free memory to its host, a huge
        # page's first touch costs several times a small page's, and slots are filled by copies.
        self.arena = torch.empty((layout.frames, layout.frame_bytes), dtype=torch.uint8,
                                 pin_memory=device.type == "cuda")
        self.holding: dict[int, tuple[int, bytes, int]] = {}  # slot -> (group, key, pages)
        # Pinned memory is resident already; pageable memory is faulted in ahead of the loads,
        # promotions and stores that would otherwise pay each page's first touch.
        self.prefault = None if device.type == "cuda" else Prefault(self.arena)

    def close(self) -> None:
        if self.prefault is not None:
            self.prefault.stop()

    def _view(self, group: int, slot: int, n_pages: int) -> torch.Tensor:
        frame, i = divmod(slot, self.layout.stride)
        start = i * self.layout.slot_bytes(group)
        return self.arena[frame, start:start + n_pages * self.layout.page_bytes[group]]

    def gather_target(self, header: ChunkHeader, placement: Placement) -> torch.Tensor:
        assert placement.slot is not None
        self.holding.pop(placement.slot, None)  # being overwritten
        return self._view(header.group, placement.slot, header.num_pages)

    def gathered(self, header: ChunkHeader, placement: Placement) -> None:
        assert placement.slot is not None
        self.holding[placement.slot] = (header.group, header.key, header.num_pages)

    def holds(self, header: ChunkHeader, placement: Placement) -> bool:
        return placement.slot is not None and \
            self.holding.get(placement.slot) == (header.group, header.key, header.num_pages)

    def put(self, header: ChunkHeader, chunk: HostChunk, placement: Placement) -> bool:
        """A promotion: copy a payload read from a tier below into the slot."""
        view = self.gather_target(header, placement)
        host_copy(view, chunk.payload)
        self.gathered(header, placement)
        return True

    def get(self, header: ChunkHeader, placement: Placement, pool: BufferPool) -> HostChunk:
        if not self.holds(header, placement):
            raise ChunkMiss(MissReason.CORRUPT, f"group {header.group} slot {placement.slot} does not hold this chunk")
        assert placement.slot is not None
        return HostChunk(self._view(header.group, placement.slot, header.num_pages))


class CpuTier(TierSpec[CpuOptions]):
    """Host memory: `cpu_bytes` as one arena of frames every group draws on."""

    store = "cpu"
    hit_source = "HOST"

    def __init__(self, options: CpuOptions, ctx) -> None:
        super().__init__(options, ctx)
        self.layout = CpuLayout.plan(ctx.planner, options.cpu_bytes)

    def check(self) -> None:
        if self.layout.chunks() < 1:
            need = sum(self.layout.slot_bytes(g) for g in range(len(self.ctx.planner.groups)))
            raise OptionError(f"cpu_bytes={self.options.cpu_bytes}: holds no chunk of this model; "
                              f"one chunk of every group needs at least {need} bytes")

    def describe(self) -> str:
        return f"{self.options.cpu_bytes} bytes: {self.layout.describe(self.ctx.planner)}"

    def index(self, backed: Backed | None) -> CpuIndex:
        return CpuIndex(self.ctx.planner, self.layout, backed)

    def data(self, device: torch.device) -> CpuData:
        return CpuData(self.layout, device)
