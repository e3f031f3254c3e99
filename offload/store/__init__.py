"""Where chunk bytes live: one module per tier plus the seam (base.py).

A tier is a `TierSpec` subclass registered here under its `store` name, built
from its own options dataclass; it makes the scheduler's `TierIndex` and the
worker's `TierData`. Adding a tier is a module and a line in `TIERS`; no
connector code changes. Stores never import vLLM or the connector's config.
Registered by module path and imported on first use (like vLLM's connector
factory), so that importing `offload.store.format` costs no torch import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from offload.store.base import TierContext, TierSpec

TIERS: dict[str, str] = {
    "cpu": "offload.store.cpu:CpuTier",
    "fs": "offload.store.fs:FsTier",
    "lmcache": "offload.store.lmcache:LMCacheTier",
}


def tier_class(store: str) -> type[TierSpec]:
    """The spec class of tier `store` (a key of TIERS)."""
    module, name = TIERS[store].split(":")
    return getattr(importlib.import_module(module), name)


def tier_spec(store: str, options: object, ctx: TierContext) -> TierSpec:
    """The spec of tier `store` with its options."""
    return tier_class(store)(options, ctx)


__all__ = ["TIERS", "tier_class", "tier_spec"]
