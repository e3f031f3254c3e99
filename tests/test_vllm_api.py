"""vLLM 0.33's connector surface.

1. tools/check_vllm_api.py against vLLM 0.33.0's wheel (downloaded once into
   ~/.cache/kvoffload, unpacked in part, never installed) and against the
   installed 0.32, and against a deliberately incompatible base class.
2. Sleep mode (0.33 calls `unregister_kv_caches` / `restore_kv_caches` around
   releasing the KV cache): driven here directly through the real connector
   under vLLM 0.32's real Scheduler (tests/vllm_unit_utils.py), where vLLM
   itself never calls them.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from vllm_unit_utils import (
    Engine,
    WorkerStep,
    assert_scheduler_empty,
    attention_kv_cache_config,
    cpu_kv_caches,
    create_request,
    create_scheduler,
    create_vllm_config,
    run_and_snapshot,
    set_connector,
)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import check_vllm_api as api  # noqa: E402

LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]  # llama-tiny
BS = 16
PROMPT = 600  # two whole 256-token chunks and a tail of whole blocks: _hit() says how much a repeat restores
WAITING_FOR_KV = "WAITING_FOR_REMOTE_KVS"


# ---- 1. the check --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_033() -> Path:
    """vLLM 0.33.0's connector modules, unpacked from its wheel."""
    try:
        wheel = api.download_wheel(api.TARGET_VERSION, api.cache_dir())
    except api.DownloadError as e:
        pytest.skip(f"cannot download vllm=={api.TARGET_VERSION} from the package index: {e}")
    return api.unpack(wheel, api.cache_dir() / f"vllm-{api.TARGET_VERSION}")


def test_our_connectors_fit_vllm_033(vllm_033):
    report = api.check(vllm_033)
    assert not report.problems, "\n".join(report.problems)
    api.diff(api.installed_root(), vllm_033, report)
    # What the check is known to find: the three 0.33 additions, and that our
    # connectors implement each (MultiConnector's own, since vLLM's reads "connectors").
    added = {(c, m) for c, m, _ in report.added}
    assert {("KVConnectorBase_V1", "supports_sleep_mode"), ("KVConnectorBase_V1", "unregister_kv_caches"),
            ("KVConnectorBase_V1", "restore_kv_caches"), ("MultiConnector", "supports_sleep_mode")} <= added
    assert "MultiConnector.supports_sleep_mode" in report.overridden["MultiConnector"]
    assert report.abstract_checked >= 5


def test_our_connectors_fit_the_installed_vllm():
    report = api.check(api.installed_root())
    assert not report.problems, "\n".join(report.problems)
    if not hasattr(__import__("vllm.distributed.kv_transfer.kv_connector.v1.base", fromlist=["x"]).KVConnectorBase_V1,
                   "unregister_kv_caches"):  # 0.32: our sleep hooks are extras it never calls
        assert set(report.newer["OffloadConnector"]) == set(api.NEWER_HOOKS)


def test_script_prints_the_report_and_exits_0(vllm_033):
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "check_vllm_api.py"), "--source", str(vllm_033)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 problems" in r.stdout and "unregister_kv_caches" in r.stdout


def _mutated(vllm_033: Path, tmp_path: Path, old: str, new: str) -> Path:
    root = tmp_path / "vllm-fake"
    shutil.copytree(vllm_033, root)
    base = root / api.BASE_MODULE.replace(".", "/")
    src = base.with_suffix(".py").read_text()
    assert old in src, old
    base.with_suffix(".py").write_text(src.replace(old, new, 1))
    return root


def test_fails_on_a_new_abstract_method(vllm_033, tmp_path):
    root = _mutated(vllm_033, tmp_path, "    def restore_kv_caches(self) -> None:",
                    "    @abstractmethod\n    def must_implement(self, x: int) -> None:\n        ...\n\n"
                    "    def restore_kv_caches(self) -> None:")
    problems = api.check(root).problems
    assert any("must_implement" in p and "OffloadConnector" in p for p in problems), problems


def test_fails_on_an_incompatible_signature(vllm_033, tmp_path):
    # A base that now passes a second, required argument to a hook we implement.
    root = _mutated(vllm_033, tmp_path, "def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):",
                    "def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], layout: str):")
    problems = api.check(root).problems
    assert any("register_kv_caches" in p and "layout" in p for p in problems), problems
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "check_vllm_api.py"), "--source", str(root)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 1, r.stdout + r.stderr


def test_fails_on_a_removed_method_we_call(vllm_033, tmp_path):
    root = _mutated(vllm_033, tmp_path, "    def _get_connector_metadata(self)", "    def _renamed_metadata(self)")
    problems = api.check(root).problems
    assert any("_get_connector_metadata" in p for p in problems), problems


