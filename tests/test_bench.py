"""The benchmarks of bench/ run at a small size (speed is never asserted here),
and the store-path pieces they measure keep their semantics: pooled buffers,
O_DIRECT writes with a buffered fallback, skipping a gather for a stored chunk."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from offload import copier
from offload.copier import GroupPages, LayerPages
from offload.planner import GroupKind
from offload.store.base import HostChunk, Placement
from offload.store.buffers import BufferPool, probe_o_direct
from offload.store.files import FileStore
from offload.store.format import HEADER_LEN, ChunkHeader
from offload.store.fs import FsData

FP = bytes(range(32))
REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # bench/ is not installed; it runs from the checkout
    sys.path.insert(0, str(REPO))


def _pages(fill: int | None = None) -> tuple[torch.Tensor, GroupPages]:
    g = torch.Generator().manual_seed(3)
    t = torch.randint(0, 256, (2, 40, 16, 2, 64), dtype=torch.uint8, generator=g)
    if fill is not None:
        t.fill_(fill)
    return t, GroupPages([LayerPages.from_tensor(t, 40)], 40, torch.device("cpu"))


def _header(key: bytes, pages: GroupPages, n: int) -> ChunkHeader:
    return ChunkHeader(FP, key, 1, GroupKind.FULL_ATTENTION, 0, 256, n, pages.page_bytes)


@pytest.mark.parametrize("direct", [None, False])
def test_fsdata_round_trip_pooled(tmp_path: Path, direct: bool | None) -> None:
    src, pages = _pages()
    data = FsData(FileStore.open(str(tmp_path), FP), direct=direct)
    pool = BufferPool()
    ids = [7, 3, 30, 4]
    for i in range(3):
        h = _header(bytes([i]) * 32, pages, len(ids))
        chunk = HostChunk.pooled(pool, h.payload_len)
        pages.gather(ids, out=chunk.payload)
        assert data.put(h, chunk, Placement()) is True
        chunk.release()
        path = data.store.file_path(1, h.key)
        assert path.stat().st_size == HEADER_LEN + h.payload_len  # truncated back from the aligned write
    assert pool.allocated == 1 and pool.reused == 2  # one buffer, reused
    assert data.direct_writes + data.buffered_writes == 3
    if direct is False:
        assert data.direct_writes == 0
    dst, dpages = _pages(fill=0)
    loaded = data.get(h, Placement(), pool)
    dpages.scatter(loaded.payload, h.num_pages, list(zip(range(4), [1, 2, 5, 6])))
    loaded.release()
    assert torch.equal(dst[:, [1, 2, 5, 6]], src[:, ids])
    # The file is byte-identical to FileStore.write's: the plain reader verifies it.
    out = torch.empty(h.payload_len, dtype=torch.uint8)
    data.store.read_into(h, out)
    assert torch.equal(out, pages.gather(ids))


def test_fsdata_put_is_idempotent_and_checks_length(tmp_path: Path) -> None:
    _, pages = _pages()
    data = FsData(FileStore.open(str(tmp_path), FP))
    h = _header(b"k" * 32, pages, 2)
    chunk = HostChunk.pooled(BufferPool(), h.payload_len)
    pages.gather([1, 2], out=chunk.payload)
    assert not data.holds(h, Placement())
    assert data.put(h, chunk, Placement()) is True
    assert data.holds(h, Placement())  # the worker skips the gather for such an entry
    assert data.put(h, chunk, Placement()) is False
    longer = _header(b"j" * 32, pages, 3)  # page count contradicts the payload
    with pytest.raises(ValueError):
        data.put(longer, chunk, Placement())


def test_write_file_direct_unaligned_falls_back(tmp_path: Path) -> None:
    raw = torch.arange(10000, dtype=torch.int64).to(torch.uint8)
    buf = raw[1:]  # not aligned: buffered write, same bytes
    used = copier.write_file_direct(tmp_path / "t", tmp_path / "f", buf, 5000, fsync=True)
    assert used is False
    assert (tmp_path / "f").read_bytes() == bytes(buf[:5000].tolist())
    pool = BufferPool()
    b = pool.get(5000)
    assert b.data_ptr() % copier.DIRECT_ALIGN == 0 and b.numel() == 8192
    b[:5000].copy_(buf[:5000])
    used = copier.write_file_direct(tmp_path / "t2", tmp_path / "f2", b, 5000, fsync=False)
    assert used == probe_o_direct(tmp_path)
    assert (tmp_path / "f2").read_bytes() == bytes(buf[:5000].tolist())
    # The aligned part goes O_DIRECT, a last partial block buffered: every split gives the same bytes.
    for n in (3000, 4096, 8192 - 1):
        c = pool.get(n)
        c[:n].copy_(raw[:n])
        copier.write_file_direct(tmp_path / f"t{n}", tmp_path / f"f{n}", c, n, fsync=True)
        assert (tmp_path / f"f{n}").read_bytes() == bytes(raw[:n].tolist())
    with pytest.raises(FileExistsError):  # O_EXCL on the tmp name, as write_file
        (tmp_path / "t3").write_bytes(b"x")
        copier.write_file_direct(tmp_path / "t3", tmp_path / "f3", b, 5000, fsync=False)


def test_memcpy() -> None:
    a = torch.arange(1 << 20, dtype=torch.int32).view(torch.uint8)
    b = torch.empty_like(a)
    copier.memcpy(b, a, num_threads=2)
    assert torch.equal(a, b)


@pytest.mark.long  # 45–80 s: `make test` stays within 12 minutes on the slower CPU kind (docs/development.md)
def test_bench_fs_tier_small(tmp_path: Path) -> None:
    from bench import fs_tier

    doc = fs_tier.run(0.005, 1, tiny=True, dir=str(tmp_path), vllm_threads=(4,), out_dir=tmp_path)
    assert doc["results"]["ours store"]["gb_s"] > 0
    # Every load variant ran (each checks the restored pages inside the benchmark).
    assert set(doc["loads"]) == {"ours load, sequential", "ours load", "ours load, buffered", "ours load, MAC"}
    # MAC and CRC only side by side, each against the device limit of the same run.
    for op in ("store", "load"):
        d = doc["mac"][op]
        assert d["mac_cpu_s_per_gb"] > 0 and d["crc_cpu_s_per_gb"] > 0 and d["mac_of_device"] > 0
    mac_v2 = "AES-256-GMAC, MAC v2 (" + ("the copier's GHASH" if copier.ghash_available() else "cryptography") + ")"
    assert set(doc["hash_gb_s"]) == {mac_v2, "AES-256-GMAC (cryptography alone)", "keyed BLAKE3, MAC v1 (blake3)",
                                     "HMAC-SHA256 (OpenSSL)", "CRC-32C (ours)"}
    assert doc["o_direct_reads_used"] == doc["o_direct"]  # O_DIRECT reads wherever the filesystem takes them
    assert "vs_vllm_store" in doc  # vLLM's file tier I/O ran on the same pages
    # One request's load alone and during stores, in a cache that has run a while and in a new one.
    for u in doc["load_under_stores"].values():
        assert len(u["alone_s"]) == len(u["under_stores_s"]) >= 3 and u["slowdown_under_stores"] > 0
    assert {u["ran_a_while"] for u in doc["load_under_stores"].values()} == {True, False}
    assert json.loads((tmp_path / "fs_tier.json").read_text())["bytes"] == doc["bytes"]
    # The heap frozen as the worker's registration freezes it; every row says its full collections.
    assert doc["heap_frozen_objects"] > 0
    assert all(len(r["runs_full_gc_s"]) == len(r["runs_gb_s"]) for r in doc["results"].values())


def test_bench_cpu_tier_small(tmp_path: Path) -> None:
    from bench import cpu_tier

    doc = cpu_tier.run(0.005, 1, tiny=True, out_dir=tmp_path)
    assert doc["ratio_gather_to_memcpy"] > 0 and (tmp_path / "cpu_tier.json").exists()


def test_bench_copier_gpu_small(tmp_path: Path) -> None:
    """Runs where there is a GPU (scripts/gpu_check.sh runs it at full size); elsewhere it says what it needs."""
    from bench import copier_gpu

    if not torch.cuda.is_available() or copier._copier_cuda is None:
        with pytest.raises(SystemExit, match="needs a CUDA GPU"):
            copier_gpu.run(0.01, 1, tiny=True, out_dir=tmp_path)
        return
    doc = copier_gpu.run(0.01, 1, tiny=True, out_dir=tmp_path)
    assert all(r["gb_s"] > 0 for r in doc["results"].values()) and (tmp_path / "copier_gpu.json").exists()


def test_bench_room_check_small(models_dir) -> None:
    from bench import room_check

    us = room_check.run(rounds=1, calls=2, held=(0, 2))
    assert set(us) == {0, 2} and all(v > 0 for v in us.values())


def test_bench_lookup_small(tmp_path: Path) -> None:
    from bench import lookup

    doc = lookup.run(4096, 300, 0.5, 1, dir=str(tmp_path), out_dir=tmp_path)
    ours = doc["results"]["binary search (ours)"]
    assert ours["hit_chunks"] == doc["stored_chunks"]
    assert ours["metadata_calls"] <= doc["bound_calls"]  # probes are a count, not a speed


def _bench_e2e_small(models_dir: Path, tmp_path: Path) -> dict:
    """The benchmark run of the test below, on the session's background lane (tests/conftest.py)."""
    from bench import e2e

    return e2e.run(str(models_dir / "llama-tiny"), long_tokens=1024, n_long=1, miss_prompts=2, miss_tokens=256,
                   miss_reps=1, max_num_batched_tokens=256, cache_dir=str(tmp_path), same_process=True,
                   hybrid=False, out_dir=tmp_path)


