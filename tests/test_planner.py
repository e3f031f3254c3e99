"""HybridOffloadPlanner as pure logic, on the group shapes of real hybrid models."""

from __future__ import annotations

import math
import random
import zlib

import pytest

from offload.planner import ChunkSizeError, GroupKind, GroupSpec, HybridOffloadPlanner

MAMBA, FULL, SW, CL = (
    GroupKind.MAMBA,
    GroupKind.FULL_ATTENTION,
    GroupKind.SLIDING_WINDOW,
    GroupKind.CHUNKED_LOCAL,
)


def qwen35_like(bs: int = 528) -> list[GroupSpec]:
    # 18 GDN + 6 attention layers: vLLM groups them 6 layers per group.
    return [GroupSpec(MAMBA, bs, 6 * 1_000_000, 6) for _ in range(3)] + [GroupSpec(FULL, bs, 6 * 270_336, 6)]


def nemotron_h_like(bs: int = 256) -> list[GroupSpec]:
    return [GroupSpec(FULL, bs, 300_000, 1)] + [GroupSpec(MAMBA, bs, 900_000, 1) for _ in range(3)]


def gemma3_like(bs: int = 16, window: int = 512) -> list[GroupSpec]:
    return [GroupSpec(SW, bs, 5 * 8192, 5, window=window), GroupSpec(FULL, bs, 8192, 1)]


def pure_attention(bs: int = 16) -> list[GroupSpec]:
    return [GroupSpec(FULL, bs, 65536, 2)]


ALL_SHAPES = {
    "qwen35": qwen35_like(),
    "nemotron_h": nemotron_h_like(),
    "gemma3": gemma3_like(),
    "llama": pure_attention(),
}


