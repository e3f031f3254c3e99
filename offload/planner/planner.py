"""HybridOffloadPlanner: per-group chunk contents and the restorable-prefix lookup.

A hit of N tokens is only safe when *every* group can be restored at exactly N
(a hybrid hit is the minimum over groups: restoring the attention KV without
the matching Mamba state silently corrupts output). The planner states, per group, what one
(chunk, group) file holds and which files a hit of N needs, and answers the
lookup with a binary search over the part that is monotone (full attention)
followed by a short walk down over the part that is not (Mamba states and
windowed KV exist only at some boundaries).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from offload.planner.spec import ChunkIndex, GroupIndex, GroupKind, GroupSpec
from offload.planner.worth import StateClass, attention_class, pre_tail
from offload.planner.worth import state_class as classify_state

DEFAULT_MIN_CHUNK_TOKENS = 256

# present(group, chunk) -> is that (chunk, group) file stored? The planner calls
# it O(log chunks) times per lookup; the store decides how it is answered.
PresenceProbe = Callable[[GroupIndex, ChunkIndex], bool]


class ChunkSizeError(ValueError):
    """`hybrid_chunk_size` does not fit the model's KV cache groups."""


# present_tail(group, boundary) -> is the group's partial-tail entry ending at
# `boundary` (inside a chunk) stored?
TailProbe = Callable[[GroupIndex, int], bool]


@dataclass(frozen=True)
class Lookup:
    """Result of a lookup: `chunks` whole chunks restorable now, plus `tail`
    tokens of a partial tail past them (0: none), and `full_prefix`, the
    chunks every full-attention group is known to hold (they need not be
    stored again)."""

    chunks: int
    full_prefix: int
    tail: int = 0


@dataclass(frozen=True)
class GroupChunk:
    """What one (chunk, group) file holds.

    `blocks` are absolute block indices in the group's own block size (empty
    for Mamba); `state_at` is the token boundary whose recurrent state a Mamba
    file holds (None for attention groups).
    """

    group: GroupIndex
    chunk: ChunkIndex
    blocks: range
    state_at: int | None = None
    # A partial tail entry: the prefix up to `tail_end`, a boundary inside
    # `chunk` (attention: the chunk's blocks up to the one holding token
    # tail_end - 1, that one masked past it; Mamba: the state at tail_end).
    tail_end: int | None = None
    # A tail entry's first token (its header's token_start): the chunk's start,
    # or on an attention-only plan (`chained_tails`) the previous unit boundary.
    tail_start: int | None = None


