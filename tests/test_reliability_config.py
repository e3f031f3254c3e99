"""Malformed or dangerous configurations fail at start-up (docs/reliability.md, row 7).

Each case goes through the real start-up path, the connector's constructor
as vLLM calls it in the engine core (role SCHEDULER), with a real VllmConfig
of the tiny Qwen3-Next hybrid and its KV cache groups, but without loading
weights: every case must raise ConfigError with one message that names the
key (`kv_connector_extra_config.<key>`) and says how to fix it.
tests/test_e2e_server.py shows such an error reaching the operator of a real
engine start.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

from conftest import start_connector
from faults.report import record
from offload.config import ConfigError

OURS = {"kv_connector": "OffloadConnector", "kv_connector_module_path": "offload.connector", "kv_role": "kv_both"}
LMCACHE = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
GOOD_PATH = "<tmp>/cache"


def fs(**kw):
    return {"store": "fs", "path": GOOD_PATH, **kw}


# (id, extra config, key named, fragment of the fix)
CASES = [
    ("store-missing", {"path": GOOD_PATH}, "store", "'fs'"),
    ("store-unknown", fs(store="s3"), "store", "'fs'"),
    ("store-wrong-type", fs(store=1), "store", "'fs'"),
    ("path-missing", {"store": "fs"}, "path", "absolute cache directory"),
    ("path-relative", fs(path="cache/kv"), "path", "absolute path"),
    ("path-dotdot", fs(path="/var/cache/../../etc"), "path", "'..'"),
    ("path-not-string", fs(path=["/a"]), "path", "absolute cache directory"),
    ("path-nul", fs(path="/tmp/a\x00b"), "path", "NUL"),
    ("path-under-a-file", fs(path="<tmp>/afile/cache"), "path", "choose a directory"),
    ("path-unwritable-fs", fs(path="/proc/kvoffload"), "path", "choose a directory"),
    ("path-is-a-file", fs(path="/proc/version"), "path", "choose a directory"),
    ("path-is-a-tmp-file", fs(path="<tmp>/afile"), "path", "not a directory"),
    ("path-world-writable", fs(path="<tmp>/open"), "path", "chmod o-w"),
    ("unknown-key", fs(bucket="x"), "bucket", "valid keys are"),
    ("typo-key", fs(hybird_chunk_size=256), "hybird_chunk_size", "valid keys are"),
    ("chunk-not-multiple", fs(hybrid_chunk_size=300), "hybrid_chunk_size", "e.g. 128"),
    ("chunk-coarser-than-mamba-checkpoints", fs(hybrid_chunk_size=256), "hybrid_chunk_size", "set it to 128"),
    ("chunk-below-block", fs(hybrid_chunk_size=64), "hybrid_chunk_size", "multiples of 128"),
    ("chunk-zero", fs(hybrid_chunk_size=0), "hybrid_chunk_size", "greater than 0"),
    ("chunk-string", fs(hybrid_chunk_size="256"), "hybrid_chunk_size", "integer"),
    ("max-bytes-zero", fs(max_bytes=0), "max_bytes", "1 MiB to 1 PiB"),
    ("max-bytes-huge", fs(max_bytes=1 << 60), "max_bytes", "1 MiB to 1 PiB"),
    ("max-bytes-on-cpu", {"store": "cpu", "cpu_bytes": 1 << 30, "max_bytes": 1 << 30}, "max_bytes", "cpu_bytes"),
    ("cpu-bytes-zero", {"store": "cpu", "cpu_bytes": 0}, "cpu_bytes", "host memory"),
    ("cpu-bytes-huge", {"store": "cpu", "cpu_bytes": 1 << 60}, "cpu_bytes", "host memory"),
    ("cpu-bytes-missing", {"store": "cpu"}, "cpu_bytes", "budget in bytes"),
    ("cpu-bytes-on-fs", fs(cpu_bytes=1 << 30), "cpu_bytes", "max_bytes"),
    ("path-on-cpu", {"store": "cpu", "cpu_bytes": 1 << 30, "path": "/x"}, "path", '"store": "fs"'),
    ("pending-tiny", fs(max_pending_store_bytes=1), "max_pending_store_bytes", "dropped"),
    ("io-threads-zero", fs(io_threads=0), "io_threads", "greater than or equal to 1"),
    ("io-threads-string", fs(io_threads="4"), "io_threads", "I/O threads"),
    ("fsync-string", fs(fsync="yes"), "fsync", "boolean"),
    ("timeout-inf", fs(shutdown_timeout_s=math.inf), "shutdown_timeout_s", "shutdown waits"),
    ("file-mode-world-writable", fs(file_mode="0666"), "file_mode", "'0660'"),
    ("file-mode-owner-cannot-write", fs(file_mode="0440"), "file_mode", "read+write"),
    ("dir-mode-world-writable", fs(dir_mode="0777"), "dir_mode", "'0770'"),
    ("dir-mode-int", fs(dir_mode=750), "dir_mode", "octal string"),
    ("file-mode-symbolic", fs(file_mode="rw-r-----"), "file_mode", "octal string"),
    ("orphan-age-zero", fs(orphan_tmp_age_s=0), "orphan_tmp_age_s", "60 s to 7 days"),
    ("name-with-slash", fs(name="a/b"), "name", "tier's name"),
    ("model-id-empty", fs(model_id=""), "model_id", "identity of the model"),
    ("name-too-long", fs(name="x" * 65), "name", "tier's name"),
    ("lmcache-child-on-hybrid", {"children": [LMCACHE, {**OURS, "kv_connector_extra_config": fs()}]},
     "children[0].kv_connector", "Mamba"),
]


# vllm_setup (tests/conftest.py): a real VllmConfig of the tiny hybrid and its KV cache groups.
_start = start_connector  # what vLLM's connector factory does in the engine core


def _subst(v, tmp: Path):
    if isinstance(v, str):
        return v.replace("<tmp>", str(tmp))
    if isinstance(v, dict):
        return {k: _subst(x, tmp) for k, x in v.items()}
    if isinstance(v, list):
        return [_subst(x, tmp) for x in v]
    return v


def test_good_config_starts(vllm_setup, tmp_path):
    conn = _start(vllm_setup, {**OURS, "kv_connector_extra_config": {"store": "fs", "path": str(tmp_path / "c"),
                                                                      "max_bytes": 1 << 30, "file_mode": "0660",
                                                                      "dir_mode": "0770"}})
    assert conn.planner.chunk_size == 128  # a hybrid's default: the block-size LCM


@pytest.mark.parametrize("cores,reserved,warned", [(2, None, True), (2, "1", False), (64, None, False)])
def test_cpu_core_reservation_warning_names_the_fix(vllm_setup, tmp_path, monkeypatch, caplog, cores, reserved,
                                                     warned):
    """vLLM-CPU reserves one core more for any connector; on a machine with no more cores than that it
    reserves none, and decode slows by 20% (docs/operations.md#cpu-machines). The start-up says so."""
    import logging

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(cores)))
    if reserved is None:
        monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    else:
        monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", reserved)
    ours = logging.getLogger("offload")  # prints through vLLM's handlers, without propagating
    ours.addHandler(caplog.handler)
    try:
        _start(vllm_setup, {**OURS, "kv_connector_extra_config": {"store": "fs", "path": str(tmp_path / "c")}})
    finally:
        ours.removeHandler(caplog.handler)
    hits = [r.getMessage() for r in caplog.records if "VLLM_CPU_NUM_OF_RESERVED_CPU" in r.getMessage()]
    assert bool(hits) == warned, hits
    if warned:
        assert "Set VLLM_CPU_NUM_OF_RESERVED_CPU=1" in hits[0] and f"this machine has {cores}" in hits[0]


