"""vLLM 0.32's own `OffloadingConnector` on the CPU platform: a benchmark harness, not product code.

Why this file exists
--------------------
vLLM's `OffloadingConnector` (vllm/distributed/kv_transfer/kv_connector/v1/offloading_connector.py)
delegates to an `OffloadingSpec` chosen by `kv_connector_extra_config["spec_name"]` (+
`"spec_module_path"` for out-of-tree specs, vllm/v1/kv_offload/factory.py). Its two in-tree specs
cannot run on the CPU platform:

* `CPUOffloadingSpec.get_worker` raises "CPU Offloading is currently only supported on CUDA-alike
  and XPU GPUs" on any other platform;
* its worker, `CPUOffloadingWorker` / `SingleDirectionOffloadingHandler`
  (vllm/v1/kv_offload/cpu/gpu_worker.py), is CUDA-only: it asserts `gpu_tensor.is_cuda or
  gpu_tensor.is_xpu`, copies with `ops.swap_blocks_batch` (a CUDA kernel) or a Triton kernel, and
  orders/finishes transfers with CUDA streams and `torch.Event`s.
* `TieringOffloadingSpec` (host memory + secondary tiers such as `fs`) inherits both.

What is replaced (only the part that assumes CUDA)
--------------------------------------------------
`TorchCopyOffloadingWorker` (an `OffloadingWorker`) replaces `CPUOffloadingWorker`: the same host
buffers (a private `(num_chunks, page * blocks_per_chunk)` int8 tensor per KV tensor, or the
tiering spec's `/dev/shm` `SharedOffloadRegion` views, exactly as vLLM lays them out) and the same
block/chunk arithmetic (`group_sizes`, `block_indices`, sub-block skip of a partial first chunk,
un-padded page size per layer ref: a transcription of `transfer_async` + `_fill_direct_ops`), but
each copy is a plain indexed torch copy between the CPU platform's KV cache and the host buffer,
done synchronously in `submit_store` / `submit_load`. Synchronous is correct here: vLLM's
connector worker submits deferred stores at the start of the next step (after the forward that
wrote the KV) and loads before the forward that reads them; on the CPU platform nothing runs
asynchronously with those calls. `get_finished` then reports the jobs done with their byte counts
and copy time (vLLM's own transfer stats record them). Canonical layout (`canonical_layout`) is
not supported (refused at construction).

The two specs subclass vLLM's and override only `get_worker` (drop the CUDA/XPU check) and
`create_worker` (build the torch-copy worker on the same buffers):

* `CPUHostOffloadingSpec(CPUOffloadingSpec)`: vLLM's scheduler side unmodified:
  `CPUOffloadingManager` with its LRU/ARC policies, store thresholds, events, metrics.
* `CPUHostTieringOffloadingSpec(TieringOffloadingSpec)`: vLLM's `TieringOffloadingManager`, its
  `CPUPrimaryTierOffloadingManager` over the shared `/dev/shm` region, and its secondary tiers
  (e.g. `{"type": "fs", "root_dir": ...}`) unmodified; only the device<->host copy is ours.

kv-transfer-config (see `vllm_cpu_kv_config` / `vllm_tiered_kv_config` below)::

    {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
     "kv_connector_extra_config": {"spec_name": "CPUHostOffloadingSpec",
                                   "spec_module_path": "bench.vllm_offloading_cpu",
                                   "cpu_bytes_to_use": 268435456}}

The harness: `run_connector(...)` / `python -m bench.vllm_offloading_cpu` serve a prompt
set through `vllm.LLM` in a fresh process with a given kv-transfer-config, one prompt at a time,
in `passes` passes with `LLM.reset_prefix_cache()` between them (host memory survives that, not a
restart), or `--restart` (a second process on the same config: only file tiers survive). Per
prompt it reports vLLM's `num_cached_tokens`, the external (connector) hit tokens and the local
prefix-cache hit tokens, taken as deltas of vLLM's own Prometheus counters
`vllm:external_prefix_cache_hits` / `vllm:prefix_cache_hits` around each generate call (prompts
are served one at a time, so deltas are per prompt), and the greedy tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from vllm.logger import init_logger
from vllm.utils.math_utils import cdiv
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

logger = init_logger(__name__)

MODULE = "bench.vllm_offloading_cpu"


# --------------------------------------------------------------------------- worker (the CUDA part)


class TorchCopyOffloadingWorker(OffloadingWorker):
    """Device(KV cache on the CPU platform) <-> host-buffer copies with plain torch indexing."""

    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, num_cpu_chunks: int,
                 mmap_region: SharedOffloadRegion | None = None):
        self.bpc = blocks_per_chunk
        self.refs = kv_caches.group_data_refs
        self._mmap_region = mmap_region
        self.dev: list[torch.Tensor] = []  # (num_blocks, page) int8
        self.host: list[torch.Tensor] = []  # (num_chunks, blocks_per_chunk, page) int8 (strided view)
        for t in kv_caches.tensors:
            page = t.page_size_bytes
            dev = t.tensor.view(torch.int8).view((-1, page))
            if mmap_region is not None:
                host2 = mmap_region.create_next_worker_view(page * blocks_per_chunk)
            else:
                host2 = torch.zeros((num_cpu_chunks, page * blocks_per_chunk), dtype=torch.int8)
            host = host2.as_strided((num_cpu_chunks, blocks_per_chunk, page),
                                    (host2.stride(0), page, 1), host2.storage_offset())
            self.dev.append(dev)
            self.host.append(host)
        self._done: list[TransferResult] = []

    def _transfer(self, job_id: int, src: LoadStoreSpec, dst: LoadStoreSpec, store: bool) -> bool:
        assert isinstance(src, BlockIDsLoadStoreSpec) and isinstance(dst, BlockIDsLoadStoreSpec)
        dev_spec = src if store else dst
        host_ids = (dst if store else src).block_ids
        assert isinstance(dev_spec, GPULoadStoreSpec)
        dev_ids = dev_spec.block_ids
        assert len(dev_spec.group_sizes) == len(self.refs) == len(dev_spec.block_indices)
        t0 = time.perf_counter()
        nbytes = 0
        dev_off = host_off = 0
        for g, (n, block_idx) in enumerate(zip(dev_spec.group_sizes, dev_spec.block_indices)):
            if n == 0:
                continue
            skip = block_idx % self.bpc  # device blocks are never split; host chunks may be
            n_chunks = cdiv(n + skip, self.bpc)
            g_dev = torch.from_numpy(dev_ids[dev_off:dev_off + n].astype(np.int64))
            chunks = host_ids[host_off:host_off + n_chunks].astype(np.int64)
            flat = (chunks[:, None] * self.bpc + np.arange(self.bpc)).ravel()[skip:skip + n]
            c_idx, j_idx = torch.from_numpy(flat // self.bpc), torch.from_numpy(flat % self.bpc)
            for ref in self.refs[g]:
                p = ref.page_size_bytes  # un-padded bytes of this layer's page
                dev, host = self.dev[ref.tensor_idx], self.host[ref.tensor_idx]
                if store:
                    host[c_idx, j_idx, :p] = dev[g_dev, :p]
                else:
                    dev[g_dev, :p] = host[c_idx, j_idx, :p]
                nbytes += n * p
            dev_off += n
            host_off += n_chunks
        assert dev_off == len(dev_ids) and host_off == len(host_ids)
        self._done.append(TransferResult(job_id=job_id, success=True, transfer_size=nbytes,
                                         transfer_time=time.perf_counter() - t0))
        return True

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        return self._transfer(job_id, src_spec, dst_spec, store=True)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        return self._transfer(job_id, src_spec, dst_spec, store=False)

    def get_finished(self) -> list[TransferResult]:
        done, self._done = self._done, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        return  # every transfer completed inside submit_*

    def shutdown(self) -> None:
        self.dev.clear()
        self.host.clear()
        if self._mmap_region is not None:
            self._mmap_region.cleanup()
            self._mmap_region = None


# --------------------------------------------------------------------------- specs


class CPUHostOffloadingSpec(CPUOffloadingSpec):
    """vLLM's CPUOffloadingSpec (its CPUOffloadingManager, policies) with a torch-copy worker."""

    def create_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self.config.canonical_layout:
            raise ValueError("canonical_layout is not supported by the torch-copy worker")
        return TorchCopyOffloadingWorker(kv_caches, self.blocks_per_chunk, self.num_chunks)

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if not self._worker:
            self._worker = self.create_worker(kv_caches)
        return self._worker


