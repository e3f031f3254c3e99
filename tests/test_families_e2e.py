"""Nemotron-H, Falcon-H1 and Granite-4.0-H (vLLM's Mamba-2 hybrids) end to end on vLLM-CPU: after a
restart, the tiered config restores exactly what vLLM's own prefix cache hits in one process, with the
tokens of a reference engine.

Per family, the per-layer geometry from `tools/tiny_models.py` (the real model's widths, head counts,
state sizes and dtypes; one or two layers), the flags `kvoffload plan` prints for it here (its block
size is vLLM's: thousands of tokens on some CPUs, so every length below comes from the plan), and
`configs/hybrid-tiered.json` with `path` changed and warm start off. Prompts: A (one and a half blocks), its next
turn (A + 40 tokens) and a prompt sharing A's first 1.25 blocks. Four engine processes:
- own: [A, A, next turn, shared] in one pass on an empty directory E: vLLM's own prefix cache serves
  the last three (asserted: nothing restored), so their cached tokens are what vLLM hits in-process;
- ref: the same prompts, prefix caching skipped per request, with a connector that does nothing
  (tests/noop_connector.py): the reference tokens;
- cold: A alone on directory D;
- restart: a new process on D, [A], [next turn], [shared] in passes of their own (vLLM's prefix
  cache emptied in between): each restores exactly vLLM's own in-process hit, greedy tokens equal
  the reference's, no load fails.
D's files are byte-identical to the same entries in E (two engines stored them), and `kvoffload
fsck`'s scan of D verifies every payload and finds no problem and no hole.

The plan gives these families a prefix-match unit: their Mamba-2 layers keep the state at the
prompt's unit-aligned tail from inside the forward pass, and vLLM-CPU 0.32 hits there. So vLLM's own
hits (and ours after the restart) are A's unit-aligned tail for A's repeat and its next turn, and
the block boundary for the shared prompt (no state is kept inside the block there). Where a plan
gives no unit, every hit is the block boundary.

All three run in `make test-long` (each is minutes of engine work on 2 cores). Jamba and Qwen3.5,
which vLLM-CPU 0.32 cannot serve, are covered on vLLM's Scheduler (tests/test_families_units.py).
"""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, random_prompt, shipped_config, side_by_side
from harness.engine import RunSpec, run_engine
from offload.store.cachedir.paths import LAYOUT_DIR

pytestmark = pytest.mark.e2e

MAX_LEN = 8192
FALCON = "falcon-h1-7b-geometry"
GRANITE = "granite-4.0-h-small-geometry"
NEMOTRON = "nemotron-h-9b-geometry"
NAMES = ("A again", "next turn", "shared prefix")


def family_model(models_dir: Path, name: str) -> str:
    """The geometry's directory; built (tools/tiny_models.py) where an older setup left it out."""
    if not (models_dir / name / "config.json").exists():
        subprocess.run([sys.executable, str(REPO / "tools" / "tiny_models.py"), str(models_dir)], check=True)
    return str(models_dir / name)