def test_at_least_30_bad_configs_fail_at_start_up_naming_key_and_fix(vllm_setup, tmp_path):
    assert len(CASES) >= 30
    (tmp_path / "afile").write_text("not a directory")
    (tmp_path / "open").mkdir()
    os.chmod(tmp_path / "open", 0o777)
    failures = []
    for name, extra, key, fix in CASES:
        extra = _subst(extra, tmp_path)
        if isinstance(extra, dict) and "children" in extra:
            ktc = {"kv_connector": "OffloadMultiConnector", "kv_connector_module_path": "offload.multi_connector",
                   "kv_role": "kv_both", "kv_connector_extra_config": extra}
        else:
            ktc = {**OURS, "kv_connector_extra_config": extra}
        try:
            _start(vllm_setup, ktc)
        except ConfigError as e:
            msg = str(e)
            named = f"kv_connector_extra_config.{key}" in msg if key else "kv_connector_extra_config" in msg
            problems = msg.count("\n  ") if msg.startswith("invalid OffloadConnector config") else 1
            if not named or fix not in msg or problems != 1 or "errors.pydantic.dev" in msg:
                failures.append(f"{name}: unclear message: {msg!r}")
        except Exception as e:
            failures.append(f"{name}: {type(e).__name__} instead of ConfigError: {e}")
        else:
            failures.append(f"{name}: started")
    print(f"\nbad configurations: {len(CASES)}, refused at start-up with the key and a fix: "
          f"{len(CASES) - len(failures)}")
    assert not failures, "\n".join(failures)
    record("7 malformed or dangerous configurations, through the connector's start-up (scheduler role, "
           "real VllmConfig)", "table of bad kv_connector_extra_config values", len(CASES), "-", 0, "-",
           refused_with_key_and_fix=f"{len(CASES)}/{len(CASES)}")


