"""The host-memory tier's index as pure logic: one arena of frames shared by
every group, the one evictor's order (oldest leaf first, prefix-closed
attention, states as leaves of their own), admission by state class, pins."""

from __future__ import annotations

import pytest

from offload.planner import Admission, GroupKind, GroupSpec, HybridOffloadPlanner, StateClass
from offload.store.arena import CpuLayout
from offload.store.cpu import CpuIndex

MAMBA, FULL, SW = GroupKind.MAMBA, GroupKind.FULL_ATTENTION, GroupKind.SLIDING_WINDOW
HOT, COLD, SKIP = Admission.HOT, Admission.COLD, Admission.SKIP
STATE_PAGE, ATTN_PAGE = 400_000, 262_144  # as on a real hybrid: a state fills one frame, as a chunk's attention does
FRAME = 2 * ATTN_PAGE  # 256-token chunks of 128-token blocks


def k(i: int) -> bytes:
    return i.to_bytes(32, "little")


def hybrid(frames: int, backed=None) -> tuple[HybridOffloadPlanner, CpuIndex]:
    planner = HybridOffloadPlanner([GroupSpec(MAMBA, 128, STATE_PAGE, 2), GroupSpec(FULL, 128, ATTN_PAGE, 2)], 256)
    layout = CpuLayout.plan(planner, frames * FRAME + FRAME - 1)
    assert layout.frames == frames and layout.frame_bytes == FRAME
    assert layout.per_frame(0) == layout.per_frame(1) == 1
    return planner, CpuIndex(planner, layout, backed)


def attention(frames: int, backed=None) -> tuple[HybridOffloadPlanner, CpuIndex]:
    """Two full-attention groups, no state: chains as an attention-only model keeps them."""
    planner = HybridOffloadPlanner([GroupSpec(FULL, 128, ATTN_PAGE, 2), GroupSpec(FULL, 128, ATTN_PAGE, 2)], 256)
    layout = CpuLayout.plan(planner, frames * FRAME)
    assert layout.frames == frames
    return planner, CpuIndex(planner, layout, backed)


def chain(idx: CpuIndex, n: int, first: int = 0, group: int = 1) -> None:
    for i in range(first, first + n):
        assert idx.reserve(group, k(i), k(i - 1) if i > first else None) is not None


