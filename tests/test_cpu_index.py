"""The host-memory tier's index as pure logic: slots, LRU, prefix-closed eviction, pins."""

from __future__ import annotations

import pytest

from offload.planner import GroupKind, GroupSpec, HybridOffloadPlanner
from offload.store.cpu import CpuIndex, CpuLayout

MAMBA, FULL, SW = GroupKind.MAMBA, GroupKind.FULL_ATTENTION, GroupKind.SLIDING_WINDOW


def k(i: int) -> bytes:
    return i.to_bytes(32, "little")


def hybrid(slots: int) -> tuple[HybridOffloadPlanner, CpuIndex]:
    planner = HybridOffloadPlanner([GroupSpec(MAMBA, 128, 35_072, 2), GroupSpec(FULL, 128, 262_144, 2)], 256)
    layout = CpuLayout.plan(planner, slots * (35_072 + 2 * 262_144))
    assert layout.slots == slots
    return planner, CpuIndex(planner, layout)


def test_pools_use_natural_page_sizes_and_window_needs():
    planner = HybridOffloadPlanner(
        [GroupSpec(SW, 16, 8192, 5, window=100), GroupSpec(FULL, 16, 2048, 1), GroupSpec(MAMBA, 16, 9000, 1)], 256)
    layout = CpuLayout.plan(planner, 10 << 20)
    # SW keeps only the blocks inside its window: tokens [156, 256) -> blocks 9..15, not all 16.
    assert layout.pages_per_slot == ((256 - (256 - 100) // 16 * 16) // 16, 16, 1) == (7, 16, 1)
    assert layout.page_bytes == (8192, 2048, 9000)
    assert layout.slots == (10 << 20) // (7 * 8192 + 16 * 2048 + 9000)
    assert "tokens of full-attention KV" in layout.describe(planner)
    assert str(layout.slots * 256) in layout.describe(planner)


def test_lru_evicts_oldest_chain_tail_first_and_keeps_prefixes_closed():
    _, idx = hybrid(3)
    for i in range(3):  # chain 0 <- 1 <- 2
        assert idx.reserve(1, k(i), k(i - 1) if i else None) is not None
    assert idx.reserve(1, k(1), k(0)) is None, "stored already"
    # A new chain root: the oldest entry is k(0), evicting it must take 1 and 2 along.
    assert idx.reserve(1, k(10), None) is not None
    assert not any(idx.contains(1, k(i)) for i in range(3))
    assert idx.pools[1].evictions == 3 and len(idx.pools[1].free) == 2


def test_orphans_are_never_stored_in_prefix_closed_pools():
    _, idx = hybrid(2)
    assert idx.reserve(1, k(5), k(4)) is None  # parent absent
    assert idx.reserve(0, k(5), k(4)) is not None  # Mamba states stand alone


def test_pinned_entries_and_their_ancestors_survive_eviction():
    _, idx = hybrid(2)
    idx.reserve(1, k(0), None)
    idx.reserve(1, k(1), k(0))
    slot = idx.pin(1, k(1))
    assert slot is not None
    assert idx.reserve(1, k(7), None) is None, "everything pinned or needed by a pin: drop the store"
    assert idx.contains(1, k(0)) and idx.contains(1, k(1))
    idx.unpin(1, k(1))
    assert idx.reserve(1, k(7), None) is not None


def test_lookup_over_the_index_never_reports_an_evicted_chunk():
    planner, idx = hybrid(4)
    keys = [k(i) for i in range(6)]
    for c in range(6):  # a 6-chunk prompt into a 4-slot pool
        idx.reserve(1, keys[c], keys[c - 1] if c else None)
        idx.reserve(0, keys[c], None)
    found = planner.lookup(6 * 256 + 1, lambda g, ch: idx.contains(g, keys[ch]))
    for c in range(found.chunks):
        assert idx.contains(1, keys[c])
    assert idx.contains(0, keys[found.chunks - 1]) if found.chunks else True


def test_too_small_budget_gives_zero_slots():
    planner = HybridOffloadPlanner([GroupSpec(FULL, 128, 262_144, 2)], 256)  # 2 pages a chunk
    assert CpuLayout.plan(planner, 1 << 20).slots == 2
    assert CpuLayout.plan(planner, 1 << 19).slots == 1
    assert CpuLayout.plan(planner, (1 << 19) - 1).slots == 0


@pytest.mark.parametrize("slots", [1, 2, 5])
def test_free_slots_are_unique_and_within_pool(slots):
    _, idx = hybrid(slots)
    got = [idx.reserve(0, k(i), None) for i in range(slots)]
    assert sorted(p.slot for p in got) == list(range(slots))


def test_cpu_data_round_trip_and_slot_identity_check():
    import torch

    from offload.copier import GroupPages, LayerPages
    from offload.keys import ChunkKey
    from offload.store.base import HostChunk, Placement
    from offload.store.buffers import BufferPool
    from offload.store.cpu import CpuData
    from offload.store.format import ChunkHeader
    from offload.store.fs import ChunkMiss

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
    planner, _ = hybrid(2)
    below: set[tuple[int, bytes]] = set()
    idx = CpuIndex(planner, CpuLayout.plan(planner, 2 * (35_072 + 2 * 262_144)),
                   backed=lambda g, key: (g, key) in below)
    assert idx.reserve(0, k(1), None) is not None and idx.reserve(0, k(2), None) is not None
    assert idx.reserve(0, k(3), None) is None, "both entries are only copies: the store is skipped"
    assert idx.usage().no_room == 1 and idx.contains(0, k(1)) and idx.contains(0, k(2))
    below.add((0, k(2)))  # k(2)'s file landed; k(1) is older but still an only copy
    assert idx.reserve(0, k(3), None) is not None
    assert idx.contains(0, k(1)) and not idx.contains(0, k(2)) and idx.contains(0, k(3))
    # Prefix-closed groups: a chain is evicted only when every entry in it is backed.
    assert idx.reserve(1, k(10), None) is not None and idx.reserve(1, k(11), k(10)) is not None
    below.add((1, k(10)))
    assert idx.reserve(1, k(20), None) is None, "k(11) chains from k(10) and is an only copy"
    below.add((1, k(11)))
    assert idx.reserve(1, k(20), None) is not None and not idx.contains(1, k(10))


def test_an_only_copy_whose_write_below_was_dropped_is_evicted_like_any_other():
    """The worker reports a dropped write to the tier below (`copy_below_dropped`):
    that entry will never be backed, so keeping it from eviction would hold its
    slot until a restart. The chain behind it is evicted with it, as ever."""
    planner, _ = hybrid(2)
    idx = CpuIndex(planner, CpuLayout.plan(planner, 2 * (35_072 + 2 * 262_144)), backed=lambda g, key: False)
    assert idx.reserve(1, k(1), None) is not None and idx.reserve(1, k(2), k(1)) is not None
    assert idx.reserve(1, k(3), None) is None, "only copies whose writes may still land"
    idx.copy_below_dropped(1, k(1))
    assert idx.reserve(1, k(3), None) is None, "k(2) chains from k(1) and its write may still land"
    idx.copy_below_dropped(1, k(2))
    assert idx.reserve(1, k(3), None) is not None
    assert not idx.contains(1, k(1)) and not idx.contains(1, k(2)) and idx.pools[1].evictions == 2


def test_an_entry_whose_store_was_dropped_leaves_with_its_chain_once_no_load_holds_its_slot():
    """`store_dropped` (the worker reported its store or promotion dropped):
    the entry and the chain behind it are offered no more at once; a slot a
    load still reads stays taken until that load unpins it, so no store can
    overwrite it meanwhile. A failed load (`forget`) leaves host memory as it is."""
    _, idx = hybrid(3)
    for i in range(3):  # chain 0 <- 1 <- 2
        assert idx.reserve(1, k(i), k(i - 1) if i else None) is not None
    assert idx.pin(1, k(2)) is not None
    idx.forget(1, k(1))
    assert idx.contains(1, k(1)) and idx.contains(1, k(2))
    idx.store_dropped(1, k(1))
    assert idx.contains(1, k(0)) and not idx.contains(1, k(1)) and not idx.contains(1, k(2))
    assert idx.pin(1, k(1)) is None
    assert idx.reserve(1, k(9), k(1)) is None, "a forgotten entry is no parent"
    assert len(idx.pools[1].free) == 1, "k(1) freed; k(2) still read by its load"
    idx.unpin(1, k(2))
    assert len(idx.pools[1].free) == 2 and list(idx.pools[1].entries) == [k(0)]
    assert idx.reserve(1, k(1), k(0)) is not None and idx.contains(1, k(1)), "stored again"


def test_a_promotion_whose_load_failed_is_forgotten_with_what_chained_behind_it():
    _, idx = hybrid(3)
    assert idx.reserve_promotion(1, k(0), None) is not None
    assert not idx.contains(1, k(0)), "offered only once its bytes landed"
    assert idx.reserve(1, k(1), k(0)) is not None  # a store chained behind it meanwhile
    idx.promotion_done(1, k(0), landed=False)
    assert not idx.pools[1].entries and len(idx.pools[1].free) == 3
    assert idx.reserve_promotion(1, k(0), None) is not None
    idx.promotion_done(1, k(0), landed=True)
    assert idx.contains(1, k(0))
