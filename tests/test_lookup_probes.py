"""How often the scheduler half asks its tiers about an entry, on vLLM's own Scheduler.

A lookup probes the tiers (`TierIndex.contains`, a stat or a remote call on
the slower ones); the load it leads to pins what it found. Each decision is
made once per request: a hit held back for KV-cache room is not looked up
again at every step it waits, and a load pins an entry in the tier its
lookup found it in instead of asking the faster tiers again. An entry a tier
drops while its hit waits fails the load's pin, and the request computes.
"""

from __future__ import annotations

import random
import threading
from collections import Counter

import pytest

from offload.connector.scheduler import SchedulerSide
from offload.store.cpu import CpuIndex
from offload.store.fs import FsIndex
from vllm_unit_utils import (
    Engine,
    WorkerStep,
    assert_scheduler_empty,
    attention_kv_cache_config,
    create_request,
    create_scheduler,
    create_vllm_config,
    set_connector,
    tiny_hybrid_engine,
)

UNIT = 64  # divides the tiny hybrid's 128-token blocks: vLLM hits at every 64 tokens


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, 1000) for _ in range(n)]


def tier_params(eng: Engine, req_id: str, tier: int = 0) -> dict:
    params = eng.finished[req_id]
    assert params is not None, f"{req_id}: no kv_transfer_params in its final output"
    return params[f"kvoffload:{eng.scheduler.connector.cfg.tiers[tier].tier_name}"]


@pytest.fixture
def held_loads(monkeypatch):
    """Hold every load at its scatter into the KV cache until released."""
    from offload.copier import GroupPages

    release = threading.Event()
    real = GroupPages.scatter

    def scatter(self, *args, **kwargs):
        assert release.wait(30), "load held for 30 s"
        return real(self, *args, **kwargs)

    monkeypatch.setattr(GroupPages, "scatter", scatter)
    yield release
    release.set()


@pytest.fixture
def probes(monkeypatch):
    """Tier probes (`contains`) made inside each lookup, as (request, probes) per lookup call."""
    calls: list[tuple[str, int]] = []
    count = [0]
    real_contains, real_lookup = CpuIndex.contains, SchedulerSide.get_num_new_matched_tokens

    def contains(self, group, key):
        count[0] += 1
        return real_contains(self, group, key)

    def lookup(self, request, num_computed_tokens):
        before = count[0]
        out = real_lookup(self, request, num_computed_tokens)
        calls.append((request.request_id, count[0] - before))
        return out

    monkeypatch.setattr(CpuIndex, "contains", contains)
    monkeypatch.setattr(SchedulerSide, "get_num_new_matched_tokens", lookup)
    return calls


def hybrid_engine(models_dir, num_blocks: int) -> Engine:
    return tiny_hybrid_engine(str(models_dir / "qwen3-next-tiny"), num_blocks, UNIT)


def store_then_repeat(eng: Engine, release, prompts: list[list[int]]) -> None:
    """Store each prompt, reset vLLM's own prefix cache, then queue a repeat of each with its loads held."""
    release.set()  # the stores' own runs load nothing
    for i, p in enumerate(prompts):
        eng.scheduler.add_request(create_request(f"s{i}", p, max_tokens=1, block_size=UNIT))
        eng.run_to_completion()
    assert eng.scheduler.reset_prefix_cache()
    release.clear()
    for i, p in enumerate(prompts):
        eng.scheduler.add_request(create_request(f"r{i}", p, max_tokens=1, block_size=UNIT))


def test_a_hit_deferred_for_room_is_looked_up_once_not_at_every_step_it_waits(models_dir, held_loads, probes):
    """Three repeats of stored 250-token prompts in a KV cache of 7 blocks
    (test_partial_tail_loads_wait_for_room_instead_of_stalling_vllm): the
    first load takes the room, the others wait for it a step at a time and
    vLLM asks the connector again at each. Each repeat probes the tiers in
    one lookup only, however often it was asked, and checks its entries once
    more when it fits; every repeat still restores its tail (measured before:
    a deferred repeat probed at every step it waited)."""
    eng = hybrid_engine(models_dir, num_blocks=7)
    try:
        store_then_repeat(eng, held_loads, [prompt(40 + i, 250) for i in range(3)])
        probes.clear()
        for _ in range(5):
            eng.step()
        assert eng.scheduler.kv_holding_waiting, "no load admitted"
        held_loads.set()
        eng.run_to_completion(timeout=30)
        assert [tier_params(eng, f"r{i}")["restored_tokens"] for i in range(3)] == [192] * 3
        totals = eng.totals()
        assert "failed_loads" not in totals
        assert totals.get("hits_deferred", 0) > 0, "some repeat waited for room"
        asked = Counter(rid for rid, _ in probes)
        probed = Counter(rid for rid, n in probes if n)
        assert max(asked.values()) > 1, asked
        # One lookup each, and for a repeat that waited one check of its entries when it fit.
        assert set(probed) == {f"r{i}" for i in range(3)} and max(probed.values()) <= 2, (probed, asked)
        assert sum(probed.values()) < sum(asked.values()), (probed, asked)
        assert_scheduler_empty(eng.scheduler)
    finally:
        held_loads.set()
        eng.worker.connector.shutdown()