def test_imports_are_checked_with_their_version_fallbacks(vllm_033, tmp_path):
    """offload/plan/probe.py imports `get_kv_cache_configs` from 0.33's `kv_cache_planning`, falling back
    to 0.32's `kv_cache_utils`: both trees pass, and a tree where neither branch resolves warns."""
    for root in (vllm_033, api.installed_root()):
        rep = api.check(root)
        assert not [w for w in rep.warnings if "get_kv_cache_configs" in w], rep.warnings
    root = tmp_path / "vllm-fake"
    shutil.copytree(vllm_033, root)
    planning = root / "vllm" / "v1" / "core" / "kv_cache_planning.py"
    planning.write_text(planning.read_text().replace("def get_kv_cache_configs(", "def renamed_kv_cache_configs("))
    warnings = api.check(root).warnings
    assert any("get_kv_cache_configs" in w and "offload/plan/probe.py" in w for w in warnings), warnings


# ---- 2. sleep mode through the real connector ------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_config(models_dir):
    return create_vllm_config(str(models_dir / "llama-tiny"), block_size=BS, max_num_batched_tokens=256)


@pytest.fixture
def eng(vllm_config):
    # A load thread per file of a repeat's load (two chunks and a one-block entry per tail block), so
    # that every file's copy can be in progress at once.
    set_connector(vllm_config, {"store": "cpu", "cpu_bytes": 4 << 20, "io_threads": 16})
    kcc = attention_kv_cache_config(LAYERS, block_size=BS, num_kv_heads=2, head_size=32, num_blocks=128)
    scheduler = create_scheduler(vllm_config, kcc)
    e = Engine(scheduler, WorkerStep(vllm_config, kcc, scheduler))
    yield e
    e.worker.connector.shutdown()


def _prompt(seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 1000, (PROMPT,), generator=g).tolist()


def _hit(eng: Engine) -> int:
    """Tokens a repeat of a stored prompt restores, as the connector's planner states it."""
    return eng.scheduler.connector.planner.repeat_hit(PROMPT)


def _store(eng: Engine, req_id: str, tokens: list[int]) -> list[bytes]:
    """Run a request to completion; the bytes of the blocks a repeat restores, once its stores landed."""
    snapshot = run_and_snapshot(eng, req_id, tokens, block_size=BS)
    assert eng.worker.connector.wait_for_stores(30) == 0
    return snapshot


