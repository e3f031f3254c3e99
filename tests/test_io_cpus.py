"""Where the connector's I/O threads run in a worker that vLLM-CPU bound to the model's cores
(offload/connector/cpus.py): a process started as vLLM-CPU starts its worker (its cores as one
OpenMP place, `OMP_PROC_BIND=true`), from a process with more CPUs, runs a real worker's load
and store threads; their CPUs are read back from the kernel."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO, side_by_side

two_cpus = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs: the model's and one more")

CHILD = """
import json, os, sys
sys.path[:0] = [{repo!r}]
import torch  # OpenMP binds this thread to its place, as in vLLM-CPU's worker
from bench.fs_tier import TINY, HybridKV, load_worker, open_data, ours_load_parallel, ours_store, warm_buffers

kv = HybridKV(1 << 20, TINY)
warm_buffers(kv, 4)
data = open_data(sys.argv[1], kv)
ours_store(kv, data, 2)
worker = load_worker(kv, data, 2)  # built on this thread, as vLLM builds the connector on its own
ours_load_parallel(kv, worker)
worker.stores.pool.submit(lambda: None).result()
cpus = lambda tid: sorted(os.sched_getaffinity(tid))
print(json.dumps({{"main": cpus(0), "load": [cpus(t.native_id) for t in worker.loads.pool._threads],
                  "store": [cpus(t) for t in worker.stores.store_tids]}}))
worker.shutdown()
"""


def _threads(tmp_path, env: dict[str, str], cpus: set[int] | None = None) -> dict:
    tmp_path.mkdir()
    full = {k: v for k, v in os.environ.items() if not k.startswith("OMP_")} | env
    out = subprocess.run([sys.executable, "-c", CHILD.format(repo=str(REPO)), str(tmp_path)], env=full,
                         capture_output=True, text=True, timeout=300, check=True,
                         preexec_fn=None if cpus is None else lambda: os.sched_setaffinity(0, cpus))
    return json.loads(out.stdout.splitlines()[-1])


@two_cpus
def test_io_threads_leave_the_models_cores_where_openmp_bound_the_worker_and_only_there(tmp_path):
    """Three workers at once. Bound both ways vLLM-CPU binds a worker whose OpenMP is GNU's (the
    standard variables; GNU's own, with libgomp preloaded, its default here): the worker's own
    thread stays on the model's core, its load and store threads may run on every CPU this process
    has (vLLM's engine core, which vLLM does not bind). Given fewer CPUs by its operator (`taskset`),
    not by OpenMP: its I/O threads keep them."""
    mine = sorted(os.sched_getaffinity(0))
    first = mine[0]
    places, gomp, operator = side_by_side(
        lambda: _threads(tmp_path / "places", {"OMP_PLACES": f"{{{first}}}", "OMP_PROC_BIND": "true"}),
        lambda: _threads(tmp_path / "gomp", {"GOMP_CPU_AFFINITY": str(first), "OMP_NUM_THREADS": "1"}),
        lambda: _threads(tmp_path / "operator", {}, cpus={first}))
    for got in (places, gomp):
        assert got["main"] == [first], got  # bound as vLLM binds its worker
        assert got["load"] and got["store"], got
        assert all(c == mine for c in got["load"] + got["store"]), got
    assert operator["main"] == [first] and operator["load"] and operator["store"], operator
    assert all(c == [first] for c in operator["load"] + operator["store"]), operator


TIER_CHILD = """
import json, os, sys, time
sys.path[:0] = [{repo!r}, {tests!r}]
import torch  # OpenMP binds this thread to its place, as in vLLM-CPU's worker
from offload.store import buffers
seen = []
real_run = buffers.Prefault._run

def recorded(self):  # the CPUs host memory's prefault thread was started with, then its work
    seen.append(sorted(os.sched_getaffinity(0)))
    real_run(self)

buffers.Prefault._run = recorded
from vllm_unit_utils import WorkerStep, attention_kv_cache_config, create_scheduler, create_vllm_config, set_connector

cfg = create_vllm_config({model!r}, block_size=16, max_num_batched_tokens=256)
set_connector(cfg, {{"store": "cpu", "cpu_bytes": 4 << 20}})
kcc = attention_kv_cache_config(["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"],
                                block_size=16, num_kv_heads=2, head_size=32, num_blocks=64)
step = WorkerStep(cfg, kcc, create_scheduler(cfg, kcc))  # registers the KV cache: host memory's tier
deadline = time.monotonic() + 60
while not seen and time.monotonic() < deadline:
    time.sleep(0.01)
print(json.dumps({{"main": sorted(os.sched_getaffinity(0)), "prefault": seen}}))
step.connector.shutdown()
"""


@two_cpus
def test_threads_a_tier_starts_at_registration_leave_the_models_cores_too(tmp_path, models_dir):
    """Host memory's prefault thread, which the tier starts itself when the worker registers the KV
    cache, runs on every CPU of the process that started the worker; the worker's thread is back on
    the model's core after the registration."""
    mine = sorted(os.sched_getaffinity(0))
    first = mine[0]
    full = {k: v for k, v in os.environ.items() if not k.startswith("OMP_")}
    full |= {"OMP_PLACES": f"{{{first}}}", "OMP_PROC_BIND": "true"}
    child = TIER_CHILD.format(repo=str(REPO), tests=str(REPO / "tests"), model=str(models_dir / "llama-tiny"))
    out = subprocess.run([sys.executable, "-c", child], env=full, capture_output=True, text=True, timeout=300,
                         check=True, cwd=tmp_path)
    got = json.loads(out.stdout.splitlines()[-1])
    assert got["main"] == [first], got
    assert got["prefault"] == [mine], got


@pytest.mark.parametrize("env,cpus", [
    ({"OMP_PLACES": "{0,2,3}", "OMP_PROC_BIND": "true"}, {0, 2, 3}),
    ({"OMP_PLACES": "{0-3}", "OMP_PROC_BIND": "close"}, {0, 1, 2, 3}),
    ({"OMP_PLACES": "{0,1}", "OMP_PROC_BIND": "false"}, None),  # not bound
    ({"OMP_PLACES": "{0},{1}", "OMP_PROC_BIND": "true"}, None),  # a place per core: not vLLM's form
    ({"OMP_PLACES": "cores", "OMP_PROC_BIND": "true"}, None),
    ({"GOMP_CPU_AFFINITY": "0 1 2"}, {0, 1, 2}),
    ({"GOMP_CPU_AFFINITY": "0-6:2"}, {0, 2, 4, 6}),
    ({"KMP_AFFINITY": "granularity=fine,explicit,proclist=[4,5,6]"}, {4, 5, 6}),
    ({"KMP_AFFINITY": "compact"}, None),
    ({}, None),
])
def test_the_binding_is_read_from_the_openmp_variables_vllm_cpu_sets(monkeypatch, env, cpus):
    from offload.connector.cpus import _openmp_cpus

    for k in ("OMP_PLACES", "OMP_PROC_BIND", "GOMP_CPU_AFFINITY", "KMP_AFFINITY"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert _openmp_cpus() == (None if cpus is None else frozenset(cpus))