def test_frames_fit_the_largest_slot_and_smaller_slots_share_a_frame():
    planner = HybridOffloadPlanner(
        [GroupSpec(SW, 16, 8192, 5, window=100), GroupSpec(FULL, 16, 2048, 1), GroupSpec(MAMBA, 16, 9000, 1)], 256)
    layout = CpuLayout.plan(planner, 10 << 20)
    # SW keeps only the blocks inside its window: tokens [156, 256) -> blocks 9..15, not all 16.
    assert layout.pages_per_slot == ((256 - (256 - 100) // 16 * 16) // 16, 16, 1) == (7, 16, 1)
    assert layout.page_bytes == (8192, 2048, 9000)
    assert layout.frame_bytes == 7 * 8192 and layout.frames == (10 << 20) // (7 * 8192)
    assert [layout.per_frame(g) for g in range(3)] == [1, 1, 7 * 8192 // 9000]
    # A whole chunk takes 1 + 1 + 1/6 frames.
    assert layout.chunks() == int(layout.frames / (2 + 1 / 6))
    assert f"{layout.chunks() * 256} tokens of full-attention KV" in layout.describe(planner)


def test_memory_follows_what_is_admitted_not_a_split_by_group():
    """With every state admitted cold, attention KV takes the frames the
    states leave: the arena holds twice the chunks a fixed split would."""
    _, idx = hybrid(8)
    for c in range(8):
        assert idx.reserve(1, k(c), k(c - 1) if c else None) is not None
        stored = idx.reserve(0, k(c), None, COLD, StateClass.INTERNAL)
        assert (stored is None) == (c == 7), "a cold state takes a free frame or a colder state's, never a chunk's"
    assert all(idx.contains(1, k(c)) for c in range(8)), "8 attention chunks in 8 frames"
    assert not any(idx.contains(0, k(c)) for c in range(8)), "each cold state made room for a chunk"
    u = idx.usage()
    assert u.entries == (0, 8) and u.bytes == (0, 8 * FRAME) and u.capacity_bytes == 8 * FRAME
    assert dict(((c, r), n) for c, r, n in u.state_evictions) == {("internal", "cold"): 7}
    assert u.skipped == 1 and u.no_room == 0, "the last cold state was not admitted: no lack of room"


def test_oldest_leaf_first_keeps_prefixes_closed():
    _, idx = attention(3)
    chain(idx, 3)  # 0 <- 1 <- 2
    assert idx.reserve(1, k(1), k(0)) is None, "stored already"
    # A new chain root: the oldest leaf is k(2) (k(0) and k(1) have children).
    assert idx.reserve(1, k(10), None) is not None
    assert idx.contains(1, k(0)) and idx.contains(1, k(1)) and not idx.contains(1, k(2))
    assert idx.reserve(1, k(11), k(10)) is not None  # now k(1) is the oldest leaf
    assert idx.contains(1, k(0)) and not idx.contains(1, k(1))
    assert idx.usage().evictions == (0, 2)


def test_a_state_is_a_leaf_of_its_own_and_holds_its_chunk():
    """A state may go while its chunk's attention KV stays; the chunk goes
    only after the states at its boundary (no state is ever left orphaned)."""
    _, idx = hybrid(3)
    assert idx.reserve(1, k(0), None) is not None
    assert idx.reserve(0, k(0), None) is not None  # the state at chunk 0's end, hot
    assert idx.reserve(1, k(5), None) is not None  # another root, newer
    assert idx.reserve(1, k(6), None) is not None  # full: the oldest leaf is the state, not its chunk
    assert idx.contains(1, k(0)) and not idx.contains(0, k(0))
    assert idx.reserve(1, k(7), None) is not None  # now chunk 0 is a leaf and the oldest
    assert not idx.contains(1, k(0)) and idx.contains(1, k(5))


def test_cold_states_go_first_oldest_first_and_a_read_makes_one_hot():
    _, idx = hybrid(5)
    chain(idx, 2)
    assert idx.reserve(0, k(0), None, COLD, StateClass.INTERNAL) is not None
    assert idx.reserve(0, k(1), None, COLD, StateClass.INTERNAL) is not None
    assert idx.reserve(0, k(2), None, HOT, StateClass.TAIL) is not None  # 5 frames full
    assert idx.pin(0, k(1)) is not None  # a load reads it: hot from now on
    idx.unpin(0, k(1))
    assert idx.reserve(1, k(9), None) is not None
    assert not idx.contains(0, k(0)) and idx.contains(0, k(1)), "the unread cold state went first"
    assert idx.reserve(1, k(10), k(9)) is not None
    # Then the oldest leaf: chunks 0 and 1 hold children; the tail state was stored before k(1) was read.
    assert not idx.contains(0, k(2)) and idx.contains(0, k(1))
    u = idx.usage()
    assert dict(u.state_hits) == {"internal": 1}
    assert dict(((c, r), n) for c, r, n in u.state_evictions) == {("internal", "cold"): 1, ("tail", "lru"): 1}
    assert {c: (n, b) for c, n, b in u.states if n} == {"internal": (1, STATE_PAGE)}


def test_a_cold_store_of_an_entry_held_does_not_refresh_it_but_a_hot_one_does():
    _, idx = hybrid(3)
    assert idx.reserve(0, k(0), None, HOT, StateClass.TAIL) is not None
    assert idx.reserve(0, k(1), None, HOT, StateClass.TAIL) is not None
    assert idx.reserve(0, k(0), None, COLD, StateClass.INTERNAL) is None  # held: no refresh
    assert idx.reserve(0, k(2), None) is not None
    assert idx.reserve(0, k(3), None) is not None  # evicts the oldest: k(0)
    assert not idx.contains(0, k(0)) and idx.contains(0, k(1))
    assert idx.reserve(0, k(1), None, HOT, StateClass.BRANCH) is None  # held, read as a branch point: refreshed
    assert idx.reserve(0, k(4), None) is not None
    assert idx.contains(0, k(1)) and not idx.contains(0, k(2))


def test_a_skipped_state_takes_nothing():
    _, idx = hybrid(2)
    assert idx.reserve(0, k(0), None, SKIP, StateClass.INTERNAL) is None
    assert not idx.contains(0, k(0)) and idx.usage().skipped == 1 and len(idx.free_frames) == 2


def test_orphans_are_never_stored_in_chained_groups():
    _, idx = hybrid(2)
    assert idx.reserve(1, k(5), k(4)) is None  # parent absent
    assert idx.reserve(0, k(5), k(4)) is not None  # states stand alone


def test_pinned_entries_and_their_ancestors_survive_eviction():
    _, idx = attention(2)
    chain(idx, 2)
    assert idx.pin(1, k(1)) is not None
    assert idx.reserve(1, k(7), None) is None, "everything pinned or needed by a pin: drop the store"
    assert idx.contains(1, k(0)) and idx.contains(1, k(1)) and idx.usage().no_room == 1
    idx.unpin(1, k(1))
    assert idx.reserve(1, k(7), None) is not None


@pytest.mark.parametrize("cold", [False, True])
@pytest.mark.parametrize(("chunks", "hit"), [(3, 3), (8, None)])
def test_lookup_over_the_index_never_reports_an_evicted_entry(cold, chunks, hit):
    planner, idx = hybrid(6)
    keys = [k(i) for i in range(chunks)]
    for c in range(chunks):  # 2 entries a chunk into 6 frames
        idx.reserve(1, keys[c], keys[c - 1] if c else None)
        last = c == chunks - 1
        idx.reserve(0, keys[c], None, COLD if cold and not last else HOT,
                    StateClass.TAIL if last else StateClass.INTERNAL)
    found = planner.lookup(chunks * 256 + 1, lambda g, ch: idx.contains(g, keys[ch]))
    if hit is not None:
        assert found.chunks == hit
    for c in range(found.chunks):
        assert idx.contains(1, keys[c])
    assert found.chunks == 0 or idx.contains(0, keys[found.chunks - 1])


def test_too_small_budget_gives_no_frame():
    planner = HybridOffloadPlanner([GroupSpec(FULL, 128, 262_144, 2)], 256)  # 2 pages a chunk
    assert CpuLayout.plan(planner, 1 << 20).frames == 2
    assert CpuLayout.plan(planner, 1 << 19).frames == 1
    assert CpuLayout.plan(planner, (1 << 19) - 1).frames == 0


def test_slots_are_unique_and_inside_the_arena():
    planner = HybridOffloadPlanner([GroupSpec(MAMBA, 128, 35_072, 2), GroupSpec(FULL, 128, ATTN_PAGE, 2)], 256)
    layout = CpuLayout.plan(planner, 3 * FRAME)
    idx = CpuIndex(planner, layout)
    per = layout.per_frame(0)
    assert per == FRAME // 35_072 and layout.stride == per
    got = [idx.reserve(0, k(i), None) for i in range(2 * per)]
    assert all(p is not None for p in got) and len({p.slot for p in got}) == 2 * per
    assert all(0 <= p.slot < layout.frames * layout.stride for p in got)
    assert idx.reserve(1, k(100), None) is not None, "the third frame"
    assert idx.reserve(1, k(101), k(100)) is not None, "states give up a frame once it is empty"
    assert sum(idx.contains(0, k(i)) for i in range(2 * per)) == per


def test_cpu_data_round_trip_and_slot_identity_check():
    import torch

    from offload.copier import GroupPages, LayerPages
    from offload.keys import ChunkKey
    from offload.store.base import ChunkMiss, HostChunk, Placement
    from offload.store.buffers import BufferPool
    from offload.store.cpu import CpuData
    from offload.store.format import ChunkHeader

    num_blocks = 8
    kv = torch.randint(-100, 100, (num_blocks, 4, 16, 8), dtype=torch.int16)
    pages = GroupPages([LayerPages.from_tensor(kv, num_blocks)], num_blocks, kv.device)
    planner = HybridOffloadPlanner([GroupSpec(FULL, 16, pages.page_bytes, 1)], 32)
    data = CpuData(CpuLayout.plan(planner, 4 * 2 * pages.page_bytes), kv.device)

    def header(key: int) -> ChunkHeader:
        return ChunkHeader(b"\0" * 32, ChunkKey(k(key)), 0, FULL, 0, 32, 2, pages.page_bytes)

    expected = kv[[3, 5]].clone()
    pages.gather([3, 5], out=data.gather_target(header(1), Placement(2)))
    data.gathered(header(1), Placement(2))
    kv[[6, 7]] = 0
    pool = BufferPool()
    pages.scatter(data.get(header(1), Placement(2), pool).payload, 2, [(0, 6), (1, 7)])
    assert torch.equal(kv[[6, 7]], expected)
    with pytest.raises(ChunkMiss):  # the slot holds key 1, not key 9
        data.get(header(9), Placement(2), pool)
    with pytest.raises(ChunkMiss):  # never stored
        data.get(header(1), Placement(0), pool)
    # A promotion puts bytes read from a tier below into a slot.
    data.put(header(4), HostChunk(expected.reshape(-1).view(torch.uint8)), Placement(0))
    assert torch.equal(data.get(header(4), Placement(0), pool).payload, expected.reshape(-1).view(torch.uint8))


def test_in_a_stack_an_only_copy_is_never_evicted():
    """`backed` (the tiers below hold the entry) gates eviction: an entry whose
    write-through has not landed yet stays; once it has, LRU order resumes."""
    below: set[tuple[int, bytes]] = set()
    _, idx = hybrid(3, backed=lambda g, key: (g, key) in below)
    assert idx.reserve(0, k(1), None) is not None and idx.reserve(0, k(2), None) is not None
    assert idx.reserve(1, k(10), None) is not None
    assert idx.reserve(0, k(3), None) is None, "every entry is an only copy: the store is skipped"
    assert idx.usage().no_room == 1 and idx.contains(0, k(1)) and idx.contains(0, k(2))
    below.add((0, k(2)))  # k(2)'s file landed; k(1) is older but still an only copy
    assert idx.reserve(0, k(3), None) is not None
    assert idx.contains(0, k(1)) and not idx.contains(0, k(2)) and idx.contains(0, k(3))
    # A chain's entry goes only once it is a leaf and backed.
    below.update({(0, k(1)), (0, k(3))})
    assert idx.reserve(1, k(11), k(10)) is not None  # took k(1)'s frame
    below.add((1, k(10)))
    assert idx.reserve(1, k(20), None) is not None  # took k(3)'s frame
    assert idx.reserve(1, k(21), k(20)) is None, "k(10) has a child, k(11) and k(20) are only copies"
    below.add((1, k(11)))
    assert idx.reserve(1, k(21), k(20)) is not None and not idx.contains(1, k(11)) and idx.contains(1, k(10))


def test_an_only_copy_whose_write_below_was_dropped_is_evicted_like_any_other():
    """The worker reports a dropped write to the tier below (`copy_below_dropped`):
    that entry will never be backed, so keeping it from eviction would hold its
    frame until a restart."""
    _, idx = attention(2, backed=lambda g, key: False)
    chain(idx, 2, first=1)
    assert idx.reserve(1, k(3), None) is None, "only copies whose writes may still land"
    idx.copy_below_dropped(1, k(1))
    assert idx.reserve(1, k(3), None) is None, "k(1) has a child, and k(2)'s write may still land"
    idx.copy_below_dropped(1, k(2))
    assert idx.reserve(1, k(3), None) is not None
    assert idx.contains(1, k(1)) and not idx.contains(1, k(2)) and idx.usage().evictions == (0, 1)


def test_an_entry_whose_store_was_dropped_leaves_with_its_chain_once_no_load_holds_its_slot():
    """`store_dropped` (the worker reported its store or promotion dropped):
    the entry and the chain behind it are offered no more at once; a slot a
    load still reads stays taken until that load unpins it, so no store can
    overwrite it meanwhile. A failed load (`forget`) leaves host memory as it is."""
    _, idx = attention(3)
    chain(idx, 3)  # 0 <- 1 <- 2
    assert idx.pin(1, k(2)) is not None
    idx.forget(1, k(1))
    assert idx.contains(1, k(1)) and idx.contains(1, k(2))
    idx.store_dropped(1, k(1))
    assert idx.contains(1, k(0)) and not idx.contains(1, k(1)) and not idx.contains(1, k(2))
    assert idx.pin(1, k(1)) is None
    assert idx.reserve(1, k(9), k(1)) is None, "a dropped entry is no parent"
    assert len(idx.free_frames) == 1, "k(1) freed; k(2) still read by its load"
    idx.unpin(1, k(2))
    assert len(idx.free_frames) == 2 and list(idx.entries) == [(1, k(0))]
    assert idx.reserve(1, k(1), k(0)) is not None and idx.contains(1, k(1)), "stored again"


def test_a_promotion_whose_load_failed_is_forgotten_with_what_chained_behind_it():
    _, idx = attention(3)
    assert idx.reserve_promotion(1, k(0), None) is not None
    assert not idx.contains(1, k(0)), "offered only once its bytes landed"
    assert idx.reserve(1, k(1), k(0)) is not None  # a store chained behind it meanwhile
    idx.promotion_done(1, k(0), landed=False)
    assert not idx.entries and len(idx.free_frames) == 3
    assert idx.reserve_promotion(1, k(0), None) is not None
    idx.promotion_done(1, k(0), landed=True)
    assert idx.contains(1, k(0))