@pytest.mark.parametrize("target", ["/proc/version", "<tmp>/afile", "<tmp>/afile/cache"])
def test_start_up_refuses_a_path_that_is_not_a_directory(vllm_setup, tmp_path, monkeypatch, target):
    """The start-up check on its own (the config validated elsewhere, or the file created since): a path that
    exists and is not a directory is refused with the key, the value and the fix."""
    import offload.config
    import offload.store.options

    (tmp_path / "afile").write_text("not a directory")
    path = _subst(target, tmp_path)
    monkeypatch.setattr(offload.store.options, "not_a_directory", lambda p: None)  # what parse_config saw
    cfg = offload.config.parse_config({"store": "fs", "path": path})
    monkeypatch.undo()
    monkeypatch.setattr("offload.connector.connector.parse_config", lambda extra: cfg)
    with pytest.raises(ConfigError) as ei:
        _start(vllm_setup, {**OURS, "kv_connector_extra_config": {"store": "fs", "path": path}})
    msg = str(ei.value)
    assert f"kv_connector_extra_config.path={path!r}" in msg and "is a regular file" in msg, msg
    assert "choose a directory" in msg, msg


def test_models_dtypes_tp_layouts_and_chunk_sizes_never_share_files(vllm_setup, tmp_path):
    """Row 9 of docs/reliability.md: every variant gets its own fingerprint directory, and a file of
    one variant placed where another looks is refused (identity check).
    Different models sharing a directory run on real engines in
    tests/test_e2e_fs.py; other format versions in test_reliability_e2e.py."""
    import copy
    import dataclasses

    from offload.keys import fingerprint, rank_fingerprint
    from offload.layout import fingerprint_fields
    from offload.store.base import ChunkMiss
    from offload.store.files import FileStore

    vllm_config, kvc = vllm_setup

    def variant(dtype=None, tp=1, chunk=256, model_id=None, kv=kvc):
        vc = copy.copy(vllm_config)
        vc.model_config = copy.copy(vllm_config.model_config)
        vc.parallel_config = copy.copy(vllm_config.parallel_config)
        if dtype is not None:
            vc.model_config.dtype = dtype
        vc.parallel_config.tensor_parallel_size = tp
        return fingerprint(fingerprint_fields(vc, kv, chunk, model_id))

    f32 = copy.deepcopy(kvc)
    attn = f32.kv_cache_groups[1]
    f32.kv_cache_groups[1] = dataclasses.replace(attn, kv_cache_spec=dataclasses.replace(attn.kv_cache_spec,
                                                                                         dtype=torch.float32))
    base = variant()
    fps = {"base": rank_fingerprint(base, 0, 1),
           "dtype float32": rank_fingerprint(variant(torch.float32, kv=f32), 0, 1),
           "tp 2 rank 0": rank_fingerprint(variant(tp=2), 0, 2),
           "tp 2 rank 1": rank_fingerprint(variant(tp=2), 1, 2),
           "chunk 512": rank_fingerprint(variant(chunk=512), 0, 1),
           "other model id": rank_fingerprint(variant(model_id="other"), 0, 1)}
    assert len({fp.hex() for fp in fps.values()}) == len(fps), "two variants share a directory"
    # A base file copied to where each other variant would look: refused, not misread.
    from faults.store_writer import KvCache

    kv = KvCache()
    h = dataclasses.replace(kv.header(1, 1), fingerprint=fps["base"])
    src = FileStore.open(str(tmp_path), fps["base"])
    src.write(h, kv.pages[1].gather(kv.fill(1, 1)))
    refused = 0
    for name, fp in fps.items():
        if name == "base":
            continue
        dst = FileStore.open(str(tmp_path), fp)
        assert not dst.contains(1, h.key)
        target = dst.file_path(1, h.key)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(src.file_path(1, h.key).read_bytes())
        with pytest.raises(ChunkMiss) as e:
            dst.read_into(dataclasses.replace(h, fingerprint=fp), torch.empty(h.payload_len, dtype=torch.uint8))
        assert "fingerprint" in str(e.value)
        refused += 1
    print(f"\nvariants: {len(fps)} distinct directories; foreign files refused: {refused}/{len(fps) - 1}")
    record("9 dtype, TP layout and rank, chunk size, model id: one directory", "a file of the base variant "
           "copied where each other variant looks", refused, "-", 0, "none: distinct directories, identity refused")