def test_an_entry_dropped_while_its_hit_waited_is_looked_up_again_when_it_fits(models_dir, held_loads):
    """The deferred hit is not looked up again while it waits, but its entries
    are checked once when it fits: one its tier dropped meanwhile makes a fresh
    lookup (here: nothing left), so no load fails and vLLM computes the request;
    the others restore their tails."""
    eng = hybrid_engine(models_dir, num_blocks=7)
    ours = eng.scheduler.connector._sched
    try:
        store_then_repeat(eng, held_loads, [prompt(40 + i, 250) for i in range(3)])
        eng.run_until(lambda: any(st.deferred is not None for st in ours.reqs.values()), timeout=30)
        [victim] = [rid for rid, st in ours.reqs.items() if st.deferred is not None][:1]
        host = ours.indices[0]
        for g, key in list(ours.reqs[victim].found_in):
            host.store_dropped(g, key)
        held_loads.set()
        eng.run_to_completion(timeout=30)
        assert tier_params(eng, victim) == {"restored_tokens": 0, "load_failed": False}
        assert eng.scheduled[victim] == 250, "vLLM computed all of it"
        others = [f"r{i}" for i in range(3) if f"r{i}" != victim]
        assert [tier_params(eng, rid)["restored_tokens"] for rid in others] == [192] * 2
        assert "failed_loads" not in eng.totals()
        assert_scheduler_empty(eng.scheduler)
    finally:
        held_loads.set()
        eng.worker.connector.shutdown()


def test_a_load_pins_each_entry_in_the_tier_its_lookup_found_it_in(models_dir, tmp_path, monkeypatch):
    """Host memory, then files. A prompt is stored in both; host memory then
    drops its entries (the files still hold them). Its repeat's lookup asks
    host memory, then the files, about the entries it probes; the load pins
    those in the files without asking host memory again, and restores the
    hit from the files (measured before: host memory asked twice for each
    entry the lookup probed)."""
    bs = 16
    cfg = create_vllm_config(str(models_dir / "llama-tiny"), block_size=bs, max_num_batched_tokens=256)
    set_connector(cfg, {"tiers": [{"store": "cpu", "cpu_bytes": 4 << 20},
                                  {"store": "fs", "path": str(tmp_path / "cache")}]})
    kcc = attention_kv_cache_config(["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"],
                                    block_size=bs, num_kv_heads=2, head_size=32, num_blocks=128)
    sched = create_scheduler(cfg, kcc)
    eng = Engine(sched, WorkerStep(cfg, kcc, sched))
    ours = sched.connector._sched
    host, files = ours.indices
    assert isinstance(host, CpuIndex) and isinstance(files, FsIndex)
    try:
        tokens = prompt(7, 600)
        sched.add_request(create_request("a", tokens, max_tokens=2, block_size=bs))
        eng.run_to_completion()
        # Every entry a repeat restores lands in host memory (the scheduler hears of a store a step
        # after it lands, so right after the run it may know only some of them).
        planner = sched.connector.planner
        hit, chunks = planner.repeat_hit(len(tokens)), planner.max_hit_chunks(len(tokens))
        tail = max(0, hit - chunks * planner.chunk_size)
        entries = sum(len(planner.needed(g, chunks, 0, tail)) for g in range(len(planner.groups)))
        worker = eng.worker.connector._worker
        eng.run_until(lambda: worker.stores.pending_bytes == 0 and len(host.entries) == entries)
        stored = list(host.entries)
        # The files hold every entry host memory does (their writes land on the I/O threads).
        eng.run_until(lambda: all(files.contains(g, key) for g, key in stored), timeout=30)
        for g, key in stored:
            host.store_dropped(g, key)
        assert not any(host.contains(g, key) for g, key in stored)
        assert sched.reset_prefix_cache()

        asked: Counter = Counter()
        real_contains, real_pin = CpuIndex.contains, CpuIndex.pin

        def contains(self, group, key):
            found = real_contains(self, group, key)
            asked[(group, key)] += not found
            return found

        def pin(self, group, key):
            placement = real_pin(self, group, key)
            asked[(group, key)] += placement is None
            return placement

        monkeypatch.setattr(CpuIndex, "contains", contains)
        monkeypatch.setattr(CpuIndex, "pin", pin)
        sched.add_request(create_request("b", tokens, max_tokens=2, block_size=bs))
        eng.run_to_completion()
        assert tier_params(eng, "b", 1)["restored_tokens"] == hit
        assert tier_params(eng, "b", 0)["restored_tokens"] == 0
        assert "failed_loads" not in eng.totals()
        assert asked and max(asked.values()) == 1, asked
        assert_scheduler_empty(sched)
    finally:
        eng.worker.connector.shutdown()