@pytest.mark.e2e
@pytest.mark.long  # `make test` stays within 12 minutes (docs/development.md); `make bench` runs it at size
@pytest.mark.prefetch.with_args(_bench_e2e_small)
def test_bench_e2e_small(prefetched, models_dir) -> None:
    """Items 5 and 6 on the tiny Llama: one engine pair (no connector; the
    connector storing then restoring in the same process)."""
    from offload.plan.run import plan_for_model

    doc = prefetched(_bench_e2e_small)
    # What the planner lets a 1024-token prompt hit with vLLM's layout for this model here
    # (an attention-only model's chunk-aligned prompt hits whole).
    planner = plan_for_model(models_dir / "llama-tiny").planner()
    assert doc["ttft"]["restored_tokens"] == [planner.max_hit_chunks(1024) * planner.chunk_size]
    assert doc["miss"]["cached_tokens_with"] == [0]
    assert doc["ttft"]["identical_first_token"] == [True]


def test_tier_stack_bench_gathers_once_per_chunk(tmp_path: Path) -> None:
    """bench/tier_stack.py on a small cache: the stack and two connectors with
    the MultiConnector's GatherShare copy each entry out of the KV cache once,
    two connectors without it twice; every load is checked byte for byte
    inside the benchmark, and a restart is served from files then promoted."""
    from bench.tier_stack import run

    res = run(0.01, 1, True, tmp_path)
    per_chunk = {name: m["gather_bytes_per_chunk"] for name, m in res["median"].items()}
    one = per_chunk["cpu"]
    assert one > 0 and per_chunk["fs"] == one == per_chunk["stack"] == per_chunk["two-connectors-shared"]
    assert per_chunk["two-connectors"] == 2 * one
    assert res["median"]["stack"]["restart_load_GBps"] > 0 and res["median"]["stack"]["promoted_load_GBps"] > 0