@pytest.mark.parametrize("step,retention,lost", [
    (128, 128, []),  # the plan's flags
    (64, None, []),  # shorter steps, every state kept: still a state at every chunk boundary
    (2048, 0, ["--max-num-batched-tokens 128 (now 2048)", "--prefix-cache-retention-interval 128 (now 0)"]),
    (2048, 128, ["--max-num-batched-tokens 128 (now 2048)"]),
    (128, 256, ["--prefix-cache-retention-interval 128 (now 256)"]),
])
def test_start_up_logs_the_plan_and_names_flags_that_lose_hits(vllm_setup, tmp_path, caplog, step, retention, lost):
    """The scheduler-side connector logs what `kvoffload plan` prints, and warns with the exact flags
    when the engine's would keep Mamba states at prompt ends only (offload/plan/policy.py::serve_flags)."""
    import copy
    import logging

    vllm_config, kvc = vllm_setup
    vc = copy.copy(vllm_config)
    vc.scheduler_config = copy.copy(vllm_config.scheduler_config)
    vc.cache_config = copy.copy(vllm_config.cache_config)
    vc.scheduler_config.max_num_batched_tokens = step
    vc.cache_config.prefix_cache_retention_interval = retention
    ours = logging.getLogger("offload")
    ours.addHandler(caplog.handler)
    caplog.set_level(logging.INFO, logger="offload")
    try:
        _start((vc, kvc), {**OURS, "kv_connector_extra_config": {"store": "fs", "path": str(tmp_path / "c")}})
    finally:
        ours.removeHandler(caplog.handler)
    msgs = [r.getMessage() for r in caplog.records]
    plan = [m for m in msgs if "plan (as `kvoffload plan` prints it)" in m]
    assert plan and "hybrid_chunk_size 128 tokens" in plan[0]
    assert "--max-num-batched-tokens 128 --prefix-cache-retention-interval 128" in plan[0]
    warned = [m for m in msgs if "prompt's last block boundary" in m]
    assert bool(warned) == bool(lost), warned
    for flag in lost:
        assert flag in warned[0]
