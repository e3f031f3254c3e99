"""How often the scheduler half asks its tiers about an entry, on vLLM's own Scheduler.

A lookup probes the tiers (`TierIndex.contains`, a stat or a remote call on
the slower ones); the load it leads to pins each entry in the tier its lookup
found it in instead of asking the faster tiers again.
"""

from __future__ import annotations

import random
from collections import Counter

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
)


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, 1000) for _ in range(n)]


def tier_params(eng: Engine, req_id: str, tier: int = 0) -> dict:
    params = eng.finished[req_id]
    assert params is not None, f"{req_id}: no kv_transfer_params in its final output"
    return params[f"kvoffload:{eng.scheduler.connector.cfg.tiers[tier].tier_name}"]


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
        stored = list(host.entries)
        assert stored, "nothing stored in host memory"
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
        hit = sched.connector.planner.repeat_hit(len(tokens))
        assert tier_params(eng, "b", 1)["restored_tokens"] == hit
        assert tier_params(eng, "b", 0)["restored_tokens"] == 0
        assert "failed_loads" not in eng.totals()
        assert asked and max(asked.values()) == 1, asked
        assert_scheduler_empty(sched)
    finally:
        eng.worker.connector.shutdown()