class CPUHostTieringOffloadingSpec(TieringOffloadingSpec):
    """vLLM's TieringOffloadingSpec (tiering manager, CPU primary tier on /dev/shm, secondary
    tiers such as `fs`) with a torch-copy worker on the same shared region."""

    def create_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self.config.canonical_layout:
            raise ValueError("canonical_layout is not supported by the torch-copy worker")
        rank = 0 if self.replicated_layout else self.config.parallel.rank
        region = SharedOffloadRegion(engine_id=self._engine_id, num_chunks=self.num_chunks, rank=rank,
                                     kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                                     cpu_page_size=self.cpu_page_size_per_worker)
        try:
            return TorchCopyOffloadingWorker(kv_caches, self.blocks_per_chunk, self.num_chunks, region)
        except Exception:
            region.cleanup()
            raise

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if not self._worker:
            self._worker = self.create_worker(kv_caches)
        return self._worker


# --------------------------------------------------------------------------- configs

DEFAULT_CPU_BYTES = 256 << 20


def vllm_cpu_kv_config(cpu_bytes: int = DEFAULT_CPU_BYTES, **extra: Any) -> dict:
    """vLLM's OffloadingConnector, host memory only."""
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"spec_name": "CPUHostOffloadingSpec", "spec_module_path": MODULE,
                                          "cpu_bytes_to_use": cpu_bytes, **extra}}


