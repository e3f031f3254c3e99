"""The scheduler half's store planning, and the tiers' figures in the metrics.

Each step, `StorePlanner.plan` adds to the step's `OffloadMetadata` the entries
of each scheduled request that vLLM has just computed and no tier holds yet:
whole prompt chunks of the attention groups, the prompt's partial tail, and the
recurrent states vLLM kept at chunk boundaries (and at the tail's). An entry is
stored only in order (a chain never skips a chunk) and never at or past the
chunk vLLM's own sub-block hit started a request in. A stored state is classed
(`StateClass`) and admitted by the `state_policy`; each tier reserves the
entry's slot (`TierIndex.reserve`) or refuses it (stored already, no room, not
admitted), and an entry no tier took is not stored. Only prompt tokens are
stored: they are final when scheduled.

`report` turns each tier's `TierUsage` into the metrics once per step: gauges as
they stand, cumulative counts (evictions, stores dropped for room, state hits
and evictions, states not admitted) by what they grew since last reported.

It does no I/O and never blocks; the keys come from `Requests`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from offload.connector.metadata import OffloadMetadata, StoreJob, TierSlot
from offload.connector.requests import Requests, _Req
from offload.keys import ChunkKey
from offload.metrics import Recorder
from offload.planner import (
    ChunkIndex,
    GroupChunk,
    GroupIndex,
    GroupKind,
    HybridOffloadPlanner,
    StatePolicy,
    admission,
)
from offload.store.base import TierIndex

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput

NULL_BLOCK = 0


class StorePlanner:
    """Which entries of the scheduled requests to store each step, and where;
    the tiers' usage into the metrics. `indices` are the tiers' indices,
    fastest first; `recorders` their metrics, in the same order."""

    def __init__(self, planner: HybridOffloadPlanner, policy: StatePolicy, indices: list[TierIndex],
                 recorders: list[Recorder], requests: Requests) -> None:
        self.planner = planner
        self.policy = policy
        self.indices = indices
        self.recorders = recorders
        self.requests = requests
        self._kinds = [g.kind.value for g in planner.groups]
        # What each tier's cumulative counts (TierUsage) stood at when last reported, by series.
        self._reported: list[dict[tuple[object, ...], int]] = [{} for _ in indices]
        self._storable = [
            i for i, g in enumerate(planner.groups) if g.kind is not GroupKind.MAMBA
        ]
        self._mamba = {i for i, g in enumerate(planner.groups) if g.kind is GroupKind.MAMBA}
        self._block_lcm = HybridOffloadPlanner.block_lcm(planner.groups)

    def plan(self, meta: OffloadMetadata, so: SchedulerOutput) -> None:
        """The stores of the step `so` schedules, into `meta`."""
        reqs = self.requests.reqs
        state = so.kv_connector_block_state
        if state is None:
            return
        cached = so.scheduled_cached_reqs
        # Where vLLM starts a request: a new one, or a preempted one it resumes (from its own cache too).
        starts = [(r.req_id, r.num_computed_tokens) for r in so.scheduled_new_reqs]
        starts += [(rid, n) for rid, n in zip(cached.req_ids, cached.num_computed_tokens)
                   if rid in cached.resumed_req_ids]
        for req_id, start in starts:
            st = reqs.get(req_id)
            # Only hybrids: on attention only, vLLM starts inside a block only to compute the last
            # token of a prompt we restored whole again (over our own pages).
            if st is not None and self._mamba and start % self._block_lcm and start != st.restored_end:
                st.mark_unstorable(start // self.planner.chunk_size)
        progress: list[tuple[str, int]] = [(r.req_id, r.num_computed_tokens) for r in so.scheduled_new_reqs]
        progress += list(zip(cached.req_ids, cached.num_computed_tokens))
        for req_id, before in progress:
            st = reqs.get(req_id)
            if st is None:
                continue
            after = before + so.num_scheduled_tokens.get(req_id, 0)
            self._plan_stores(meta, st, before, after, state.get_block_ids(req_id))
        for req_id, entries in state.boundary_state_offloads.items():
            st = reqs.get(req_id)
            if st is not None:
                self._plan_state_stores(meta, st, entries)

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
        self.requests.keys(st, end)  # the keys the stores below name
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
        st.planned_stores(end)

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
        st.planned_tail(end)
        self.requests.keys(st, chunk)
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
        self.requests.keys(st, chunk)
        for b in ends:
            gcs = [self.planner.stored_tail(GroupIndex(g), chunk, b) for g in self._storable]
            ids = [tuple(table[gc.group][i] for i in gc.blocks) if gc.blocks[-1] < len(table[gc.group]) else None
                   for gc in gcs]
            if any(x is None or NULL_BLOCK in x for x in ids):
                return
            for gc, block_ids in zip(gcs, ids):
                assert block_ids is not None
                self._store(meta, st, gc.group, chunk, block_ids, gc)
            st.planned_tail(b)

    def _plan_state_stores(self, meta: OffloadMetadata, st: _Req, entries: list[tuple[int, int, int]]) -> None:
        c = self.planner.chunk_size
        tail_end = self.planner.tail_boundary(len(st.request.prompt_token_ids or []))
        for group, block_id, boundary in entries:
            if tail_end and boundary == tail_end and group in self._mamba and block_id != NULL_BLOCK \
                    and st.may_store(boundary // c):
                # The state at the prompt's partial tail: vLLM's copy of it (a
                # block of its own, filled before this step's forward).
                chunk = boundary // c
                self.requests.keys(st, chunk)
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
            self.requests.keys(st, chunk + 1)
            self._store(meta, st, group, chunk, (block_id,))

    def _store(self, meta: OffloadMetadata, st: _Req, group: int, chunk: int, block_ids: tuple[int, ...],
               gc: GroupChunk | None = None) -> None:
        if gc is None:
            gc = self.planner.stored(GroupIndex(group), ChunkIndex(chunk))
        parent = self.requests.parent_key(st, gc)
        ref = self.requests.ref(gc, self.requests.entry_key(st, gc), parent)
        cls = self.planner.entry_class(gc, len(st.request.prompt_token_ids or []), st.branch_at)
        admit = admission(self.policy, cls)
        state = cls if gc.state_at is not None else None  # what the tiers count as a state
        targets = []
        for t, ix in enumerate(self.indices):
            placement = ix.reserve(group, ChunkKey(ref.key), parent, admit, state)
            if placement is not None:  # None: stored already, no room, or not admitted
                targets.append(TierSlot(t, placement.slot, placement.cold))
        if targets:
            meta.stores.append(StoreJob(st.request.request_id, ref, block_ids, tuple(targets)))

    # ---- the tiers' figures ---------------------------------------------------------

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
            self._grow(t, "kvoffload_warm_hits", None, u.warm_hits)

    def _grow(self, t: int, name: str, part: object, n: int, **labels: str) -> None:
        """Count what a tier's cumulative figure `n` grew by since it was last reported."""
        seen = self._reported[t]
        if n > seen.get((name, part), 0):
            self.recorders[t].inc(name, n - seen.get((name, part), 0), **labels)
            seen[(name, part)] = n
