"""Where chunk bytes live: one module per tier plus the seam (base.py).

A tier is registered once, by a line in `TIERS`: its `store` name and its
options class (`offload.store.options.StoreOptions`), which declares the
tier's keys and, as class attributes, the `TierSpec` that builds it and what
the config, `check-config`, `stats`, `fsck` and the demo need to know of it.
The spec makes the scheduler's `TierIndex` and the worker's `TierData`; no
connector or CLI code changes for a new tier (docs/tiers.md, adding a tier).
Stores never import vLLM or the connector's config. Registered by module path
and imported on first use (like vLLM's connector factory), so that importing
`offload.store.format` costs no pydantic or torch import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from offload.store.base import TierContext, TierSpec
    from offload.store.options import StoreOptions

# `store` name -> "module:Class" of its options; the order is the order errors and help list them in.
TIERS: dict[str, str] = {
    "fs": "offload.store.options:FsOptions",
    "cpu": "offload.store.options:CpuOptions",
    "lmcache": "offload.store.options:LMCacheOptions",
}


def _load(path: str) -> type:
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def tier_options() -> dict[str, type[StoreOptions]]:
    """Every registered store's options class, by `store` name, in `TIERS` order."""
    return {store: _load(path) for store, path in TIERS.items()}


def tier_class(store: str) -> type[TierSpec]:
    """The spec class of tier `store` (a key of TIERS)."""
    options: type[StoreOptions] = _load(TIERS[store])
    return _load(options.tier)


def tier_spec(store: str, options: object, ctx: TierContext) -> TierSpec:
    """The spec of tier `store` with its options."""
    return tier_class(store)(options, ctx)


__all__ = ["TIERS", "tier_class", "tier_options", "tier_spec"]