def vllm_tiered_kv_config(root_dir: str | os.PathLike, cpu_bytes: int = DEFAULT_CPU_BYTES, **extra: Any) -> dict:
    """vLLM's OffloadingConnector with its tiering: host memory + vLLM's `fs` tier."""
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"spec_name": "CPUHostTieringOffloadingSpec", "spec_module_path": MODULE,
                                          "cpu_bytes_to_use": cpu_bytes,
                                          "secondary_tiers": [{"type": "fs", "root_dir": str(root_dir),
                                                               "n_read_threads": 2, "n_write_threads": 2}],
                                          **extra}}


# The what-if of bench/vllm_wait_tail.py, named here by module path as vLLM loads it: that module
# imports this one for the spec it subclasses, so this one never imports it back.
WAIT_TAIL_MODULE = "bench.vllm_wait_tail"
WAIT_TAIL_SPEC = "CPUHostTieringWaitTailSpec"


def wait_tail_kv_config(vllm_config: dict) -> dict:
    """A vLLM-tiering kv-transfer-config (`CPUHostTieringOffloadingSpec`'s) turned into the what-if's."""
    extra = dict(vllm_config["kv_connector_extra_config"])
    if extra.get("spec_name") != "CPUHostTieringOffloadingSpec":
        raise ValueError(f"not a CPUHostTieringOffloadingSpec config: {extra.get('spec_name')!r}")
    extra.update(spec_name=WAIT_TAIL_SPEC, spec_module_path=WAIT_TAIL_MODULE)
    return {**vllm_config, "kv_connector_extra_config": extra}


def ours_fs_kv_config(path: str | os.PathLike, repo: Path | None = None) -> dict:
    """configs/fs.json with its path replaced."""
    repo = repo or Path(__file__).resolve().parents[1]
    cfg = json.loads((repo / "configs" / "fs.json").read_text())
    cfg["kv_connector_extra_config"]["path"] = str(path)
    return cfg


# --------------------------------------------------------------------------- harness


def _counter(name: str) -> float:
    from prometheus_client import REGISTRY

    return sum(s.value for m in REGISTRY.collect() if m.name == name for s in m.samples
               if s.name == name + "_total")