class HybridOffloadPlanner:
    """Chunks every KV cache group by `chunk_size` tokens.

    Invariants: `chunk_size` is a positive multiple of every group's block
    size, so chunk boundaries are block boundaries in every group; a reported
    hit is a multiple of `chunk_size` or, with a `tail_unit`, a stored tail's
    boundary (a multiple of the unit inside a chunk), never passes the prompt, and unless
    every group is full attention is at most `num_tokens - 1` (see
    `full_prompt_hits`).
    """

    def __init__(self, groups: Sequence[GroupSpec], chunk_size: int | None = None,
                 tail_unit: int | None = None) -> None:
        if not groups:
            raise ValueError("a model needs at least one KV cache group")
        self.groups: tuple[GroupSpec, ...] = tuple(groups)
        if chunk_size is None:
            chunk_size = self.default_chunk_size(self.groups)
        self.validate_chunk_size(self.groups, chunk_size)
        self.chunk_size = chunk_size
        self.tail_unit: int | None = None
        """Token unit of partial tails (vLLM's cache-hit alignment: its
        prefix-match unit on a hybrid, the block on attention only), or None:
        hits only at chunk boundaries. Set only when it can be used: it is
        finer than the chunk and either the groups are full attention and
        Mamba/GDN (with at least one of each) and it divides every block
        size, or every group is full attention and it is a multiple of every
        block size (a tail is then whole blocks). Windowed groups keep
        chunk-boundary hits: vLLM frees their blocks behind the window, so
        a tail would need a window-trimmed block set of its own."""
        kinds = {g.kind for g in self.groups}
        if isinstance(tail_unit, int) and 0 < tail_unit < chunk_size and chunk_size % tail_unit == 0:
            if kinds == {GroupKind.FULL_ATTENTION, GroupKind.MAMBA}:
                if not any(g.block_size % tail_unit for g in self.groups):
                    self.tail_unit = tail_unit
            elif kinds == {GroupKind.FULL_ATTENTION} and not any(tail_unit % g.block_size for g in self.groups):
                self.tail_unit = tail_unit
        self._full = [GroupIndex(i) for i, g in enumerate(self.groups) if g.kind is GroupKind.FULL_ATTENTION]
        self._other = [GroupIndex(i) for i, g in enumerate(self.groups) if g.kind is not GroupKind.FULL_ATTENTION]
        self.full_prompt_hits = all(g.kind is GroupKind.FULL_ATTENTION for g in self.groups)
        """Whether a hit may cover the whole prompt. vLLM must compute the last
        prompt token to sample the next one; after a load that covers the
        prompt its scheduler steps back one token and computes it again over
        the restored KV, rewriting that token's slots. Full attention holds
        every token that token attends to. A recurrent state cannot step back
        (the state at `num_tokens` already includes the last token); a
        chunked-local group restored at a multiple of its window holds none of
        the last token's window; a sliding window is restored for the next
        token's window, which under the wider edge convention misses one token
        the last token sees. With any of them a hit stops at `num_tokens - 1`."""
        self.has_states = any(g.kind is GroupKind.MAMBA for g in self.groups)
        """A hybrid: some group holds recurrent states (their classes decide admission)."""
        self.chained_tails = self.tail_unit is not None and self.full_prompt_hits
        """Attention only: the tail behind the last whole chunk is a chain of
        entries of one unit each (the entry ending at boundary b holds the
        blocks of [b - unit, b) and chains from the entry ending at b - unit,
        the first from the previous chunk), so a prompt that shares only a
        prefix of a stored tail hits at every unit boundary of it, as vLLM's
        own cache does, with no byte stored twice and at most
        chunk_size / unit - 1 entries per prompt. On a hybrid a tail is one
        entry per group (the Mamba state exists only at the prompt's tail)."""

    # ---- chunk size -------------------------------------------------------------

    @staticmethod
    def block_lcm(groups: Sequence[GroupSpec]) -> int:
        return math.lcm(*(g.block_size for g in groups))

    @classmethod
    def default_chunk_size(
        cls, groups: Sequence[GroupSpec], min_tokens: int = DEFAULT_MIN_CHUNK_TOKENS
    ) -> int:
        """The chunk size used when `hybrid_chunk_size` is not set.

        With a Mamba/GDN group: the LCM of the block sizes. vLLM hands a
        recurrent state over only at a block boundary where a prefill step
        ended, so every coarser chunk size loses boundaries vLLM did
        checkpoint (a 745-token prompt on 128-token blocks has its state at
        640; 256-token chunks could restore none of it).
        Attention only: every block boundary is restorable, so the smallest
        multiple of the LCM that is at least `min_tokens`, which keeps the
        file count and per-file overhead down (CUDA attention blocks are 16
        tokens).
        """
        lcm = cls.block_lcm(groups)
        if any(g.kind is GroupKind.MAMBA for g in groups):
            return lcm
        return lcm * max(1, -(-min_tokens // lcm))

    @classmethod
    def validate_chunk_size(cls, groups: Sequence[GroupSpec], chunk_size: int) -> None:
        if isinstance(chunk_size, int) and chunk_size > 0 and all(chunk_size % g.block_size == 0 for g in groups):
            return
        sizes = ", ".join(f"group {i} {g.kind.value}: {g.block_size}" for i, g in enumerate(groups))
        lcm = cls.block_lcm(groups)
        raise ChunkSizeError(
            f"hybrid_chunk_size={chunk_size!r} must be a positive multiple of every KV cache "
            f"group's block size ({sizes}); valid values are multiples of {lcm}, "
            f"e.g. {cls.default_chunk_size(groups)}"
        )

    # ---- what a file holds, what a hit needs ------------------------------------------

    def _window_start(self, spec: GroupSpec, boundary: int) -> int:
        """First token whose KV a windowed group needs to continue at `boundary`.

        Sliding window: one token more than the window, so either convention
        for the window's edge is covered.
        """
        assert spec.window is not None
        if spec.kind is GroupKind.SLIDING_WINDOW:
            return max(0, boundary - spec.window)
        return boundary // spec.window * spec.window  # CHUNKED_LOCAL

    def stored(self, group: GroupIndex, chunk: ChunkIndex) -> GroupChunk:
        """Contents of the (chunk, group) file.

        Full attention: every block of the chunk. Windowed: only the blocks of
        the chunk some later boundary can still see (the earliest such boundary,
        the chunk's own end, sees the most). Mamba: the state at the chunk end.
        """
        spec = self.groups[group]
        start, end = chunk * self.chunk_size, (chunk + 1) * self.chunk_size
        bs = spec.block_size
        if spec.kind is GroupKind.MAMBA:
            return GroupChunk(group, chunk, range(0), state_at=end)
        if spec.kind is GroupKind.FULL_ATTENTION:
            return GroupChunk(group, chunk, range(start // bs, end // bs))
        first = max(start, self._window_start(spec, end)) // bs
        return GroupChunk(group, chunk, range(min(first, end // bs), end // bs))

    def stored_tail(self, group: GroupIndex, chunk: ChunkIndex, boundary: int) -> GroupChunk:
        """Contents of the partial-tail entry of `group` ending at `boundary`,
        inside `chunk`: full attention, the chunk's blocks up to the one
        holding token `boundary - 1` (its slots from `boundary` on are zero);
        Mamba, the state at `boundary`. With `chained_tails`, only the
        blocks of the unit before `boundary` (whole blocks: nothing zeroed)."""
        spec = self.groups[group]
        start = chunk * self.chunk_size
        if not start < boundary < start + self.chunk_size:
            raise ValueError(f"a tail boundary {boundary} must lie inside chunk {chunk}")
        if spec.kind is GroupKind.MAMBA:
            return GroupChunk(group, chunk, range(0), state_at=boundary, tail_end=boundary, tail_start=start)
        bs = spec.block_size
        if self.chained_tails:
            assert self.tail_unit is not None
            if boundary % self.tail_unit:
                raise ValueError(f"a tail boundary {boundary} must be a multiple of the unit {self.tail_unit}")
            first = boundary - self.tail_unit
            return GroupChunk(group, chunk, range(first // bs, boundary // bs), tail_end=boundary, tail_start=first)
        return GroupChunk(group, chunk, range(start // bs, -(-boundary // bs)), tail_end=boundary, tail_start=start)

    def tail_parent(self, boundary: int) -> int | None:
        """The boundary of the tail entry the entry ending at `boundary`
        chains from (its header's `parent`), or None where it chains from the
        previous whole chunk (the request root in chunk 0)."""
        if not self.chained_tails:
            return None
        assert self.tail_unit is not None
        prev = boundary - self.tail_unit
        return prev if prev % self.chunk_size else None

    def tail_entries(self, chunk: ChunkIndex, first_token: int, end: int) -> range:
        """Boundaries of the tail entries inside `chunk` that a restore up to
        `end` needs when the KV of tokens before `first_token` is in place
        already (one boundary, `end`, unless `chained_tails`)."""
        if not self.chained_tails:
            return range(end, end + 1)
        assert self.tail_unit is not None
        u = self.tail_unit
        first = max(chunk * self.chunk_size, first_token // u * u) + u
        return range(first, end + 1, u)

    def needed(self, group: GroupIndex, n_chunks: int, computed_tokens: int = 0, tail: int = 0) -> list[GroupChunk]:
        """Entries of `group` a hit of `n_chunks` whole chunks plus `tail`
        tokens needs beyond `computed_tokens` (vLLM's own block-aligned
        prefix-cache hit, already in place)."""
        spec = self.groups[group]
        boundary = n_chunks * self.chunk_size
        if tail:
            end = boundary + tail
            if spec.kind is GroupKind.MAMBA:
                return [self.stored_tail(group, ChunkIndex(n_chunks), end)]
            return [*self.needed(group, n_chunks, computed_tokens),
                    *(self.stored_tail(group, ChunkIndex(n_chunks), b)
                      for b in self.tail_entries(ChunkIndex(n_chunks), computed_tokens, end))]
        if spec.kind is GroupKind.MAMBA:
            return [self.stored(group, ChunkIndex(n_chunks - 1))]
        if spec.kind is GroupKind.FULL_ATTENTION:
            first_token = computed_tokens
        else:
            first_token = max(computed_tokens, self._window_start(spec, boundary))
        if first_token >= boundary:
            return []
        first_chunk = first_token // self.chunk_size
        return [self.stored(group, ChunkIndex(c)) for c in range(first_chunk, n_chunks)]

    def blocks_to_load(self, group: GroupIndex, n_chunks: int, computed_tokens: int, tail: int = 0) -> set[int]:
        """Block indices of `group` a hit restores (Mamba: the state's block).

        The state for boundary N lives in block (N - 1) // block_size of
        vLLM's 'align' block table (the block holding token N - 1, also for a
        boundary inside a block); attention blocks are positional.
        """
        spec = self.groups[group]
        boundary = n_chunks * self.chunk_size + tail
        if spec.kind is GroupKind.MAMBA:
            return {(boundary - 1) // spec.block_size}
        first_block = -(-computed_tokens // spec.block_size)
        out: set[int] = set()
        for gc in self.needed(group, n_chunks, computed_tokens, tail):
            out.update(b for b in gc.blocks if b >= first_block and b < -(-boundary // spec.block_size))
        return out

    def tail_boundary(self, prompt_tokens: int) -> int:
        """The partial-tail boundary of a prompt: the last unit-aligned
        boundary before its last token (a hybrid: where vLLM's scheduler
        stops a prefill and keeps the state; attention only: the longest hit
        vLLM's own prefix cache can give a repeat), or 0 when it is a chunk
        boundary, there is none, or (attention only) a whole-chunk hit of
        the prompt reaches past it (a 512-token prompt hits both chunks)."""
        if self.tail_unit is None or prompt_tokens < 2:
            return 0
        t = (prompt_tokens - 1) // self.tail_unit * self.tail_unit
        if t % self.chunk_size == 0:
            return 0
        if self.full_prompt_hits and t < self.max_hit_chunks(prompt_tokens) * self.chunk_size:
            return 0
        return t

    def state_class(self, boundary: int, prompt_tokens: int, branch_at: int = 0,
                    pre_tail_within: int = 0) -> StateClass:
        """The class of a prompt's recurrent state at `boundary`, by the worth
        model's rule (`offload.planner.worth.state_class`) from this plan's
        tail and partial tail of the prompt; `pre_tail_within` > 0 applies the
        pre-tail what-if (`offload.planner.worth.pre_tail`)."""
        # The last whole-chunk boundary a hit can reach: before the last token, so a prompt of
        # exactly n chunks has its tail at n - 1.
        tail = self.max_hit_chunks(prompt_tokens) * self.chunk_size
        return classify_state(boundary, tail, self.tail_boundary(prompt_tokens), branch_at,
                              pre_tail(tail, prompt_tokens, self.chunk_size, pre_tail_within))

    def entry_class(self, gc: GroupChunk, prompt_tokens: int, branch_at: int = 0,
                    pre_tail_within: int = 0) -> StateClass | None:
        """The class a stored entry is admitted by: a state's (`state_class`),
        an attention entry's (`offload.planner.worth.attention_class`)."""
        if gc.state_at is not None:
            return self.state_class(gc.state_at, prompt_tokens, branch_at, pre_tail_within)
        return attention_class(gc.tail_end is not None, self.has_states)

    def repeat_hit(self, prompt_tokens: int) -> int:
        """Tokens a repeat of a stored prompt restores: its whole chunks (up
        to `max_hit_chunks`), or its tail when that reaches further."""
        return max(self.max_hit_chunks(prompt_tokens) * self.chunk_size, self.tail_boundary(prompt_tokens))

    # ---- lookup -------------------------------------------------------------------

    def max_hit_chunks(self, num_tokens: int, prompt_tokens: int | None = None) -> int:
        """Largest chunk count a request of `num_tokens` tokens, the first
        `prompt_tokens` of them (default: all) its prompt, may hit. Only prompt
        chunks are stored, so a hit never passes the prompt; unless
        `full_prompt_hits`, it also stops before the last token."""
        prompt = num_tokens if prompt_tokens is None else min(num_tokens, prompt_tokens)
        limit = prompt if self.full_prompt_hits else min(prompt, num_tokens - 1)
        return max(0, limit // self.chunk_size)

    def lookup(self, num_tokens: int, present: PresenceProbe, computed_tokens: int = 0,
               prompt_tokens: int | None = None, present_tail: TailProbe | None = None) -> Lookup:
        """Longest restorable hit, in chunks, that extends past `computed_tokens`.

        Full-attention presence is treated as prefix-closed (files are written in
        chunk order and evicted from the tail), so a binary search finds its end
        in O(log chunks) probes. Mamba states and windowed KV exist only at some
        boundaries, so from there the candidate walks down until every group can
        be restored. `chunks` is 0 when no hit beyond `computed_tokens` exists.

        With a `tail_unit` and `present_tail`, a partial tail inside chunk
        `lo` (where the full-attention prefix ends) is tried first, longest
        first: every group's tail entry at that boundary must be stored. With
        `chained_tails` a tail entry is stored only behind its parent (the
        entry one unit earlier), so tails are prefix-closed too: a binary
        search finds the furthest stored boundary in O(log(chunk / unit)) probes.
        """
        max_n = self.max_hit_chunks(num_tokens, prompt_tokens)
        min_n = computed_tokens // self.chunk_size + 1
        tails = self.tail_unit is not None and present_tail is not None
        if max_n < min_n and not tails:
            return Lookup(0, 0)
        start_chunk = computed_tokens // self.chunk_size
        # First chunk index in [start_chunk, max_n) missing from a full group.
        lo, hi = start_chunk, max_n
        if self._full:
            while lo < hi:
                mid = (lo + hi) // 2
                if all(present(g, ChunkIndex(mid)) for g in self._full):
                    lo = mid + 1
                else:
                    hi = mid
        else:
            lo = max_n
        if tails and lo >= start_chunk:
            # Partial tails are probed inside chunk `lo` only, the chunk where
            # the stored full-attention prefix ends: a tail needs every whole
            # chunk before it, and a stored prompt's tail lies in the first
            # chunk it did not fill (repeats and next turns end up here).
            assert present_tail is not None and self.tail_unit is not None
            prompt = num_tokens if prompt_tokens is None else min(num_tokens, prompt_tokens)
            limit = min(prompt, num_tokens - 1)
            start = lo * self.chunk_size
            top = min(limit, start + self.chunk_size - 1) // self.tail_unit * self.tail_unit
            if self.chained_tails:
                ends = self.tail_entries(ChunkIndex(lo), computed_tokens, top)
                # First index in `ends` whose entry is missing from some group.
                a, b = 0, len(ends)
                while a < b:
                    mid = (a + b) // 2
                    if all(present_tail(GroupIndex(g), ends[mid]) for g in range(len(self.groups))):
                        a = mid + 1
                    else:
                        b = mid
                if a:
                    return Lookup(lo, lo, ends[a - 1] - start)
            else:
                for end in range(top, max(start, computed_tokens), -self.tail_unit):
                    if all(present_tail(GroupIndex(g), end) for g in range(len(self.groups))):
                        return Lookup(lo, lo, end - start)
        for n in range(lo, min_n - 1, -1):
            if all(
                present(gc.group, gc.chunk)
                for g in self._other
                for gc in self.needed(g, n, computed_tokens)
            ):
                return Lookup(n, lo if self._full else 0)
        return Lookup(0, lo if self._full else 0)

    def completed_chunks(self, computed_before: int, computed_after: int) -> range:
        """Chunks whose last token was computed in a step that advanced the
        request from `computed_before` to `computed_after` tokens."""
        return range(computed_before // self.chunk_size, computed_after // self.chunk_size)