def brute_force(p: HybridOffloadPlanner, num_tokens: int, present, computed: int) -> int:
    """The definition, probing everything: largest n whose every needed file exists."""
    best = 0
    for n in range(computed // p.chunk_size + 1, p.max_hit_chunks(num_tokens) + 1):
        if all(present(gc.group, gc.chunk) for g in range(len(p.groups)) for gc in p.needed(g, n, computed)):
            best = n
    return best


@pytest.mark.parametrize(
    "groups,expected",
    [(qwen35_like(), 528), (nemotron_h_like(), 256), (gemma3_like(), 256), (pure_attention(), 256),
     ([GroupSpec(FULL, 96, 1, 1), GroupSpec(MAMBA, 64, 1, 1)], 192),
     ([GroupSpec(FULL, 16, 1, 1)], 256), ([GroupSpec(FULL, 128, 1, 1), GroupSpec(MAMBA, 128, 1, 1)], 128)],
)
def test_default_chunk_size(groups, expected):
    """Hybrids: the block-size LCM (every boundary vLLM can checkpoint);
    attention only: the smallest multiple of it >= 256 tokens."""
    assert HybridOffloadPlanner(groups).chunk_size == expected


def test_invalid_chunk_size_names_sizes_and_a_valid_value():
    with pytest.raises(ChunkSizeError) as e:
        HybridOffloadPlanner(qwen35_like(), chunk_size=256)
    msg = str(e.value)
    assert "hybrid_chunk_size=256" in msg and "mamba: 528" in msg and "full_attention: 528" in msg
    assert "e.g. 528" in msg
    for bad in (0, -256, 100):
        with pytest.raises(ChunkSizeError):
            HybridOffloadPlanner(pure_attention(), chunk_size=bad)


def llama4_like(bs: int = 16) -> list[GroupSpec]:
    return [GroupSpec(CL, bs, 3 * 8192, 3, window=256), GroupSpec(FULL, bs, 8192, 1)]


@pytest.mark.parametrize("name", [*ALL_SHAPES, "llama4"])
def test_full_presence_hits_largest_aligned_prefix(name):
    """With a Mamba, chunked-local or sliding-window group a hit stops below
    the last token (planner.full_prompt_hits says why). Full attention only:
    a chunk-aligned prompt hits whole and vLLM computes its last token again."""
    p = HybridOffloadPlanner(ALL_SHAPES[name] if name in ALL_SHAPES else llama4_like())
    c = p.chunk_size
    stops_short = name != "llama"
    assert p.full_prompt_hits is not stops_short
    for num_tokens in (1, c, c + 1, 5 * c, 5 * c + 1, 5 * c + 7):
        n = p.lookup(num_tokens, lambda g, ch: True).chunks
        if stops_short:
            assert n * c <= num_tokens - 1
            assert n == (num_tokens - 1) // c
        else:
            assert n == num_tokens // c


@pytest.mark.parametrize("name", list(ALL_SHAPES))
def test_hits_never_pass_the_prompt(name):
    """A request resumed after preemption has sampled tokens past its prompt;
    only prompt chunks are stored, so the hit stays within the prompt."""
    p = HybridOffloadPlanner(ALL_SHAPES[name])
    c = p.chunk_size
    for prompt in (c - 1, c, 3 * c, 3 * c + 5):
        for extra in (1, 2, c):
            n = p.lookup(prompt + extra, lambda g, ch: True, prompt_tokens=prompt).chunks
            assert n == prompt // c, (prompt, extra)


def test_qwen35_hit_needs_every_mamba_group_at_exact_boundary():
    p = HybridOffloadPlanner(qwen35_like())
    # All attention chunks exist; group 1's state is missing at boundary 10,
    # group 2's at boundary 9: the hit falls to 8 chunks.
    missing = {(1, 9), (2, 8)}
    n = p.lookup(10 * p.chunk_size + 1, lambda g, ch: (g, ch) not in missing).chunks
    assert n == 8
    # Attention KV alone is never a hit.
    assert p.lookup(10 * p.chunk_size + 1, lambda g, ch: g == 3).chunks == 0


def test_nemotron_missing_attention_chunk_caps_the_hit():
    p = HybridOffloadPlanner(nemotron_h_like())
    n = p.lookup(20 * p.chunk_size, lambda g, ch: not (g == 0 and ch >= 4)).chunks
    assert n == 4


def test_gemma3_sliding_window_stores_only_the_window_and_needs_only_it():
    groups = gemma3_like(bs=16, window=100)
    p = HybridOffloadPlanner(groups, chunk_size=256)
    stored = p.stored(0, 3)  # chunk [768, 1024): window of 1024 starts at 924 -> block 57
    assert stored.blocks == range(924 // 16, 64)
    assert p.stored(1, 3).blocks == range(48, 64)
    # A hit at 4 chunks needs SW chunk 3 only; SW chunks 0..2 may be missing.
    assert [gc.chunk for gc in p.needed(0, 4)] == [3]
    present = lambda g, ch: g == 1 or ch == 3
    assert p.lookup(4 * 256 + 1, present).chunks == 4
    # Without the window chunk the hit drops to a boundary whose window exists.
    assert p.lookup(4 * 256 + 1, lambda g, ch: g == 1 or ch == 1).chunks == 2


def test_sliding_window_wider_than_a_chunk_spans_chunks():
    p = HybridOffloadPlanner(gemma3_like(bs=16, window=600), chunk_size=256)
    assert [gc.chunk for gc in p.needed(0, 4)] == [1, 2, 3]  # window [424, 1024)
    assert p.stored(0, 1).blocks == range(16, 32)  # all of [256, 512): inside 1024's window


def test_chunked_local_needs_nothing_at_local_chunk_edge():
    p = HybridOffloadPlanner([GroupSpec(CL, 16, 1, 1, window=512), GroupSpec(FULL, 16, 1, 1)], chunk_size=256)
    assert p.needed(0, 2) == []  # boundary 512 starts a new local chunk
    assert [gc.chunk for gc in p.needed(0, 3)] == [2]  # [512, 768)


def test_pure_attention_hits_every_chunk_and_respects_computed_prefix():
    p = HybridOffloadPlanner(pure_attention(), chunk_size=64)
    assert p.lookup(1000, lambda g, ch: ch < 9).chunks == 9
    # vLLM already holds 3 chunks + 1 block: hit must go past it.
    assert p.lookup(1000, lambda g, ch: ch < 9, computed_tokens=3 * 64 + 16).chunks == 9
    assert p.lookup(1000, lambda g, ch: ch < 3, computed_tokens=3 * 64).chunks == 0
    assert p.blocks_to_load(0, 5, computed_tokens=3 * 64 + 16) == set(range(13, 20))


def test_mamba_state_block_is_last_block_of_hit():
    p = HybridOffloadPlanner(nemotron_h_like(bs=128), chunk_size=256)
    assert p.blocks_to_load(1, 3, computed_tokens=256) == {5}
    assert p.blocks_to_load(0, 3, computed_tokens=256) == {2, 3, 4, 5}


@pytest.mark.parametrize("name", list(ALL_SHAPES))
def test_lookup_equals_brute_force_on_random_stores(name):
    p = HybridOffloadPlanner(ALL_SHAPES[name])
    rng = random.Random(zlib.crc32(name.encode()))  # hash(str) varies with PYTHONHASHSEED
    for _ in range(300):
        chunks = rng.randint(0, 40)
        num_tokens = chunks * p.chunk_size + rng.randint(0, p.chunk_size)
        full_end = rng.randint(0, chunks)  # full attention prefix-closed
        other = {(g, c) for g in range(len(p.groups)) for c in range(chunks) if rng.random() < 0.7}

        def present(g, ch, full_end=full_end, other=other):
            if p.groups[g].kind is FULL:
                return ch < full_end
            return (g, ch) in other

        computed = rng.choice([0, 0, rng.randint(0, max(0, num_tokens - 1)) // 16 * 16])
        assert p.lookup(num_tokens, present, computed).chunks == brute_force(p, num_tokens, present, computed)


def test_lookup_probe_count_is_logarithmic():
    p = HybridOffloadPlanner(nemotron_h_like(bs=256), chunk_size=256)
    chunks = 512  # a 128K-token prompt
    calls = 0

    def present(g, ch):
        nonlocal calls
        calls += 1
        return ch < 300

    n = p.lookup(chunks * 256 + 1, present).chunks
    assert n == 300
    # One full-attention group: binary search, then the 3 Mamba states at the candidate.
    assert calls <= math.ceil(math.log2(chunks)) + 1 + 3


def test_completed_chunks():
    p = HybridOffloadPlanner(pure_attention(), chunk_size=256)
    assert list(p.completed_chunks(0, 640)) == [0, 1]
    assert list(p.completed_chunks(256, 512)) == [1]
    assert list(p.completed_chunks(300, 500)) == []


def test_group_spec_validation():
    with pytest.raises(ValueError):
        GroupSpec(SW, 16, 1, 1)
    with pytest.raises(ValueError):
        GroupSpec(FULL, 16, 1, 1, window=4)
    with pytest.raises(ValueError):
        GroupSpec(FULL, 0, 1, 1)
    assert GroupKind.FULL_ATTENTION.grows_with_sequence and not GroupKind.MAMBA.grows_with_sequence


# ---- partial tails (vLLM's prefix-match unit) ----------------------------------------------------


def test_tail_unit_is_used_only_where_vllm_can_hit_inside_a_chunk():
    assert HybridOffloadPlanner(qwen35_like(1152), tail_unit=64).tail_unit == 64
    assert HybridOffloadPlanner(qwen35_like(1152), tail_unit=1152).tail_unit is None  # the chunk itself
    assert HybridOffloadPlanner(qwen35_like(544), tail_unit=64).tail_unit is None  # 544 % 64: not a divisor
    assert HybridOffloadPlanner(pure_attention(), tail_unit=8).tail_unit is None  # no Mamba state to place
    windowed = [*gemma3_like(), GroupSpec(MAMBA, 16, 100, 1)]
    assert HybridOffloadPlanner(windowed, tail_unit=8).tail_unit is None  # windowed groups: chunk boundaries only


def test_tail_boundary_is_vllms_prompt_checkpoint():
    p = HybridOffloadPlanner(qwen35_like(1152), tail_unit=64)
    assert p.tail_boundary(3000) == 2944  # (3000 - 1) // 64 * 64, inside chunk 2
    assert p.tail_boundary(3120) == 3072
    assert p.tail_boundary(2305) == 0  # 2304 is a chunk boundary: a whole-chunk hit
    assert p.tail_boundary(40) == 0  # no unit before the last token
    assert HybridOffloadPlanner(qwen35_like(1152)).tail_boundary(3000) == 0


def test_state_classes_follow_what_a_hit_of_the_prompt_can_reach():
    from offload.planner import StateClass

    p = HybridOffloadPlanner(qwen35_like(1152), tail_unit=64)
    # 3000 tokens: chunks end at 1152 and 2304 (its tail), the partial tail at 2944.
    assert [p.state_class(b, 3000) for b in (1152, 2304, 2944)] == [
        StateClass.INTERNAL, StateClass.TAIL, StateClass.PARTIAL]
    assert p.state_class(1152, 3000, branch_at=1152) is StateClass.BRANCH
    # Exactly three chunks: a hit stops before the last token, so the tail is the end of the
    # second chunk and the partial tail the last unit boundary before the end.
    assert [p.state_class(b, 3456) for b in (1152, 2304, 3392)] == [
        StateClass.INTERNAL, StateClass.TAIL, StateClass.PARTIAL]
    # The attention half of the partial tail is admitted with its state; a chunk's attention is not a state.
    attn = next(i for i, g in enumerate(p.groups) if g.kind is GroupKind.FULL_ATTENTION)
    assert p.entry_class(p.stored_tail(attn, 2, 2944), 3000) is StateClass.PARTIAL
    assert p.entry_class(p.stored(attn, 1), 3000) is None


def test_the_worth_model_orders_cold_below_hot_and_a_hit_refreshes_it():
    from offload.planner.worth import (
        Admission,
        StatePolicy,
        cold_after,
        cold_classes,
        is_cold,
        may_displace,
        refreshes,
        tick_rank,
        time_rank,
    )

    # Every cold rank below every hot one, oldest cold first, on both clocks.
    assert tick_rank(10**9, True) < tick_rank(0, False) and tick_rank(1, True) < tick_rank(2, True)
    now = 1.75e9  # seconds since the epoch: the file tier's recencies
    assert time_rank(now + 10**6, True) < time_rank(0.0, False)
    # The ledger keeps milliseconds; cold files a millisecond apart keep their order.
    assert time_rank(now, True) < time_rank(now + 0.001, True)
    # A cold entry takes only a free slot or another cold one's; a hot one takes any.
    assert not may_displace(Admission.COLD, False) and may_displace(Admission.COLD, True)
    assert may_displace(Admission.HOT, False)
    # A hit makes anything hot; stored again, only a hot admission does.
    assert refreshes() and not cold_after(True)
    assert cold_after(True, Admission.COLD) and cold_after(True, Admission.SKIP) and not cold_after(True, Admission.HOT)
    assert not cold_after(False, Admission.COLD)
    assert is_cold(True, read_since=False) and not is_cold(True, read_since=True) and not is_cold(False, False)
    # Cold evictions happen only under by_use.
    assert cold_classes(StatePolicy.ALL) == () and cold_classes(StatePolicy.TAILS) == ()
    assert {c.value for c in cold_classes()} == {c.value for c in cold_classes(StatePolicy.BY_USE)} == {
        "internal", "partial"}


def test_the_pre_tail_what_if_moves_the_hot_state_one_chunk_back_only_near_the_end():
    from offload.planner import StateClass

    p = HybridOffloadPlanner(qwen35_like(1152), tail_unit=64)
    # 2340 tokens: the tail at 2304 lies 36 tokens before the end, within one 64-token unit.
    assert [p.state_class(b, 2340, pre_tail_within=64) for b in (1152, 2304)] == [
        StateClass.TAIL, StateClass.INTERNAL]
    assert [p.state_class(b, 2340) for b in (1152, 2304)] == [StateClass.INTERNAL, StateClass.TAIL]
    # 3000 tokens: the tail lies 696 tokens before the end; the rule keeps it, and the partial tail.
    assert [p.state_class(b, 3000, pre_tail_within=64) for b in (1152, 2304, 2944)] == [
        StateClass.INTERNAL, StateClass.TAIL, StateClass.PARTIAL]
    # A tail one chunk in has no boundary before it to move to.
    assert p.state_class(1152, 1170, pre_tail_within=64) is StateClass.TAIL


def test_lookup_prefers_the_longest_tail_whose_every_group_is_stored():
    groups = qwen35_like(1152)
    p = HybridOffloadPlanner(groups, tail_unit=64)
    full = {(g, c) for g in range(len(groups)) if groups[g].kind is FULL for c in (0, 1)}
    tails = {(g, 2944) for g in range(len(groups))}
    tails |= {(g, 2368) for g in range(len(groups)) if g != 1}  # one GDN group lacks the 2368 state

    def lookup(n, computed=0, tails=tails):
        return p.lookup(n, lambda g, c: (g, c) in full, computed, present_tail=lambda g, t: (g, t) in tails)

    hit = lookup(3120)  # the next turn: chunks 0-1 whole, then the tail at 2944
    assert (hit.chunks, hit.tail, hit.chunks * 1152 + hit.tail) == (2, 640, 2944)
    assert lookup(3000).tail == 640  # the repeat: 2944 = its own tail
    assert lookup(2944 + 1).tail == 640 and lookup(2944).tail == 0  # a hit stops before the last token
    assert lookup(3120, tails={(g, 2944) for g in range(len(groups)) if g != 3}).tail == 0  # attention's missing
    # No tail stored: no Mamba state at 2304 either, so nothing is restorable.
    assert (lookup(3120, tails=set()).chunks, lookup(3120, tails=set()).tail) == (0, 0)
    assert lookup(3120, computed=2944).chunks == 0  # vLLM's own hit covers it already
    # Needed entries: the whole chunks past vLLM's own hit, then each group's tail entry.
    needed = p.needed(3, 2, 1152, tail=640)
    assert [(gc.chunk, gc.tail_end, list(gc.blocks)) for gc in needed] == [(1, None, [1]), (2, 2944, [2])]
    assert p.blocks_to_load(0, 2, 1152, tail=640) == {2}  # the state at 2944 sits in the block holding 2943
    assert p.needed(0, 2, 0, tail=640)[0].state_at == 2944


# ---- attention only: tails of whole blocks behind the last whole chunk ---------------------------


def test_attention_only_tail_unit_is_whole_blocks():
    """vLLM's own cache hits an attention-only model at every block (its
    cache-hit alignment is the block, or the blocks' LCM): a tail is whole
    blocks, so a unit finer than a block is refused, and windowed groups
    keep chunk-boundary hits."""
    assert HybridOffloadPlanner(pure_attention(16), tail_unit=16).tail_unit == 16
    assert HybridOffloadPlanner(pure_attention(128), tail_unit=128).tail_unit == 128  # vLLM-CPU: chunk 256
    assert HybridOffloadPlanner(pure_attention(16), tail_unit=8).tail_unit is None  # inside a block
    assert HybridOffloadPlanner(pure_attention(16), tail_unit=256).tail_unit is None  # the chunk itself
    assert HybridOffloadPlanner(pure_attention(16), tail_unit=None).tail_unit is None
    two = [GroupSpec(FULL, 16, 1, 1), GroupSpec(FULL, 32, 1, 1)]
    assert HybridOffloadPlanner(two, tail_unit=32).tail_unit == 32
    assert HybridOffloadPlanner(two, tail_unit=16).tail_unit is None  # not whole blocks of the 32-token group
    assert HybridOffloadPlanner(gemma3_like(), tail_unit=16).tail_unit is None


def test_attention_only_tail_boundary_is_the_last_block_before_the_last_token():
    p = HybridOffloadPlanner(pure_attention(16), tail_unit=16)
    c = p.chunk_size
    for n in range(1, 4 * c):
        t, vllm_hit = p.tail_boundary(n), (n - 1) // 16 * 16  # vLLM's own longest hit on a repeat
        whole = n // c * c  # attention only: a stored prompt's whole chunks hit in full
        if t:
            assert t == vllm_hit and whole < t < n and t % c, n  # past the whole chunks, inside a chunk
        else:
            assert vllm_hit % c == 0 or vllm_hit < whole, n  # a chunk boundary, or the chunks reach further
        assert p.repeat_hit(n) == max(whole, t)
    assert (p.tail_boundary(600), p.repeat_hit(600)) == (592, 592)  # 512 without a tail
    assert (p.tail_boundary(200), p.repeat_hit(200)) == (192, 192)  # shorter than a chunk: nothing without
    assert (p.tail_boundary(512), p.repeat_hit(512)) == (0, 512)  # two whole chunks: no tail file (not 496)
    assert p.tail_boundary(513) == 0  # 512 is a chunk boundary
    cpu = HybridOffloadPlanner(pure_attention(128), tail_unit=128)
    assert [cpu.repeat_hit(n) for n in (400, 390, 600, 768, 1100)] == [384, 384, 512, 768, 1024]


class PrefixStore:
    """An attention-only tier as the planner sees it, by prefix: a stored
    prompt's whole chunks and its chained tail entries (the entry ending at
    b is the prefix up to b, as its key is). Counts the lookup's tail probes."""

    def __init__(self, p: HybridOffloadPlanner) -> None:
        self.p, self.chunks, self.tails, self.probes = p, set(), set(), 0

    def store(self, toks: list[int]) -> int:
        """Store a prompt's entries; returns how many it added."""
        p, c, before = self.p, self.p.chunk_size, len(self.chunks) + len(self.tails)
        self.chunks |= {tuple(toks[:(k + 1) * c]) for k in range(p.max_hit_chunks(len(toks)))}
        t = p.tail_boundary(len(toks))
        if t:
            self.tails |= {tuple(toks[:b]) for b in p.tail_entries(t // c, t // c * c, t)}
        return len(self.chunks) + len(self.tails) - before

    def present_tail(self, toks: list[int], b: int) -> bool:
        self.probes += 1
        return tuple(toks[:b]) in self.tails

    def lookup(self, toks: list[int], computed: int = 0) -> int:
        c = self.p.chunk_size
        hit = self.p.lookup(len(toks), lambda g, ch: tuple(toks[:(ch + 1) * c]) in self.chunks, computed,
                            present_tail=lambda g, b: self.present_tail(toks, b))
        return hit.chunks * c + hit.tail


def tokens_sharing(base: list[int], shared: int, n: int, seed: int) -> list[int]:
    """An n-token prompt whose first `shared` tokens are base's and whose next one differs."""
    rng = random.Random(seed)
    out = base[:shared] + [rng.randrange(2000, 3000) for _ in range(n - shared)]
    assert n <= shared or out[shared] != base[shared]
    return out


def test_attention_only_tail_is_a_chain_of_one_unit_entries():
    """The tail region [c*C, T) is stored as entries of one unit each, the
    entry ending at b holding only the blocks of [b - unit, b) and chaining
    from the one ending at b - unit (the first from chunk c - 1)."""
    p = HybridOffloadPlanner(pure_attention(16), tail_unit=16)
    assert p.chained_tails and not HybridOffloadPlanner(qwen35_like(1152), tail_unit=64).chained_tails
    gc = p.stored_tail(0, 2, 544)
    assert (list(gc.blocks), gc.tail_start, gc.tail_end) == ([33], 528, 544)
    assert p.tail_parent(528) is None and p.tail_parent(544) == 528 and p.tail_parent(16) is None
    assert list(p.tail_entries(2, 512, 592)) == [528, 544, 560, 576, 592]
    assert list(p.tail_entries(2, 530, 592)) == [544, 560, 576, 592]  # past vLLM's own hit only
    with pytest.raises(ValueError):
        p.stored_tail(0, 2, 540)  # not a unit boundary
    # Several groups: the unit is the blocks' LCM, each entry whole blocks of every group.
    two = HybridOffloadPlanner([GroupSpec(FULL, 16, 1, 1), GroupSpec(FULL, 32, 1, 1)], tail_unit=32)
    assert [list(two.stored_tail(g, 1, 320).blocks) for g in (0, 1)] == [[18, 19], [9]]
    # A hybrid's tail stays one entry from its chunk's start.
    hy = HybridOffloadPlanner(qwen35_like(1152), tail_unit=64)
    assert (list(hy.stored_tail(3, 2, 2944).blocks), hy.stored_tail(3, 2, 2944).tail_start) == ([2], 2304)
    assert hy.tail_parent(2944) is None


def test_attention_only_entries_hold_every_block_once_and_a_bounded_number_per_prompt():
    p = HybridOffloadPlanner(pure_attention(16), tail_unit=16)
    c = p.chunk_size
    for n in (2, 17, 200, 257, 600, 1000, 10_100):
        t = p.tail_boundary(n)
        entries = [p.stored(0, k) for k in range(p.max_hit_chunks(n))]
        if t:
            entries += [p.stored_tail(0, t // c, b) for b in p.tail_entries(t // c, t // c * c, t)]
        blocks = [b for e in entries for b in e.blocks]
        assert sorted(blocks) == list(range(p.repeat_hit(n) // 16)), n  # every block once, none twice
        assert len(entries) - p.max_hit_chunks(n) <= c // 16 - 1, n  # at most C/B - 1 tail entries
    store = PrefixStore(p)
    assert store.store(list(range(600))) == 2 + 5  # two chunks and entries ending at 528 ... 592


def test_attention_only_shared_prefix_hits_at_every_block_vllms_own_cache_hits():
    """A (600 tokens, 16-token blocks, 256-token chunks) stored; a prompt
    sharing only a prefix of it restores the last block boundary of the
    shared prefix, as vLLM's own cache does (min(shared // B * B, its own
    (len - 1) // B * B)), whole chunks and tail entries alike."""
    p = HybridOffloadPlanner(pure_attention(16), tail_unit=16)
    rng = random.Random(5)
    a = [rng.randrange(2, 1000) for _ in range(600)]
    store = PrefixStore(p)
    store.store(a)

    def vllm(b: list[int], shared: int) -> int:
        return min(shared // 16 * 16, (len(b) - 1) // 16 * 16)

    for shared, n, expected in ((560, 700, 560), (520, 700, 512), (599, 700, 592), (550, 550, 544),
                                (560, 565, 560), (600, 600, 592), (300, 700, 256), (10, 700, 0)):
        b = tokens_sharing(a, shared, n, seed=shared)
        assert store.lookup(b) == expected, (shared, n)
        if shared > 512:  # inside A's tail region: what vLLM's own cache hits
            assert expected == vllm(b, shared), (shared, n)
    # O(log) probes: a binary search over the chunk's 15 boundaries, per lookup.
    store.probes = 0
    assert store.lookup(tokens_sharing(a, 560, 700, seed=1)) == 560
    assert store.probes <= math.ceil(math.log2(256 // 16)) + 1
    # vLLM's own cache holds 528 of B: only the entries past it are probed and needed.
    b = tokens_sharing(a, 560, 700, seed=2)
    assert store.lookup(b, computed=528) == 560 and store.lookup(b, computed=560) == 0
    needed = p.needed(0, 2, 528, tail=48)
    assert [(gc.chunk, gc.tail_start, gc.tail_end, list(gc.blocks)) for gc in needed] == \
        [(2, 528, 544, [33]), (2, 544, 560, [34])]
    # From vLLM's own hit of 384: chunk 1's blocks past it, then the entries ending at 528, 544, 560.
    needed = p.needed(0, 2, 384, tail=48)
    assert [(gc.chunk, gc.tail_end, list(gc.blocks)) for gc in needed] == \
        [(1, None, list(range(16, 32))), (2, 528, [32]), (2, 544, [33]), (2, 560, [34])]
    assert p.blocks_to_load(0, 2, 384, tail=48) == set(range(24, 35))
    # The tail needs its chunks: never reported without chunk 1.
    store.chunks.discard(tuple(a[:512]))
    assert store.lookup(tokens_sharing(a, 560, 700, seed=3)) == 256


def test_attention_only_prompt_shorter_than_a_chunk_and_its_next_turn():
    p = HybridOffloadPlanner(pure_attention(16), tail_unit=16)
    rng = random.Random(6)
    a = [rng.randrange(2, 1000) for _ in range(200)]
    store = PrefixStore(p)
    assert store.store(a) == 12  # entries ending at 16, 32, ..., 192; no chunk
    assert store.lookup(tokens_sharing(a, 150, 300, seed=1)) == 144
    assert store.lookup(a) == 192  # the repeat
    turn = a + [rng.randrange(2, 1000) for _ in range(150)]  # 350 tokens: chunk 0 whole, then its own tail
    assert store.lookup(turn) == 192  # the earlier prompt's entries, inside chunk 0
    assert store.store(turn) == 1 + (349 // 16 * 16 - 256) // 16  # chunk 0 and its own tail entries
    assert store.lookup(tokens_sharing(turn, 300, 400, seed=2)) == 288