def child(spec: dict) -> dict:
    """Runs in its own process: one engine, `passes` passes with prefix-cache resets between."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from offload.engine_run import land_stores

    kw = dict(spec.get("engine_args") or {})
    if spec.get("kv_transfer_config"):
        kw["kv_transfer_config"] = KVTransferConfig(**spec["kv_transfer_config"])
    t0 = time.monotonic()
    llm = LLM(model=spec["model"], disable_log_stats=False, **kw)
    start_s = time.monotonic() - t0
    params = SamplingParams(temperature=0.0, max_tokens=spec.get("max_tokens", 12), ignore_eos=True)
    passes = []
    for p in range(spec.get("passes", 1)):
        if p:
            land_stores()  # ours: the last pass's queued stores (vLLM's own store within the step)
            assert llm.reset_prefix_cache(), "vLLM refused to reset its prefix cache"
        rows = []
        for ids in (spec.get("later_prompts") or spec["prompts"]) if p else spec["prompts"]:
            ext0, loc0 = _counter("vllm:external_prefix_cache_hits"), _counter("vllm:prefix_cache_hits")
            t = time.monotonic()
            o = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
            rows.append({"prompt_tokens": len(ids), "cached_tokens": o.num_cached_tokens or 0,
                         "external_tokens": int(_counter("vllm:external_prefix_cache_hits") - ext0),
                         "local_tokens": int(_counter("vllm:prefix_cache_hits") - loc0),
                         "kv_transfer_params": {k: v for k, v in (o.kv_transfer_params or {}).items()
                                                if k.startswith("kvoffload:")},
                         "wall_s": round(time.monotonic() - t, 3),
                         "output_ids": list(o.outputs[0].token_ids)})
        passes.append(rows)
    del llm
    return {"start_s": round(start_s, 2), "passes": passes}


def run_connector(model: str, prompts: Sequence[Sequence[int]], kv_transfer_config: dict | None,
                  passes: int = 1, engine_args: dict | None = None, max_tokens: int = 12,
                  env: dict[str, str] | None = None, timeout_s: float = 1800,
                  later_prompts: Sequence[Sequence[int]] | None = None) -> dict:
    """`child` in a fresh `python -m bench.vllm_offloading_cpu --child` process; raises with the log.
    `later_prompts`: what passes after the first serve (default: `prompts` again)."""
    spec = {"model": model, "prompts": [list(p) for p in prompts], "kv_transfer_config": kv_transfer_config,
            "passes": passes, "engine_args": engine_args or {}, "max_tokens": max_tokens,
            "later_prompts": [list(p) for p in later_prompts] if later_prompts else None}
    repo = str(Path(__file__).resolve().parents[1])
    with tempfile.TemporaryDirectory(prefix="vllm-offloading-cpu-") as tmp:
        sp, op = Path(tmp, "spec.json"), Path(tmp, "out.json")
        sp.write_text(json.dumps(spec))
        full_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
                    "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")])),
                    **(env or {})}
        proc = subprocess.run([sys.executable, "-m", MODULE, "--child", str(sp), str(op)], env=full_env,
                              capture_output=True, text=True, timeout=timeout_s, cwd=repo)
        log = proc.stdout + proc.stderr
        if proc.returncode != 0 or not op.exists():
            raise RuntimeError(f"engine run failed (exit {proc.returncode}):\n{log[-8000:]}")
        out = json.loads(op.read_text())
        out["log"] = log
        return out


def default_prompts(seed: int = 2026) -> list[list[int]]:
    """~300, ~745, ~1300 tokens and one sharing the 745-token prompt's first 640 tokens."""
    rng = random.Random(seed)
    r = lambda n: [rng.randrange(2, 1000) for _ in range(n)]
    a, b, c = r(300), r(745), r(1300)
    return [a, b, c, b[:640] + r(260)]


def _table(title: str, rows: list[dict]) -> str:
    lines = [title, f"{'#':>2} {'prompt':>6} {'cached':>6} {'external':>8} {'local':>5}  first tokens"]
    for i, r in enumerate(rows):
        lines.append(f"{i:>2} {r['prompt_tokens']:>6} {r['cached_tokens']:>6} {r['external_tokens']:>8} "
                     f"{r['local_tokens']:>5}  {r['output_ids'][:6]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    ap.add_argument("--model", default=".models/qwen3-next-tiny")
    ap.add_argument("--connector", choices=["none", "vllm-cpu", "vllm-tiered", "vllm-tiered-wait-tail", "ours-fs"],
                    default="vllm-cpu", help="vllm-tiered-wait-tail: vLLM's tiering with its tail search waiting for "
                    "its pending lookup, a what-if (bench/vllm_wait_tail.py)")
    ap.add_argument("--kv-config", help="a kv-transfer-config JSON file (overrides --connector)")
    ap.add_argument("--dir", help="directory for file tiers (default: a temp dir)")
    ap.add_argument("--restart", action="store_true",
                    help="second pass in a new process instead of a prefix-cache reset in the same engine")
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--engine-args", default='{"enable_prefix_caching": true, "max_model_len": 4096, '
                                             '"enforce_eager": true}',
                    help="JSON of vllm.LLM keyword arguments (default: vLLM's defaults + prefix caching)")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args(argv)
    if a.child:
        Path(a.child[1]).write_text(json.dumps(child(json.loads(Path(a.child[0]).read_text()))))
        return 0
    d = a.dir or tempfile.mkdtemp(prefix="vllm-offloading-cpu-dir-")
    if a.kv_config:
        kv = json.loads(Path(a.kv_config).read_text())
    else:
        kv = {"none": None, "vllm-cpu": vllm_cpu_kv_config(), "vllm-tiered": vllm_tiered_kv_config(d),
              "vllm-tiered-wait-tail": wait_tail_kv_config(vllm_tiered_kv_config(d)),
              "ours-fs": ours_fs_kv_config(d)}[a.connector]
    ea, prompts = json.loads(a.engine_args), default_prompts()
    if a.restart:
        runs = [run_connector(a.model, prompts, kv, 1, ea, a.max_tokens) for _ in range(2)]
        passes = [r["passes"][0] for r in runs]
    else:
        passes = run_connector(a.model, prompts, kv, 2, ea, a.max_tokens)["passes"]
    print(_table("first pass (cold)", passes[0]))
    print(_table("second pass (" + ("after restart" if a.restart else "after reset_prefix_cache") + ")", passes[1]))
    if a.json:
        Path(a.json).write_text(json.dumps({"kv_transfer_config": kv, "passes": passes}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