def test_bench_scale_small(tmp_path: Path) -> None:
    """bench/scale.py on 2,000 files: the files are FileStore.write's bytes, both budgets evict, and the
    ledger's figure after the run (stores, another instance's records, evictions) is the walk's."""
    from bench import scale

    doc = scale.run(2000, 1, dir=str(tmp_path), out_dir=tmp_path, cold=False)
    assert doc["identical_to_filestore_write"]
    res = doc["results"]
    assert res["evict: ledger queue, per evicted file"]["files"] > 0
    assert res["evict: pre-ledger walk + heap rebuild, per evicted file"]["files"] > 0
    assert doc["final_usage_accounted"] == doc["final_usage_walked"]
    assert doc["reconcile_drift"] == {}, "nothing happened behind the ledger's back"
    assert json.loads((tmp_path / "scale.json").read_text())["files"] == 2000
    assert not any(p.name.startswith("kvoffload-scale-") for p in tmp_path.iterdir()), "cleaned up"


def _bench_peer_race_small(models_dir: Path, tmp_path: Path) -> dict:
    """bench/peer_race.py on the tiny hybrid: the three servers of a round side by side and the
    load on the TTFT server (`parallel`, no separate load server), so only correctness holds;
    1 GiB of KV cache each (three servers of the default 4 GiB beside other tests ran out of memory)."""
    from bench import peer_race

    mr = peer_race.ModelRun("qwen3-next-tiny", str(models_dir / "qwen3-next-tiny"), [640, 1024],
                            {"num_prompts": 4, "num_prefixes": 2, "prefix_len": 256, "suffix_len": 32,
                             "output_len": 2, "concurrency": 2}, rounds=1, env={"VLLM_CPU_KVCACHE_SPACE": "1"})
    return peer_race.run([mr], work_dir=str(tmp_path), out_dir=tmp_path, name="peer_race_small",
                         parallel=True, separate_load=False)


@pytest.mark.e2e
@pytest.mark.long  # `make test` stays within 12 minutes (docs/development.md); `make bench` runs it at size
@pytest.mark.prefetch.with_args(_bench_peer_race_small)
def test_bench_peer_race_small(prefetched) -> None:
    """bench/peer_race.py at a small size: after a restart both connectors restore from their file
    tier, ours restores both group kinds and at least what vLLM's own in-process cache hits, first
    tokens equal the no-connector server's, and vLLM's own load client completed every request on
    all three servers."""
    doc = prefetched(_bench_peer_race_small)
    m = doc["models"][0]
    rnd = m["rounds"][0]
    ref = [r["first_token"] for r in rnd["none"]["ttft"]]
    assert all(t is not None for t in ref)
    for c in ("ours", "vllm"):
        assert m["store"][c]["stored_tokens"] > 0 and m["store"][c]["disk_bytes"] > 0, c
        assert [r["first_token"] for r in m["store"][c]["ttft"]] == ref, c
        assert [r["first_token"] for r in rnd[c]["ttft"]] == ref, c
        assert all(r["external_tokens"] > 0 for r in rnd[c]["ttft"]), (c, rnd[c]["ttft"])
    assert all(r["external_tokens"] == 0 for r in rnd["none"]["ttft"])
    for r in rnd["ours"]["ttft"]:
        assert r["restored_bytes"]["mamba"] > 0 and r["restored_bytes"]["full_attention"] > 0, r
    for c in ("ours", "vllm", "none"):
        assert rnd[c]["load"]["completed"] == 4 and rnd[c]["load"]["failed"] == 0, c
    assert m["summary"]["per_length"]["1024"]["identical_first_token"] == {"ours": True, "vllm": True}
    # Every server is given the plan's --prefix-match-unit; ours restores at least what vLLM's own
    # prefix cache hits on the same prompt in one process (measured on the no-connector server).
    for n, row in m["summary"]["per_length"].items():
        assert min(row["vllm_own_cache_tokens"]) > 0, (n, row)
        assert row["restored_at_least_own_cache"]["ours"] is True, (n, row)
        # The floor of a load from files: the same prompt from our host memory, which that load
        # filled, once vLLM's own cache is emptied: as many tokens, all from host memory, same token.
        fh = row["restart_vs_host_memory"]
        assert fh["host_restored_tokens"] == fh["restart_restored_tokens"], (n, fh)
        assert all({t for t, v in by.items() if v > 0} == {"cpu"} for by in fh["host_restored_tokens_by_tier"]), fh
        assert fh["identical_first_token"] is True and fh["device_read_gb_s"] > 0, fh
        # The device's own time for the same files, and the bound it gives, per round.
        assert fh["device_request_read_s"] > 0 and len(fh["within_request_bound"]) == len(fh["restart_ttft_s"]), fh


