"""`kvoffload` commands without an engine: check-config on real config files,
the prompt file format, size parsing, usage errors and exit codes, and the
--verify verdict on real result records. Engine-backed tests (stats, fsck and
gc on a cache a real engine wrote, warmup --verify, gc then a restart) are in
tests/test_cli_e2e.py."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import harness.cli
from offload import cli
from offload.cli.gc import parse_size
from offload.cli.prompts import PromptFileError, load, token_ids
from offload.cli.warmup import expected, verdict, warm_line, warm_start
from offload.engine_run import PromptResult, RunResult
from offload.planner import GroupKind, GroupSpec, HybridOffloadPlanner
from offload.store.cachedir.paths import LAYOUT_DIR

REPO = Path(__file__).resolve().parents[1]


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    try:
        rc = cli.main(list(argv))
    except SystemExit as e:  # argparse usage errors
        rc = int(e.code)
    out = capsys.readouterr()
    return rc, out.out + out.err


def json_cli(*argv: str) -> tuple[int, str]:
    """A run whose output is parsed as JSON: in a process of its own (harness/cli.py), its stdout
    alone (in-process, what this process's engine lanes print would be in it)."""
    r = harness.cli.run_cli(*argv)
    return r.returncode, r.stdout


def write(tmp_path: Path, name: str, doc) -> str:
    p = tmp_path / name
    p.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return str(p)


# ---- check-config ---------------------------------------------------------------------


@pytest.mark.parametrize("name", ["fs.json", "cpu.json", "hybrid-tiered.json", "attention-tiered-lmcache.json"])
def test_check_config_accepts_the_shipped_configs(capsys, name):
    rc, out = run_cli(capsys, "check-config", str(REPO / "configs" / name))
    assert rc == 0, out
    assert "valid" in out


def test_check_config_reports_every_problem_with_key_value_and_what_is_valid(capsys, tmp_path):
    bad = {
        "kv_connector": "OffloadMultiConnector", "kv_connector_module_path": "offload.connector",
        "kv_role": "kv_boht",
        "kv_connector_extra_config": {"children": [
            {"kv_connector": "OffloadConnector", "kv_connector_module_path": "offload.connector",
             "kv_role": "kv_both",
             "kv_connector_extra_config": {"store": "fs", "path": "relative/dir", "io_threads": 0, "colour": 1}},
            {"kv_connector": "OffloadConnector", "kv_connector_module_path": "offload.connector",
             "kv_role": "kv_both", "kv_connector_extra_config": {"store": "cpu"}, "load_weight": -1},
        ]},
    }
    rc, out = run_cli(capsys, "check-config", write(tmp_path, "bad.json", bad))
    assert rc == 1, out
    lines = [ln for ln in out.splitlines() if ln.startswith(str(tmp_path))]
    expect = [
        ("kv_role='kv_boht'", "kv_both"),
        ("kv_connector_module_path='offload.connector'", "'offload.multi_connector'"),
        ("children[0].kv_connector_extra_config.path='relative/dir'", "absolute"),
        ("children[0].kv_connector_extra_config.io_threads=0", "greater than or equal to 1"),
        ("children[0].kv_connector_extra_config.colour", "valid keys are"),
        ("children[1].load_weight=-1", "positive number"),
        ("children[1].kv_connector_extra_config.cpu_bytes", "required"),
    ]
    for key, valid in expect:
        assert any(key in ln and valid in ln for ln in lines), (key, out)
    assert f"{len(expect)} problems found" in out


def test_check_config_single_connector_and_vllm_level_keys(capsys, tmp_path):
    bad = {"kv_connector": "OffloadConnector", "kv_role": "kv_both", "kv_load_failure_policy": "retry", "foo": 1,
           "kv_connector_extra_config": {"store": "fs", "path": "/tmp/x", "hybrid_chunk_size": "256"}}
    rc, out = run_cli(capsys, "check-config", write(tmp_path, "bad.json", bad))
    assert rc == 1, out
    assert "kv_load_failure_policy='retry'" in out and "'recompute' or 'fail'" in out
    assert "foo=1: unknown key" in out
    assert "kv_connector_module_path=None" in out
    assert "hybrid_chunk_size='256'" in out and "integer" in out


@pytest.mark.parametrize("path,what", [("/proc/version", "is a regular file"),
                                       ("/dev/null", "is a character device"),
                                       ("<tmp>/afile/kv", "afile is a regular file")])
def test_check_config_refuses_a_path_that_exists_and_is_not_a_directory(capsys, tmp_path, path, what):
    (tmp_path / "afile").write_text("x")
    path = path.replace("<tmp>", str(tmp_path))
    cfg = {"kv_connector": "OffloadConnector", "kv_connector_module_path": "offload.connector",
           "kv_role": "kv_both", "kv_connector_extra_config": {"store": "fs", "path": path}}
    rc, out = run_cli(capsys, "check-config", write(tmp_path, "file.json", cfg))
    assert rc == 1, out
    [line] = [ln for ln in out.splitlines() if "kv_connector_extra_config.path" in ln]
    assert f"path={path!r}" in line and what in line and "choose a directory" in line, out


def test_check_config_names_vllms_multiconnector_mistake_and_unreadable_files(capsys, tmp_path):
    child = json.loads((REPO / "configs" / "fs.json").read_text())
    cfg = {**child, "kv_connector": "MultiConnector", "kv_connector_module_path": "offload.multi_connector",
           "kv_connector_extra_config": {"children": [child]}}
    rc, out = run_cli(capsys, "check-config", write(tmp_path, "multi.json", cfg))
    assert rc == 1 and "OffloadMultiConnector" in out, out
    rc, out = run_cli(capsys, "check-config", write(tmp_path, "broken.json", '{"kv_connector": '))
    assert rc == 2 and "cannot read JSON" in out
    rc, out = run_cli(capsys, "check-config", write(tmp_path, "list.json", [1]))
    assert rc == 1 and "JSON object" in out


# ---- prompt files ---------------------------------------------------------------------


def test_prompt_file_formats(tmp_path):
    jl = write(tmp_path, "p.jsonl", '{"prompt": "hello"}\n\n{"prompt_token_ids": [5, 6, 7], "id": 3}\n')
    ps = load(jl)
    assert [p.text for p in ps] == ["hello", None] and ps[1].token_ids == [5, 6, 7]
    txt = write(tmp_path, "p.txt", "first prompt\n\n  second {not json}\n")
    assert [p.text for p in load(txt)] == ["first prompt", "  second {not json}"]
    assert load(jl, "text")[0].text == '{"prompt": "hello"}'
    for body, msg in (('{"prompt": ""}', "prompt"), ('{"prompt_token_ids": [1, -2]}', "token ids"),
                      ("[1, 2]", "object"), ("not json", "not JSON"), ("\n\n", "no prompts")):
        with pytest.raises(PromptFileError, match=msg):
            load(write(tmp_path, "bad.jsonl", body))


def test_text_prompts_use_the_models_tokenizer_or_fail_clearly(models_dir, tmp_path):
    ps = load(write(tmp_path, "p.txt", "hello world\n"))
    [ids] = token_ids(ps, str(models_dir / "qwen3-next-tiny"))
    assert len(ids) > 2 and all(isinstance(i, int) for i in ids)
    bare = tmp_path / "no-tokenizer"
    bare.mkdir()
    shutil.copy(models_dir / "qwen3-next-tiny" / "config.json", bare)
    with pytest.raises(PromptFileError, match=r"need a tokenizer.*prompt_token_ids"):
        token_ids(ps, str(bare))
    # Token ids need no tokenizer at all.
    assert token_ids(load(write(tmp_path, "i.jsonl", '{"prompt_token_ids": [1, 2]}')), str(bare)) == [[1, 2]]


# ---- sizes, usage errors, exit codes ----------------------------------------------------------


def test_parse_size_suffixes():
    assert parse_size("1024") == 1024
    assert parse_size("512M") == 512 << 20
    assert parse_size("2G") == 2 << 30
    assert parse_size("1.5k") == 1536
    assert parse_size("3GiB") == 3 << 30
    with pytest.raises(Exception, match="512M"):
        parse_size("lots")


def test_usage_errors_exit_2(capsys, tmp_path):
    prompts = write(tmp_path, "p.jsonl", '{"prompt_token_ids": [1, 2, 3]}\n')
    rc, out = run_cli(capsys, "warmup", "--prompts", prompts, "--url", "http://127.0.0.1:9", "--verify")
    assert rc == 2 and "cannot be restarted" in out
    rc, out = run_cli(capsys, "warmup", "--prompts", prompts, "--model", "m")
    assert rc == 2 and "--config is required" in out
    rc, out = run_cli(capsys, "warmup", "--prompts", write(tmp_path, "bad.jsonl", "x"), "--model", "m", "--config", "c")
    assert rc == 2 and "not JSON" in out
    for cmd in ("stats", "fsck", "gc"):
        extra = ["--max-bytes", "1G"] if cmd == "gc" else []
        rc, out = run_cli(capsys, cmd, str(tmp_path), *extra)
        assert rc == 2 and LAYOUT_DIR in out, (cmd, out)
    rc, _ = run_cli(capsys, "gc", str(tmp_path), "--max-bytes", "lots")
    assert rc == 2


def test_console_script_is_installed():
    exe = Path(sys.executable).with_name("kvoffload")
    assert exe.exists(), "pip install -e . (make setup) installs the kvoffload console script"
    out = subprocess.run([str(exe), "--help"], capture_output=True, text=True, check=True).stdout
    for cmd in ("warmup", "stats", "fsck", "gc", "check-config"):
        assert cmd in out


# ---- the --verify verdict -------------------------------------------------------------


def _result(n_tokens: int, cached: int, out: list[int], failed: bool = False) -> PromptResult:
    return PromptResult(prompt_tokens=n_tokens, cached_tokens=cached, restored_tokens=cached, load_failed=failed,
                        ttft_s=0.01, output_ids=out)


def test_verify_verdict_passes_only_a_full_identical_restore():
    attn = HybridOffloadPlanner([GroupSpec(GroupKind.FULL_ATTENTION, 128, 4096, 2)], 256)
    run1 = RunResult([_result(600, 0, [1, 2]), _result(300, 0, [3])], "")
    good = RunResult([_result(600, 512, [1, 2]), _result(300, 256, [3])], "")
    assert verdict(run1, [good], attn) == []
    short = RunResult([_result(600, 256, [1, 2]), _result(300, 256, [3])], "")
    assert "1 prompts below" in verdict(run1, [short], attn)[0]
    differs = RunResult([_result(600, 512, [1, 9]), _result(300, 256, [3])], "")
    assert "outputs differ" in verdict(run1, [differs], attn)[0]
    failed = RunResult([_result(600, 512, [1, 2], failed=True), _result(300, 256, [3])], "")
    assert "loads failed" in verdict(run1, [failed], attn)[0]
    assert "2 again (reset)" in verdict(run1, [good, short], attn)[0]


def test_run_2s_warm_start_figures_come_from_its_engines_metrics():
    """Samples as an engine exports them (two tiers' labels; only host memory's warm start counts);
    none where the engine had no warm start, or planned nothing."""
    samples = [("kvoffload_warm_planned_entries", {"tier": "cpu"}, 32.0),
               ("kvoffload_warm_entries_total", {"tier": "cpu"}, 31.0),
               ("kvoffload_warm_bytes_total", {"tier": "cpu"}, 5.5 * 2**20),
               ("kvoffload_warm_failures_total", {"tier": "cpu", "reason": "corrupt"}, 1.0),
               ("kvoffload_warm_failures_total", {"tier": "cpu", "reason": "missing"}, 0.0),
               ("kvoffload_warm_done", {"tier": "cpu"}, 1.0), ("kvoffload_warm_seconds", {"tier": "cpu"}, 0.25),
               ("kvoffload_warm_hits_total", {"tier": "cpu"}, 90.0),
               ("kvoffload_restored_tokens_total", {"tier": "fs"}, 512.0)]
    w = warm_start(RunResult([], "", samples))
    assert w == {"planned_entries": 32, "entries": 31, "bytes": 5767168, "failures": 1, "done": 1,
                 "seconds": 0.25, "hits": 90}
    assert warm_line("run 2", w) == ("warm start (run 2): 31 of 32 planned entries copied into host memory, "
                                     "5.5 MiB, done in 0.25 s; 90 loads served from warmed entries; 1 failed")
    assert "not done" in warm_line("run 2", {**w, "done": 0, "seconds": 0.0})
    assert warm_start(RunResult([], "", samples[-1:])) is None, "no warm start in the engine"
    off = [("kvoffload_warm_planned_entries", {"tier": "cpu"}, 0.0), ("kvoffload_warm_hits_total", {"tier": "cpu"}, 0)]
    assert warm_start(RunResult([], "", off)) is None, "warm start off, or nothing in the files"
    assert warm_line("run 2", None).startswith("warm start (run 2): none")


def test_verify_expects_a_chunk_aligned_prompt_whole_on_attention_only_models():
    """512 tokens in 256-token chunks: attention only restores both chunks
    (at least 511 must be reported cached: vLLM computes the last token
    again); a hybrid stops a chunk short (its state at 512 holds the last token)."""
    attn = HybridOffloadPlanner([GroupSpec(GroupKind.FULL_ATTENTION, 128, 4096, 2)], 256)
    hybrid = HybridOffloadPlanner([GroupSpec(GroupKind.FULL_ATTENTION, 256, 4096, 1),
                                   GroupSpec(GroupKind.MAMBA, 256, 4096, 3)], 256)
    assert expected(512, attn) == 511 and expected(513, attn) == 512 and expected(511, attn) == 256
    assert expected(512, hybrid) == 256 and expected(513, hybrid) == 512
    run1 = RunResult([_result(512, 0, [1])], "")
    assert verdict(run1, [RunResult([_result(512, 256, [1])], "")], hybrid) == []
    assert "1 prompts below" in verdict(run1, [RunResult([_result(512, 256, [1])], "")], attn)[0]
    assert verdict(run1, [RunResult([_result(512, 511, [1])], "")], attn) == []


# ---- stats, fsck and gc with the ledger (files written through FileStore, no engine) ------------


def _ledger_cache(tmp_path: Path):
    """A cache of 8 prompts (attention chains plus Mamba states) with its layout.json, and an
    engine-like account on it that has loaded its index (as a running engine's housekeeper has)."""

    from ledger_instance import FP, true_bytes, write_prompt
    from offload.store.cachedir.budget import DirBudget
    from offload.store.files import FileStore

    top = tmp_path / LAYOUT_DIR
    live = DirBudget(top)
    import dataclasses
    store = dataclasses.replace(FileStore.open(str(tmp_path), FP), account=live)
    store.write_layout({"chunk_size": 256, "groups": [{"spec": "MambaSpec(...)"}, {"spec": "FullAttentionSpec(...)"}],
                        "tensors": {}})
    for p in range(8):
        write_prompt(store, "cli", p)
    live.ensure_loaded()
    assert live.usage == true_bytes(top)
    return top, live, true_bytes


def test_gc_records_its_deletions_so_a_live_account_follows_without_a_walk(capsys, tmp_path):
    top, live, true_bytes = _ledger_cache(tmp_path)
    limit = true_bytes(top) // 2
    dirs = {p for p in top.rglob("*") if p.is_dir()}
    rc, out = run_cli(capsys, "gc", str(tmp_path), "--max-bytes", str(limit))
    assert rc == 0 and "fits" in out, out
    assert true_bytes(top) <= limit
    # The directories stay, emptied or not: the connector makes them at start-up, not while serving.
    assert {p for p in top.rglob("*") if p.is_dir()} == dirs
    assert any(not any(d.iterdir()) for d in dirs if d.parent.name.startswith("g")), "gc emptied none"
    live.sync()  # reads gc's log: no walk
    assert live.usage == true_bytes(top) and live.walks == 1
    rc, out = json_cli("stats", str(tmp_path), "--ledger", "--json")
    led = json.loads(out)["ledger"]
    assert rc == 0 and led["bytes"] == true_bytes(top) and led["logs"] >= 2 and not led["walked_to_load"]
    rc, out = json_cli("stats", str(tmp_path), "--json")
    rep = json.loads(out)
    assert rep["ledger"]["drift_bytes"] == 0 and rep["ledger"]["walk"]["bytes"] == true_bytes(top)
    assert rep["other_entries"] == [], "ledger-v1/ is not an unknown entry"


def test_gc_evicts_files_stored_cold_first_each_on_its_own_then_whole_chunks(capsys, tmp_path):
    """As the connector's budget does: files the ledger marks cold (internal
    states, a partial tail's halves) that no load touched since go first,
    oldest first, and leave their chunks' attention files; a cold state that
    was loaded since is an ordinary one."""
    import dataclasses
    import os
    import time

    import torch

    from ledger_instance import ATTN, FP, GDN, key, true_bytes
    from offload.planner import GroupKind
    from offload.store.cachedir.budget import DirBudget
    from offload.store.files import FileStore
    from offload.store.format import ChunkHeader

    top = tmp_path / LAYOUT_DIR
    store = dataclasses.replace(FileStore.open(str(tmp_path), FP), account=DirBudget(top))
    store.write_layout({"chunk_size": 256, "groups": [{"spec": "MambaSpec(...)"}, {"spec": "FullAttentionSpec(...)"}],
                        "tensors": {}})
    states = []
    for c in range(4):  # one prompt: internal states cold, the tail state hot
        k = key("cold-gc", 0, c)
        parent = bytes(key("cold-gc", 0, c - 1))[:8] if c else bytes(8)
        store.write(ChunkHeader(FP, k, ATTN, GroupKind.FULL_ATTENTION, c * 256, (c + 1) * 256, 1, 32768,
                                parent=parent), torch.full((32768,), c, dtype=torch.uint8))
        store.write(ChunkHeader(FP, k, GDN, GroupKind.MAMBA, c * 256, (c + 1) * 256, 1, 4096),
                    torch.full((4096,), c, dtype=torch.uint8), cold=c < 3)
        states.append(store.file_path(GDN, k))
        time.sleep(0.01)
    # The attention half of the prompt's partial tail, stored cold under by_use; nothing chains from it.
    tk = key("cold-gc-tail", 0, 3)
    store.write(ChunkHeader(FP, tk, ATTN, GroupKind.FULL_ATTENTION, 3 * 256, 3 * 256 + 64, 1, 32768,
                            parent=bytes(key("cold-gc", 0, 2))[:8]), torch.full((32768,), 9, dtype=torch.uint8),
                cold=True)
    tail = store.file_path(ATTN, tk)
    time.sleep(0.02)
    os.utime(states[1])  # loaded since it was stored: no longer cold
    rc, out = json_cli("stats", str(tmp_path), "--ledger", "--json")
    by_group = {g["group"]: g for g in json.loads(out)["ledger"]["fingerprints"][FP.hex()]}
    assert (by_group[GDN]["files"], by_group[GDN]["cold_files"], by_group[ATTN]["cold_files"]) == (4, 2, 1)
    assert by_group[GDN]["cold_bytes"] == 2 * states[0].stat().st_size, "the loaded one is no longer cold"
    # Warm start would choose among the rest: 4 attention chunks and 2 states (9 files, 3 of them cold).
    assert json.loads(out)["ledger"]["warm_start_candidates"]["files"] == 6
    rc, out = run_cli(capsys, "gc", str(tmp_path), "--max-bytes", str(true_bytes(top) - 1))
    assert rc == 0 and "deleted 1 of 3 files stored cold" in out, out
    assert [p.exists() for p in states] == [False, True, True, True], "the oldest cold state went, alone"
    rc, out = run_cli(capsys, "gc", str(tmp_path), "--max-bytes", str(true_bytes(top) - 1))
    assert rc == 0 and "deleted 1 of 2 files stored cold" in out, out
    assert [p.exists() for p in states] == [False, True, False, True] and tail.exists()
    rc, out = run_cli(capsys, "gc", str(tmp_path), "--max-bytes", str(true_bytes(top) - 1))
    assert rc == 0 and "deleted 1 of 1 files stored cold" in out and not tail.exists(), out
    assert len(list(top.glob(f"*/g{ATTN}/*/*.kv"))) == 4, "no chunk was touched"
    rc, out = run_cli(capsys, "gc", str(tmp_path), "--max-bytes", str(true_bytes(top) - 1))
    assert rc == 0 and "stored cold" not in out and "deleted 1 least recently used chunks" in out, out


def test_fsck_reports_ledger_drift_and_repair_reconciles_it_for_live_accounts(capsys, tmp_path):
    top, live, true_bytes = _ledger_cache(tmp_path)
    rc, out = run_cli(capsys, "fsck", str(tmp_path))
    assert rc == 0 and "clean" in out and "off by +0 bytes" in out, out
    victim = sorted(top.glob("*/g0/*/*.kv"))[5]  # a Mamba state: no chain hole, only drift
    size = victim.stat().st_size
    victim.unlink()  # by hand: no record
    rc, out = run_cli(capsys, "fsck", str(tmp_path))
    assert f"off by +{size} bytes" in out, out
    rc, out = run_cli(capsys, "fsck", str(tmp_path), "--repair")
    assert "1 entries corrected; new snapshot written" in out, out
    live.sync()
    live.maintain()  # adopts the reconciled snapshot
    assert live.usage == true_bytes(top) and live.walks == 1