def _load(eng: Engine, req_id: str, tokens: list[int]) -> tuple[list[int], dict]:
    r = create_request(req_id, tokens, max_tokens=2, block_size=BS)
    eng.scheduler.add_request(r)
    eng.step()
    dest = eng.scheduler.kv_cache_manager.get_block_ids(req_id)[0][:_hit(eng) // BS]
    eng.run_until(lambda: eng.status(req_id) is None or eng.status(req_id).name != WAITING_FOR_KV)
    restored = eng.worker.blocks_bytes(dest)
    eng.run_to_completion()
    [(_, params)] = eng.finished[req_id].items()
    return restored, params


def _sleep(eng: Engine) -> None:
    """What vLLM 0.33's worker does around `sleep()`: unregister, then the KV
    cache's memory is released (its contents are gone: scrambled here), and
    vLLM's own prefix cache is reset."""
    eng.worker.connector.unregister_kv_caches()
    eng.worker.scramble()
    assert eng.scheduler.reset_prefix_cache()


def test_sleep_and_wake_keep_the_tiers_and_restore_after_wake(eng):
    tokens = _prompt(1)
    stored = _store(eng, "a", tokens)
    conn = eng.worker.connector
    assert type(conn).supports_sleep_mode(conn._kv_transfer_config)

    _sleep(eng)
    conn.unregister_kv_caches()  # idempotent
    # Nothing touches the released KV cache: every copy is refused.
    from offload.connector.kv_gate import KVCacheReleased

    pages = conn._worker.pages[0]
    with pytest.raises(KVCacheReleased):
        pages.gather([0])
    with pytest.raises(KVCacheReleased):
        pages.gather_crc([0], torch.empty(pages.page_bytes, dtype=torch.uint8))
    with pytest.raises(KVCacheReleased):
        pages.scatter(torch.zeros(pages.page_bytes, dtype=torch.uint8), 1, [(0, 0)])

    conn.restore_kv_caches()
    conn.restore_kv_caches()  # idempotent
    restored, params = _load(eng, "b", tokens)
    # The host-memory tier kept its pool: a hit, restored byte for byte after wake-up.
    assert params == {"restored_tokens": _hit(eng), "load_failed": False}
    assert restored == stored
    assert_scheduler_empty(eng.scheduler)


def test_a_load_while_asleep_is_a_miss_and_never_copies(eng):
    tokens = _prompt(2)
    _store(eng, "a", tokens)
    _sleep(eng)
    from offload.copier import GroupPages

    calls = []
    real = GroupPages.scatter
    GroupPages.scatter = lambda self, *a, **k: (calls.append(1), real(self, *a, **k))[1]
    try:
        # Only a test drives steps while asleep (vLLM does not): the load is refused.
        r = create_request("b", tokens, max_tokens=1, block_size=BS)
        eng.scheduler.add_request(r)
        eng.step()
        eng.run_until(lambda: eng.status("b") is None or eng.status("b").name != WAITING_FOR_KV)
    finally:
        GroupPages.scatter = real
    assert calls == []  # the load's scatter never reached the page table
    eng.run_to_completion()
    [(_, params)] = eng.finished["b"].items()
    assert params["load_failed"] is True and params["restored_tokens"] == 0
    assert eng.totals().get("failed_loads", 0) >= 1

    # The entry survives the refused load: after wake-up it restores.
    eng.worker.connector.restore_kv_caches()
    assert eng.scheduler.reset_prefix_cache()
    eng.worker.scramble()
    _, params = _load(eng, "c", tokens)
    assert params == {"restored_tokens": _hit(eng), "load_failed": False}


def test_unregister_waits_for_the_copy_in_progress(eng, monkeypatch):
    from offload.copier import GroupPages

    tokens = _prompt(3)
    stored = _store(eng, "a", tokens)
    assert eng.scheduler.reset_prefix_cache()
    eng.worker.scramble()
    release, entered = threading.Event(), threading.Semaphore(0)
    real = GroupPages.scatter

    def held(self, *args, **kwargs):
        entered.release()
        assert release.wait(30)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(GroupPages, "scatter", held)
    b = create_request("b", tokens, max_tokens=2, block_size=BS)
    eng.scheduler.add_request(b)
    eng.step()
    p = eng.scheduler.connector.planner
    chunks = _hit(eng) // p.chunk_size
    files = len(p.needed(0, chunks, 0, _hit(eng) - chunks * p.chunk_size))  # the load's files
    for _ in range(files):  # every file's copy has started
        assert entered.acquire(timeout=10)
    sleeper = threading.Thread(target=eng.worker.connector.unregister_kv_caches)
    sleeper.start()
    sleeper.join(0.5)
    assert sleeper.is_alive(), "unregister_kv_caches returned while a load was copying into the KV cache"
    release.set()
    sleeper.join(10)
    assert not sleeper.is_alive()
    # That copy had started, so it completed, whole, before the KV cache was released.
    dest = eng.scheduler.kv_cache_manager.get_block_ids("b")[0][:_hit(eng) // BS]
    assert eng.worker.blocks_bytes(dest) == stored
    eng.worker.connector.restore_kv_caches()
    eng.run_to_completion()
    [(_, params)] = eng.finished["b"].items()
    assert params == {"restored_tokens": _hit(eng), "load_failed": False}


def test_multi_connector_sleep(vllm_config, tmp_path):
    from offload.connector.kv_gate import KVCacheReleased
    from offload.multi_connector import MultiConnector

    children = [{"kv_connector": "OffloadConnector", "kv_connector_module_path": "offload.connector",
                 "kv_role": "kv_both", "kv_connector_extra_config": {"store": "cpu", "cpu_bytes": 4 << 20}},
                {"kv_connector": "OffloadConnector", "kv_connector_module_path": "offload.connector",
                 "kv_role": "kv_both", "kv_connector_extra_config": {"store": "fs", "path": str(tmp_path / "fs")}}]
    ktc = KVTransferConfig(kv_connector="OffloadMultiConnector", kv_connector_module_path="offload.multi_connector",
                           kv_role="kv_both", kv_connector_extra_config={"children": children})
    assert MultiConnector.supports_sleep_mode(ktc)
    # A child whose class does not follow sleep mode (any of vLLM 0.32's own) makes the whole refuse it.
    other = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
             "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}}
    mixed = KVTransferConfig(kv_connector="OffloadMultiConnector", kv_connector_module_path="offload.multi_connector",
                             kv_role="kv_both", kv_connector_extra_config={"children": [children[0], other]})
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    expected = hasattr(KVConnectorFactory.get_connector_class(KVTransferConfig(**other)), "supports_sleep_mode")
    assert MultiConnector.supports_sleep_mode(mixed) is expected

    vllm_config.kv_transfer_config = ktc
    kcc = attention_kv_cache_config(LAYERS, block_size=BS, num_kv_heads=2, head_size=32, num_blocks=64)
    mc = MultiConnector(vllm_config, KVConnectorRole.WORKER, kcc)
    try:
        caches, raw = cpu_kv_caches(kcc)
        for t in raw.values():
            t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8))
        mc.register_kv_caches(caches)
        pages = [c._worker.pages[0] for c in mc._connectors]
        want = [p.gather([3, 7]).clone() for p in pages]
        mc.unregister_kv_caches()
        for p in pages:
            with pytest.raises(KVCacheReleased):
                p.gather([3, 7])
        mc.restore_kv_caches()
        assert all(torch.equal(p.gather([3, 7]), w) for p, w in zip(pages, want))
    finally:
        mc.shutdown()


def test_fails_on_a_call_of_ours_that_no_longer_fits(vllm_033, tmp_path):
    root = _mutated(vllm_033, tmp_path, "def _get_connector_metadata(self)", "def _get_connector_metadata(self, step)")
    problems = api.check(root).problems
    assert any("self._get_connector_metadata(...)" in p and "step" in p for p in problems), problems
