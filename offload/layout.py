"""vLLM's KV cache description -> planner GroupSpecs and the layout fingerprint.

The only module besides the connector that reads vLLM types; both the
scheduler and the worker derive the same values from the same KVCacheConfig,
so their fingerprints and keys agree without talking to each other.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

from offload.planner import GroupKind, GroupSpec

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec


def group_kind(spec: KVCacheSpec) -> tuple[GroupKind, int | None]:
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        CrossAttentionSpec,
        EncoderOnlyAttentionSpec,
        FullAttentionSpec,
        MambaSpec,
        SlidingWindowSpec,
    )

    if isinstance(spec, MambaSpec):
        return GroupKind.MAMBA, None
    if isinstance(spec, SlidingWindowSpec):
        return GroupKind.SLIDING_WINDOW, spec.sliding_window
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return GroupKind.CHUNKED_LOCAL, spec.attention_chunk_size
    if isinstance(spec, FullAttentionSpec) and not isinstance(spec, (CrossAttentionSpec, EncoderOnlyAttentionSpec)):
        return GroupKind.FULL_ATTENTION, None
    raise ValueError(
        f"KV cache spec {type(spec).__name__} is not supported by OffloadConnector "
        "(supported: full attention, sliding window, chunked local attention, Mamba/GDN)"
    )


def group_specs(kv_cache_config: KVCacheConfig) -> list[GroupSpec]:
    specs = []
    for g in kv_cache_config.kv_cache_groups:
        kind, window = group_kind(g.kv_cache_spec)
        specs.append(
            GroupSpec(
                kind=kind,
                block_size=g.kv_cache_spec.block_size,
                page_bytes=g.kv_cache_spec.real_page_size_bytes * len(g.layer_names),
                num_layers=len(g.layer_names),
                window=window,
            )
        )
    return specs


def _hf_config_digest(vllm_config: VllmConfig) -> str:
    d = vllm_config.model_config.hf_config.to_dict()
    for volatile in ("_name_or_path", "transformers_version"):
        d.pop(volatile, None)
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()


def fingerprint_fields(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, chunk_size: int, model_id: str | None
) -> dict[str, Any]:
    """Everything that changes the bytes or meaning of a stored page."""
    from vllm.platforms import current_platform

    mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    return {
        "model": model_id or mc.model,
        "hf_config": _hf_config_digest(vllm_config),
        "dtype": str(mc.dtype),
        "cache_dtype": str(cc.cache_dtype),
        "platform": current_platform.device_type,
        "kv_cache_layout": kv_cache_config.kv_cache_layout,
        "groups": [
            {"spec": repr(g.kv_cache_spec), "layers": list(g.layer_names)}
            for g in kv_cache_config.kv_cache_groups
        ],
        "tp_size": pc.tensor_parallel_size,
        "chunk_size": chunk_size,
    }