def prompts_for(chunk: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    a = random_prompt(rng, chunk + chunk // 2 + 10)
    return [a, a + random_prompt(rng, 40), a[:chunk + chunk // 4] + random_prompt(rng, 30)]


def scenario(models_dir: Path, tmp_path: Path, name: str) -> dict:
    """The four engines of the module docstring."""
    from noop_connector import KV as NOOP
    from noop_connector import pythonpath
    from offload.plan.run import plan_for_model

    model = family_model(models_dir, name)
    plan = plan_for_model(model, max_model_len=MAX_LEN)
    c = plan.hybrid_chunk_size
    prompts = prompts_for(c, len(name))
    args = {**plan.engine_kwargs, "max_model_len": MAX_LEN, "enforce_eager": True}
    d, e = tmp_path / "d", tmp_path / "e"
    d.mkdir()
    e.mkdir()
    def tiered(p: Path) -> dict:
        # Warm start off: the first restore after the restart then reads the files themselves, which
        # is what this test follows (with it on, the same bytes come through host memory).
        kv = shipped_config("hybrid-tiered.json", p)
        kv["kv_connector_extra_config"]["warm_start"] = False
        return kv

    runs = side_by_side(
        lambda: run_engine(RunSpec(model, prompts, tiered(e), 8, args, order=[[0, 0, 1, 2]]), timeout_s=1500),
        lambda: run_engine(RunSpec(model, prompts, NOOP, 8, args, skip_prefix_cache=True),
                           env={"PYTHONPATH": pythonpath()}, timeout_s=1500),
        lambda: run_engine(RunSpec(model, prompts[:1], tiered(d), 8, args), timeout_s=1500),
    )
    restart = run_engine(RunSpec(model, prompts, tiered(d), 8, args, order=[[0], [1], [2]]), timeout_s=1500)
    files = {name: {p.relative_to(x): p.read_bytes() for p in x.glob(f"{LAYOUT_DIR}/*/g*/*/*.kv")}
             for name, x in (("d", d), ("e", e))}
    return {"plan": plan, "prompts": prompts, "own": runs[0], "ref": runs[1], "cold": runs[2], "restart": restart,
            "files": files, "d": d}


def expected_hits(plan, prompts: list[list[int]]) -> list[int]:
    """vLLM's own hits by the plan: A's unit-aligned tail for A's repeat and its next turn (the block
    boundary where the plan has no unit), the block boundary for the shared prompt."""
    c, unit = plan.hybrid_chunk_size, plan.prefix_match_unit or plan.hybrid_chunk_size
    tail = (len(prompts[0]) - 1) // unit * unit
    return [tail, tail, c]


def check_family(runs: dict) -> list[tuple[int, int]]:
    """Every claim of the module docstring; returns (vLLM's own hit, restored) per prompt."""
    plan = runs["plan"]
    own, ref, cold, restart = runs["own"], runs["ref"], runs["cold"], runs["restart"]
    c = plan.hybrid_chunk_size
    # Every Mamba-2 family gets a unit (vLLM-CPU hits inside the block for them), and the flags carry it.
    assert plan.prefix_match_unit and "inside the forward pass" in plan.prefix_match, plan.describe()
    assert plan.engine_kwargs["prefix_match_unit"] == plan.prefix_match_unit
    assert {g.kind for g in plan.groups} == {"mamba", "full_attention"} and plan.block_sizes == [c] * 2
    for run in (own, ref, cold):
        assert run.restored_tokens == 0, "the references restore nothing"
    assert ref.cached_tokens == 0, "the reference computes every token"
    assert own.results[0].cached_tokens == 0 and cold.results[0].cached_tokens == 0, "both start cold"
    vllm_hits = [r.cached_tokens for r in own.results[1:]]
    expect = expected_hits(plan, runs["prompts"])
    assert expect[0] % c, "A's unit-aligned tail lies inside its second block"
    assert vllm_hits == expect, (vllm_hits, expect)
    restored = [r.restored_tokens for r in restart.results]
    assert restored == vllm_hits, (restored, vllm_hits)
    assert [r.cached_tokens for r in restart.results] == restored, "after a restart all of it comes from the tiers"
    assert restart.results[0].restored_by_tier.get("fs") == expect[0], "the first restore after the restart reads files"
    assert not any(r.load_failed for r in restart.results)
    # Greedy tokens: the do-nothing connector's run is the reference for every run of ours.
    ref_out = {i: r.output_ids for i, r in zip(ref.index_of, ref.results)}
    assert [r.output_ids for r in restart.results] == [ref_out[i] for i in range(3)]
    assert [r.output_ids for r in own.results] == [ref_out[i] for i in own.index_of]
    assert cold.results[0].output_ids == ref_out[0]
    # Files: D holds A's chunk and every prompt's own tail (A's; the shared prompt's, stored after its
    # restore; the next turn's is A's) in both groups; E (the own run) holds the same entries, byte for byte.
    from offload.planner import HybridOffloadPlanner

    planner = HybridOffloadPlanner(plan.specs, c, tail_unit=plan.prefix_match_unit)
    tails = {tuple(p[:t]) for p in runs["prompts"] if (t := planner.tail_boundary(len(p)))}
    d_files, e_files = runs["files"]["d"], runs["files"]["e"]
    assert len(d_files) == len(plan.groups) * (1 + len(tails)), (len(tails), sorted(map(str, d_files)))
    for rel, data in d_files.items():
        assert e_files.get(rel) == data, f"{rel}: differs between two engines that stored the same prefix"
    # fsck: every payload verifies, the chain is complete, nothing orphaned.
    from offload.cli.cache import scan
    from offload.cli.chains import chunks

    [fp] = scan(runs["d"], verify_payloads=True).dirs
    assert fp.files and [x.problem for x in fp.files if x.problem] == []
    linked = chunks(fp)
    assert linked and all(k.complete and k.orphan is None for k in linked.values())
    return list(zip(vllm_hits, restored))


def report(name: str, runs: dict, rows: list[tuple[int, int]]) -> None:
    plan = runs["plan"]
    print(f"\n{name}: {plan.cpu_isa} kernels, {plan.hybrid_chunk_size}-token blocks, prompts "
          f"{[len(p) for p in runs['prompts']]}, {plan.bytes_per_chunk} bytes per chunk")
    for what, (theirs, ours) in zip(NAMES, rows):
        print(f"  {what:<14} vLLM's own cache {theirs:>5}  ours after a restart {ours:>5}")


def _falcon_runs(models_dir, tmp_path):
    return scenario(models_dir, tmp_path, FALCON)


@pytest.mark.long  # 160 s of engine runs; the default suite covers the families on vLLM's Scheduler
@pytest.mark.prefetch.with_args(_falcon_runs)
def test_falcon_h1_restores_what_vllms_own_cache_hits(prefetched):
    runs = prefetched(_falcon_runs)
    report(FALCON, runs, check_family(runs))


@pytest.mark.long
def test_granite_4_0_h_restores_what_vllms_own_cache_hits(models_dir, tmp_path):
    runs = scenario(models_dir, tmp_path, GRANITE)
    report(GRANITE, runs, check_family(runs))


@pytest.mark.long
def test_nemotron_h_restores_what_vllms_own_cache_hits(models_dir, tmp_path):
    runs = scenario(models_dir, tmp_path, NEMOTRON)
    report(NEMOTRON, runs, check_family(runs))