def test_a_restores_files_are_one_per_group_and_chunk_of_its_plan() -> None:
    """bench.peer_race's request shape for the device's own read time: from a committed race's plan
    and restored bytes (Qwen3-Next-80B geometry: three Mamba groups, one attention group), one file
    of each attention group per restored chunk (a partial tail's too) and one state per Mamba group
    (the one at the restore's end), whose payloads add up to the bytes the restore moved."""
    from bench.peer_race import restored_file_sizes

    doc = json.loads((Path(__file__).resolve().parents[1] / "bench/results/peer_race_hybrid_files.json").read_text())
    m = doc["models"][0]
    groups = m["plan"]["groups"]
    for i, n in enumerate(m["prompt_tokens"]):
        row = m["rounds"][0]["ours"]["ttft"][i]
        sizes = restored_file_sizes(m["plan"], row)
        chunks = -(-row["external_tokens"] // m["plan"]["hybrid_chunk_size"])  # a partial tail is one file too
        attn = sum(g["kind"] != "mamba" for g in groups)
        assert len(sizes) == chunks * attn + sum(g["kind"] == "mamba" for g in groups), (n, len(sizes))
        assert sum(sizes) - HEADER_LEN * len(sizes) == sum(row["restored_bytes"].values()), n


@pytest.mark.long  # `make test` stays within 12 minutes (docs/development.md)
def test_prefill_flags_steps_come_from_vllms_scheduler(models_dir) -> None:
    """bench/prefill_flags.py's prefill steps per prompt, from vLLM's Scheduler on the tiny hybrid's
    plan: every step within the configuration's token budget, the prompt whole, and the plan's unit
    costs one more step exactly where the prompt's unit-aligned tail falls inside a block."""
    from bench import prefill_flags as pf
    from offload.plan.run import plan_for_model

    plan = plan_for_model(models_dir / "qwen3-next-tiny")
    unit, block = plan.prefix_match_unit, max(plan.block_sizes)
    assert unit, plan.prefix_match
    split = pf.split_length(plan, 300)
    assert (split - 300) % unit == 0 and (split - 1) // unit * unit % block
    aligned = next(n for n in range(300, 300 + block) if (n - 1) // unit * unit % block == 0)
    for tokens, extra in ((split, 1), (aligned, 0)):
        engines = pf.configs(plan, tokens)
        assert list(engines) == [pf.DEFAULTS, pf.PLAN, pf.UNIT]
        steps = {k: pf.prefill_steps(plan, eng, tokens) for k, eng in engines.items()}
        for k, s in steps.items():
            assert sum(s) == tokens and min(s) > 0, (k, s)
        assert max(steps[pf.PLAN]) <= plan.engine_kwargs["max_num_batched_tokens"]
        assert len(steps[pf.UNIT]) == len(steps[pf.PLAN]) + extra, (tokens, steps)
        if extra:  # the extra step ends at the unit-aligned tail
            ends = [sum(steps[pf.UNIT][:i + 1]) for i in range(len(steps[pf.UNIT]))]
            assert (tokens - 1) // unit * unit in ends and (tokens - 1) // unit * unit not in \
                [sum(steps[pf.PLAN][:i + 1]) for i in range(len(steps[pf.PLAN]))]


def _bench_prefill_flags_small(models_dir: Path, tmp_path: Path) -> dict:
    """bench/prefill_flags.py on the tiny hybrid: 2 prompts whose unit-aligned tail is inside a
    block, 1 rep, the three engines one after the other."""
    from bench import prefill_flags as pf
    from offload.plan.run import plan_for_model

    model = str(models_dir / "qwen3-next-tiny")
    plan = plan_for_model(model)
    return pf.run(model, pf.split_length(plan, 300), prompts=2, reps=1, plan=plan)


@pytest.mark.e2e
@pytest.mark.long  # three engine starts; `make bench` runs it at size
@pytest.mark.prefetch.with_args(_bench_prefill_flags_small)
def test_bench_prefill_flags_small(prefetched) -> None:
    """bench/prefill_flags.py at a small size: the three configurations ran, the (plan + unit) / plan
    ratio is the ratio of their medians, the unit took one more prefill step per prompt, and the
    unit's greedy first tokens equal the plan's (no speed is asserted)."""
    from bench import prefill_flags as pf

    doc = json.loads(json.dumps(prefetched(_bench_prefill_flags_small)))
    names = [pf.DEFAULTS, pf.PLAN, pf.UNIT]
    assert list(doc["configs"]) == names and list(doc["runs_tok_s"]) == names
    assert doc["configs"][pf.UNIT]["prefix_match_unit"] == doc["prefix_match_unit"] > 0
    for k in names:
        assert len(doc["runs_tok_s"][k]) == 1 and doc["runs_tok_s"][k][0] > 0, k
        assert sum(doc["prefill_step_tokens"][k]) == doc["tokens"], k
        assert [len(f) for f in doc["first_tokens"][k]] == [2], k
        assert doc["cached_tokens"][k] == [[0, 0]], (k, "the measured pass recomputes every prompt")
    med = doc["median_tok_s"]
    assert doc["ratio_unit_over_plan"] == pytest.approx(med[pf.UNIT] / med[pf.PLAN])
    assert doc["ratio_unit_over_plan_per_rep"] == [pytest.approx(doc["ratio_unit_over_plan"])]
    steps = doc["prefill_steps_per_prompt"]
    assert steps[pf.UNIT] == steps[pf.PLAN] + 1, doc["prefill_step_tokens"]
    assert None not in doc["first_tokens"][pf.PLAN][0]
    assert doc["first_tokens"][pf.UNIT] == doc["first_tokens"][pf.PLAN]
    assert doc["unit_first_tokens_equal_plan"] is True


@pytest.mark.e2e
@pytest.mark.long  # five engine starts; `make bench` runs it at size
def test_bench_warm_start_small(models_dir, tmp_path: Path) -> None:
    from bench import warm_start

    doc = warm_start.run(str(models_dir / "qwen3-next-tiny"), warm_start.FIRST, 1, tmp_path)
    on, off = doc["on"], doc["off"]
    # The states stored cold (branch points inside the shared prefixes) are no candidates: the files
    # restore those few, and promotion serves the batch's later requests without warm start too.
    assert on["share_from_cpu"] >= 0.9 and on["share_from_cpu"] > off["share_from_cpu"]
    assert on["identical_to_first_pass"] == off["identical_to_first_pass"] == warm_start.FIRST
    assert on["warm_failures"] == 0 and on["warm_entries"] == on["warm_planned_entries"] > 0
    assert off["warm_planned_entries"] == 0
    assert len(doc["startup_to_first_token_s"]["on"]["runs"]) == 1


@pytest.mark.e2e
@pytest.mark.long  # four engine starts
def test_bench_warm_start_trace_small(models_dir, tmp_path: Path) -> None:
    from bench import warm_start

    # 50 requests of the conversation slice, the restart after 25; 16 MiB of host memory (8 MiB for
    # warm start) under the first part's files, so warm start chooses among them.
    doc = warm_start.run_trace(str(models_dir / "qwen3-next-tiny"), "conversation", 50, 25, 16 << 20, tmp_path)
    on, off = doc["on"], doc["off"]
    assert doc["files_at_restart"]["bytes"] > 8 << 20
    assert on["from_cpu"] + on["from_fs"] == off["from_cpu"] + off["from_fs"] > 0, (on, off)
    assert on["share_from_cpu"] > off["share_from_cpu"], (on, off)
    assert on["identical_to_reference"] == off["identical_to_reference"] == warm_start.FIRST
    assert on["rest"]["identical_to_reference"] == off["rest"]["identical_to_reference"] == 25
    assert on["warm_failures"] == 0 and on["warm_entries"] == on["warm_planned_entries"] > 0
    assert 0 < on["warm_bytes"] <= 8 << 20 and off["warm_planned_entries"] == 0
    assert on["load_failed"] == off["load_failed"] == 0


@pytest.mark.parametrize("name", ["peer_race_hybrid", "peer_race_hybrid_load", "peer_race_llama8b", "peer_race_llama",
                                  "peer_race_llama_aligned", "peer_race_hybrid_unit"])
def test_peer_race_summary_is_recomputed_from_the_committed_rounds(name: str, capsys) -> None:
    """The tables in docs/performance.md come from `summarize` over the committed rounds: it gives
    the committed summary again (with and without the prefix-heavy load), and the tables print."""
    from bench import peer_race

    doc = json.loads((Path(__file__).parents[1] / "bench" / "results" / f"{name}.json").read_text())
    for m in doc["models"]:
        assert len(m["rounds"]) >= 3 and [r["order"] for r in m["rounds"]][:3] == [
            ["ours", "vllm", "none"], ["vllm", "none", "ours"], ["none", "ours", "vllm"]]
        assert json.loads(json.dumps(peer_race.summarize(m))) == m["summary"]
        assert bool(m["summary"]["load"]) == (m["load"] is not None)
        peer_race.print_tables(m)
        assert "TTFT" in capsys.readouterr().out


def test_peer_race_summary_of_a_run_without_vllms_tiering(capsys) -> None:
    """`--configs ours,none` (restore vs recompute only, e.g. the hybrid's 16K
    prompt): the same ratios against recompute as the three-way run, none
    against vLLM's tiering, and the tables still print."""
    from bench import peer_race

    doc = json.loads((Path(__file__).parents[1] / "bench" / "results" / "peer_race_llama.json").read_text())
    full = doc["models"][0]
    two = json.loads(json.dumps(full))
    two["configs"] = ["ours", "none"]
    two["store"].pop("vllm")
    for r in two["rounds"]:
        r.pop("vllm")
    s = peer_race.summarize(two)
    for n, row in s["per_length"].items():
        assert row["speedup_ours_vs_recompute"] == full["summary"]["per_length"][n]["speedup_ours_vs_recompute"]
        assert "ttft_ours_over_vllm" not in row and "vllm" not in row and "vllm_restore" not in row
        assert row["identical_first_token"] == {"ours": True}
    assert set(s["load"]) == {"ours", "none", "throughput_ours_over_none"}
    two["summary"] = s
    peer_race.print_tables(two)
    out = capsys.readouterr().out
    assert "TTFT 3840 tok" in out and "vLLM's connector loaded" not in out


def _bench_multi_turn_small(models_dir: Path, tmp_path: Path) -> tuple[dict, Path]:
    """bench/peer_race.py's multi-turn race on the tiny hybrid: 4 short turns, 1 round, a new server
    before every later turn; the three configurations side by side (`parallel`: only correctness
    holds, the page cache is kept), 1 GiB of KV cache each."""
    from bench import peer_race

    mr = peer_race.MultiTurnRun("qwen3-next-tiny", str(models_dir / "qwen3-next-tiny"), first_tokens=200,
                                message_tokens=40, answer_tokens=4, turns=4, rounds=1,
                                env={"VLLM_CPU_KVCACHE_SPACE": "1"})
    doc = peer_race.run_multi_turn([mr], work_dir=str(tmp_path), out_dir=tmp_path, name="multi_turn_small",
                                   parallel=True)
    return doc, tmp_path


@pytest.mark.e2e
@pytest.mark.long  # 12 server starts (a restart before every turn, 3 configurations): minutes on 2 cores
@pytest.mark.prefetch.with_args(_bench_multi_turn_small)
def test_bench_multi_turn_small(prefetched, tmp_path: Path) -> None:
    """The multi-turn race at a small size: each turn's prompt is the previous prompt, its greedy
    answer and a new message; after every restart ours restores at least the previous prompt up to
    the plan's prefix-match unit (what vLLM's own cache hits in one process), recompute restores
    nothing, every configuration's output tokens equal recompute's; its chart draws every turn
    after the first for the three configurations and names the JSON."""
    from bench import charts, peer_race
    from test_charts import png_size

    doc, out = prefetched(_bench_multi_turn_small)
    assert json.loads((out / "multi_turn_small.json").read_text())["models"] == json.loads(json.dumps(doc["models"]))
    [m] = doc["models"]
    unit = m["prefix_match_unit"]
    assert unit and m["serve_args"][-2:] == ["--prefix-match-unit", str(unit)], m["serve_args"]
    assert json.loads(json.dumps(peer_race.summarize_multi_turn(m))) == json.loads(json.dumps(m["summary"]))
    [rnd] = m["rounds"]
    ref = [t["output_ids"] for t in rnd["none"]["turns"]]
    for c in peer_race.CONFIGS:
        turns = rnd[c]["turns"]
        assert [t["turn"] for t in turns] == [1, 2, 3, 4], c
        assert [len(t["output_ids"]) for t in turns] == [4] * 4, c
        assert [t["prompt_tokens"] for t in turns] == [200 + k * (4 + 40) for k in range(4)], c
        assert turns[0]["external_tokens"] == 0 and turns[0]["cached_tokens"] == 0, (c, "an empty directory")
        assert [t["output_ids"] for t in turns] == ref, c
        assert all(t["ttft_s"] > 0 for t in turns), c
    for t in rnd["none"]["turns"]:
        assert t["external_tokens"] == 0 and t["cached_tokens"] == 0, t
    ours = rnd["ours"]["turns"]
    for prev, t in itertools.pairwise(ours):
        assert t["external_tokens"] > 0, t
        assert t["cached_tokens"] == t["external_tokens"], "after a restart every hit comes from the tier"
        assert (prev["prompt_tokens"] - 1) // unit * unit <= t["external_tokens"] < t["prompt_tokens"], (prev, t)
        assert t["restored_bytes"]["mamba"] > 0 and t["restored_bytes"]["full_attention"] > 0, t
    s = m["summary"]
    assert list(s["per_turn"]) == ["2", "3", "4"]
    assert s["identical_outputs"] == {"ours": True, "vllm": True}
    assert s["per_turn"]["4"]["ours"]["restored_tokens"] == [ours[3]["external_tokens"]]
    # vLLM's own in-process cache on each next turn (the no-connector server that computed the turn
    # before): ours restores at least its hit, and the ratios to its TTFT come from the same rounds.
    for k, row in s["per_turn"].items():
        own = rnd["none"]["turns"][int(k) - 2]["own_cache_next"]
        assert row["vllm_own_cache_tokens"] == [own["cached_tokens"]] and own["cached_tokens"] > 0, (k, own)
        assert row["restored_at_least_own_cache"]["ours"] is True, (k, row)
        assert row["ttft_ours_over_own_cache"]["median"] == ours[int(k) - 1]["ttft_s"] / own["ttft_s"], k
    assert "own_cache_next" not in rnd["none"]["turns"][-1]
    # Every answer comes with its top log-probabilities, by token id, the greedy token's the highest.
    for c in peer_race.CONFIGS:
        for t in rnd[c]["turns"]:
            assert len(t["top_logprobs"]) == len(t["output_ids"]), (c, t)
            for tok, top in zip(t["output_ids"], t["top_logprobs"]):
                assert top[str(tok)] == max(top.values()), (c, tok, top)
    assert all(d == [None] for row in s["per_turn"].values() for d in row["divergence"].values()), s


    rendered = charts.render(out, tmp_path / "charts")
    chart = next(c for c in rendered.charts if c.path.name == "multi_turn_ttft.png")
    assert chart.sources == ["multi_turn_small.json"]
    assert chart.series == {f"qwen3-next-tiny/{c}": 3 for c in peer_race.CONFIGS}
    assert not any(n.startswith("multi-turn race:") for n in rendered.notes)
    w, h = png_size(chart.path)
    assert w > 600 and h > 400


def test_multi_turn_divergence_names_exact_ties_only() -> None:
    """`divergence`: None for identical answers; else the first differing position, and an exact
    tie only where the reference's own top log-probabilities give both tokens the same value."""
    from bench.peer_race import divergence

    ref = {"output_ids": [5, 7, 9], "top_logprobs": [{"5": -1.0}, {"7": -2.5, "8": -2.5}, {"9": -1.0, "3": -1.5}]}
    assert divergence({"output_ids": [5, 7, 9]}, ref) is None
    tie = divergence({"output_ids": [5, 8, 1]}, ref)
    assert tie == {"at": 1, "token": 8, "reference_token": 7, "reference_logprobs": {"8": -2.5, "7": -2.5},
                   "exact_tie": True}
    near = divergence({"output_ids": [5, 7, 3]}, ref)
    assert near is not None and near["at"] == 2 and near["exact_tie"] is False
    outside = divergence({"output_ids": [4, 7, 9]}, ref)  # 4 not among the reference's top tokens
    assert outside is not None and outside["reference_logprobs"] == {"4": None, "5": -1.0} and not outside["exact_tie"]
    assert divergence({"output_ids": [5, 7]}, ref) == {"at": 2, "exact_tie": False}


# ---- vLLM's own multi-turn client (bench/multi_turn_client.py)

def _sdist(path: Path, version: str, pkg_version: str | None = None, files: tuple[str, ...] | None = None) -> Path:
    """A source distribution laid out as vLLM's: PKG-INFO and benchmarks/multi_turn/."""
    import io
    import tarfile

    from bench.multi_turn_client import CLIENT_FILES

    with tarfile.open(path, "w:gz") as tf:
        entries = {"PKG-INFO": f"Metadata-Version: 2.4\nName: vllm\nVersion: {pkg_version or version}\n",
                   "setup.py": "", **{f"benchmarks/multi_turn/{f}": f"# {f}\n" for f in files or CLIENT_FILES}}
        for name, text in entries.items():
            data = text.encode()
            info = tarfile.TarInfo(f"vllm-{version}/{name}")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


def test_multi_turn_client_is_taken_from_a_matching_sdist_only(tmp_path: Path) -> None:
    """The client comes from vLLM's sdist of the asked version, put in the cache by hand here (the
    offline route): only benchmarks/multi_turn/ and PKG-INFO are kept, with the sdist's sha256; a
    later call reuses them; an sdist of another version, or one without the client, is refused;
    with neither a cached sdist nor a reachable index the error says where to put the file."""
    import hashlib
    import re

    from bench.multi_turn_client import CLIENT_FILES, client_dir
    from harness.client import free_port

    def free_port_url() -> str:  # an index nothing answers at: offline
        return f"http://127.0.0.1:{free_port()}/simple"

    cache = tmp_path / "cache"
    cache.mkdir()
    sdist = _sdist(cache / "vllm-9.8.7.tar.gz", "9.8.7")
    d = client_dir(cache, "9.8.7", index=free_port_url())
    assert d == cache / "vllm-9.8.7" / "benchmarks" / "multi_turn"
    assert sorted(p.name for p in d.iterdir()) == sorted(CLIENT_FILES)
    assert sorted(p.name for p in d.parents[1].iterdir()) == ["PKG-INFO", "PROVENANCE.json", "benchmarks"]
    prov = json.loads((d.parents[1] / "PROVENANCE.json").read_text())
    assert prov == {"version": "9.8.7", "sdist": str(sdist), "sha256": hashlib.sha256(sdist.read_bytes()).hexdigest()}
    sdist.unlink()
    assert client_dir(cache, "9.8.7", index=free_port_url()) == d  # cached: no sdist, no index needed

    _sdist(cache / "vllm-1.0.0.tar.gz", "1.0.0", pkg_version="1.0.1")
    with pytest.raises(ValueError, match=r"version 1\.0\.1"):
        client_dir(cache, "1.0.0")
    _sdist(cache / "vllm-2.0.0.tar.gz", "2.0.0", files=("bench_dataset.py",))
    with pytest.raises(ValueError, match=r"benchmark_serving_multi_turn\.py"):
        client_dir(cache, "2.0.0")
    assert not (cache / "vllm-1.0.0").exists() and not (cache / "vllm-2.0.0").exists()
    with pytest.raises(RuntimeError, match=re.escape(str(cache / "vllm-3.0.0.tar.gz"))):
        client_dir(cache, "3.0.0", index=free_port_url())


def test_multi_turn_client_chat_prompts_extend_each_other(models_dir: Path) -> None:
    """bench/chat_template.jinja: each turn's prompt (history + generation prompt), tokenized by the
    model's tokenizer, is a prefix of the next turn's, so a conversation's previous turn can hit;
    bench/visible_tokens.py lets answers use only tokens that decode to visible text."""
    from transformers import AutoTokenizer

    from bench.multi_turn_client import CHAT_TEMPLATE
    from bench.visible_tokens import visible, visible_ids

    tok = AutoTokenizer.from_pretrained(models_dir / "qwen3-next-tiny")
    template = CHAT_TEMPLATE.read_text()
    msgs = [{"role": "user", "content": "alpha beta 7, gamma"}]
    prev: list[int] = []
    for turn in range(3):
        ids = tok(tok.apply_chat_template(msgs, chat_template=template, tokenize=False, add_generation_prompt=True),
                  add_special_tokens=False)["input_ids"]
        assert ids[:len(prev)] == prev and len(ids) > len(prev), turn
        prev = ids
        msgs += [{"role": "assistant", "content": " delta mu!"}, {"role": "user", "content": f"omega {turn} pi"}]
    ok = visible_ids(tok)
    assert ok and tok.eos_token_id not in ok and tok.pad_token_id not in ok
    assert all(visible(tok.decode([i])) for i in ok)
    assert len(ok) < len(tok)  # lone bytes of UTF-8 sequences and special tokens are left out


def _bench_multi_turn_client_small(models_dir: Path, tmp_path: Path) -> tuple[dict, Path]:
    """vLLM's multi-turn client on the tiny hybrid: 4 conversations of 3 turns, 2 clients, 1 round,
    one server at a time (about 3 minutes on 2 cores)."""
    from bench import multi_turn_client as mtc

    cr = mtc.ClientRun("qwen3-next-tiny", str(models_dir / "qwen3-next-tiny"),
                       mtc.Workload(conversations=4, clients=2, turns=3, prefix_tokens=200, message_tokens=40,
                                    answer_tokens=4), rounds=1, env={"VLLM_CPU_KVCACHE_SPACE": "1"})
    return mtc.run([cr], work_dir=str(tmp_path), out_dir=tmp_path, name="multi_turn_client_small"), tmp_path


@pytest.mark.e2e
@pytest.mark.long  # three servers and vLLM's client (fetched once from vLLM's sdist): minutes on 2 cores
@pytest.mark.prefetch.with_args(_bench_multi_turn_client_small)
def test_bench_multi_turn_client_small(prefetched) -> None:
    """vLLM's own multi-turn client ran against each configuration: every request it asked completed
    (its stats and the servers' counters), every answer has text, ours restored tokens from its
    tier and recompute none, and the JSON holds every figure the table reads."""
    from collections import Counter

    from bench import multi_turn_client as mtc

    doc, out = prefetched(_bench_multi_turn_client_small)
    assert json.loads((out / "multi_turn_client_small.json").read_text())["models"] == json.loads(
        json.dumps(doc["models"]))
    [m] = doc["models"]
    assert m["client"]["provenance"]["version"] == mtc.vllm_version()
    args = m["serve_args"]
    assert args[args.index("--chat-template") + 1] == str(mtc.CHAT_TEMPLATE)
    assert args[args.index("--logits-processors") + 1] == mtc.LOGITS_PROCESSOR
    [rnd] = m["rounds"]
    for c in mtc.CONFIGS:
        cl, sv = rnd[c]["client"], rnd[c]["server"]
        assert cl["requests_completed"] == cl["expected_requests"] == 12 and cl["failed"] == 0, (c, cl)
        assert cl["conversations_completed"] == 4, c
        assert sv["finished_requests"] >= 12, (c, sv)  # the flush request may land in it too
        # The client's stats may miss a last result (it polls its result queue's empty()).
        reqs = rnd[c]["requests"]
        assert 12 - 2 <= len(reqs) == cl["requests_measured"] <= 12, c
        assert all(r["ttft_ms"] > 0 for r in reqs), c
        assert all(n <= 4 for n in Counter(r["input_num_turns"] for r in reqs).values()), c
        assert {r["input_num_turns"] for r in reqs} == {1, 3, 5}, c
        assert all(len(a) == 3 and all(t.strip() for t in a) for a in rnd[c]["answers"]), c
    assert rnd["ours"]["server"]["restored_tokens"] > 0, rnd["ours"]["server"]
    assert sum(rnd["ours"]["server"]["restored_bytes"].values()) > 0
    assert rnd["none"]["server"]["restored_tokens"] == 0
    s = m["summary"]
    assert json.loads(json.dumps(mtc.summarize(m))) == json.loads(json.dumps(s))
    assert s["all_requests_succeeded"] == {c: True for c in mtc.CONFIGS}
    for key, _, _ in mtc.METRICS:
        row = s["metrics"][key]
        assert all(row[c]["median"] is not None for c in mtc.CONFIGS), key
    assert s["metrics"]["restored_tokens"]["ours"]["median"] > 0
    assert s["metrics"]["ttft_p50_ms"]["ours_over_vllm"]["median"] > 0
    mtc.print_tables(m)


def test_multi_turn_client_summary_is_recomputed_from_the_committed_rounds(capsys) -> None:
    """docs/performance.md's small-size table of vLLM's multi-turn client comes from `summarize`
    over the committed rounds (rotated order), and every request of every round completed."""
    from bench import multi_turn_client as mtc

    doc = json.loads((REPO / "bench" / "results" / "vllm_client_multi_turn_tiny.json").read_text())
    for m in doc["models"]:
        assert [r["order"] for r in m["rounds"]][:3] == [["ours", "vllm", "none"], ["vllm", "none", "ours"],
                                                         ["none", "ours", "vllm"]]
        assert json.loads(json.dumps(mtc.summarize(m))) == json.loads(json.dumps(m["summary"]))
        assert m["summary"]["all_requests_succeeded"] == {c: True for c in mtc.CONFIGS}
        mtc.print_tables(m)
        assert "restored tokens" in capsys.readouterr().out


@pytest.mark.long  # `make test` stays within 12 minutes (docs/development.md)
def test_vllm_wait_tail_changes_only_the_tail_condition_in_its_own_process() -> None:
    """bench/vllm_wait_tail.py (peer_race's what-if): applied in a process of its own (never in this
    one, whose vLLM other tests use), once; the patched `_lookup` reads `complete_hit` once less (the
    dropped `and complete_hit == 0`) and is otherwise vLLM's own code."""
    code = (
        "import dis, json\n"
        "from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import "
        "OffloadingConnectorScheduler as S\n"
        "from bench.vllm_wait_tail import patch_wait_tail\n"
        "def loads(f): return [i.argval for i in dis.get_instructions(f) if i.opname.startswith('LOAD_FAST')]\n"
        "before = loads(S._lookup)\n"
        "first, again = patch_wait_tail(), patch_wait_tail()\n"
        "after = loads(S._lookup)\n"
        "print(json.dumps([first, again, before.count('complete_hit') - after.count('complete_hit'),"
        " sorted(set(before) ^ set(after)), S._lookup.kvoffload_wait_tail]))\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads(p.stdout.strip().splitlines()[-1]) == [True, False, 1, [], True]
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import OffloadingConnectorScheduler

    assert not hasattr(OffloadingConnectorScheduler._lookup, "kvoffload_wait_tail"), "not in this process"
