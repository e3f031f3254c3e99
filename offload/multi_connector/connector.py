"""MultiConnector: one kv-transfer-config for several tiers.

Builds on vLLM's own MultiConnector (which forwards every call to every child
and merges their outputs) and changes what ours must do differently:

- configured by `children: [...]`, each a kv-transfer-config of its own plus
  `load_weight` (default 1.0) and `store` (default true);
- the child with the largest matched tokens x load_weight loads a request
  (ties go to the earlier child); the others are told 0 external tokens;
- every storing child stores. An OffloadConnector child also stores a prefix
  that a slower child loaded (promotion), and never stores an entry its tier
  already holds;
- an LMCache child is refused on hybrid models: LMCache restores attention KV
  without the Mamba state (LMCache issue 2845), which corrupts output.

Select it as `"kv_connector": "OffloadMultiConnector"`: vLLM special-cases the
name `MultiConnector` and would look for its own `connectors` key to decide
hybrid (HMA) support.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector as VllmMultiConnector
from vllm.logger import init_logger

from offload.config import EXTRA_CONFIG, ConfigError
from offload.connector import OffloadConnector, OffloadMetadata
from offload.multi_connector.config import CHILDREN, Child, parse_children
from offload.store.cachedir.owners import CacheDirs

if TYPE_CHECKING:
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

    from offload.multi_connector.share import GatherShare

logger = init_logger(__name__)

def _is_ours(ktc: dict[str, Any]) -> bool:
    return ktc.get("kv_connector") == "OffloadConnector"


def check_children(children: list[Child], kv_cache_config: KVCacheConfig) -> None:
    """Refuse combinations that cannot be correct, at start-up."""
    from vllm.v1.kv_cache_interface import MambaSpec

    hybrid = any(isinstance(g.kv_cache_spec, MambaSpec) for g in kv_cache_config.kv_cache_groups)
    for i, c in enumerate(children):
        where = f"{EXTRA_CONFIG}.{CHILDREN}[{i}]"
        if hybrid and "lmcache" in c.ktc["kv_connector"].lower():
            raise ConfigError(
                f"{where}.kv_connector={c.ktc['kv_connector']!r}: LMCache's classic connector restores "
                "attention KV without the Mamba/GDN state of a hybrid model (LMCache issue 2845), which "
                "corrupts outputs, and its MP mode, which does handle hybrids, is not bit-exact by LMCache's own "
                "documentation; so neither is accepted here. To keep KV in LMCache's storage engine on a hybrid, "
                'use an OffloadConnector child with "store": "lmcache" (our planner and format decide what a '
                'hit is, bit-exact), or "store": "cpu" for host memory')
        if not c.store and not _is_ours(c.ktc):
            raise ConfigError(f"{where}.store=false: only OffloadConnector children can be read-only; "
                              "remove 'store' or use an OffloadConnector child")


class MultiConnector(VllmMultiConnector):
    """Weighted load selection across tiers; every storing tier stores."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        ktc: KVTransferConfig = vllm_config.kv_transfer_config
        children = parse_children(ktc.kv_connector_extra_config)
        check_children(children, kv_cache_config)
        hma = not vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
        for i, c in enumerate(children):
            child_ktc = type(ktc)(**{"engine_id": ktc.engine_id, **c.ktc})
            if hma and not KVConnectorFactory.supports_hma_config(child_ktc):
                raise ConfigError(f"{EXTRA_CONFIG}.{CHILDREN}[{i}].kv_connector={c.ktc['kv_connector']!r}: "
                                  "does not support vLLM's hybrid KV cache manager, which this model uses")
        if role == KVConnectorRole.SCHEDULER and ktc.kv_load_failure_policy != "recompute":
            ktc.kv_load_failure_policy = "recompute"  # a failed load of any tier is a miss, not an error
        # vLLM's MultiConnector reads its children from "connectors".
        # Made before the copy, which keeps it: every child shares the directory owners.
        CacheDirs.attached(vllm_config)
        inner = copy.copy(vllm_config)
        inner.kv_transfer_config = copy.copy(ktc)
        inner.kv_transfer_config.kv_connector_extra_config = self._as_vllm_extra(ktc.kv_connector_extra_config)
        super().__init__(inner, role, kv_cache_config)
        self._children = children
        # Our children share one gather per entry and step (GatherShare).
        self._share: GatherShare | None = None
        ours = [c for c in self._connectors if isinstance(c, OffloadConnector)]
        if role != KVConnectorRole.SCHEDULER and len(ours) > 1:
            from offload.multi_connector.share import GatherShare

            self._share = GatherShare()
            for c in ours:
                c.share_gathers(self._share)
        if role == KVConnectorRole.SCHEDULER:
            logger.info("OffloadMultiConnector: %s", ", ".join(
                f"[{i}] {c.ktc['kv_connector']}"
                f"{'/' + c.ktc.get('kv_connector_extra_config', {}).get('store', '') if _is_ours(c.ktc) else ''}"
                f" load_weight={c.load_weight}{'' if c.store else ' read-only'}" for i, c in enumerate(children)))

    @staticmethod
    def _as_vllm_extra(extra: dict[str, Any]) -> dict[str, Any]:
        return {"connectors": [c.ktc for c in parse_children(extra)]}

    @classmethod
    def _get_connector_classes_and_configs(cls, vllm_config: VllmConfig):
        # vLLM calls this on the class too (e.g. for the KV cache layout), with our config.
        ktc = vllm_config.kv_transfer_config
        if "connectors" not in ktc.kv_connector_extra_config:
            vllm_config = copy.copy(vllm_config)
            vllm_config.kv_transfer_config = copy.copy(ktc)
            vllm_config.kv_transfer_config.kv_connector_extra_config = cls._as_vllm_extra(ktc.kv_connector_extra_config)
        return super()._get_connector_classes_and_configs(vllm_config)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        if "connectors" not in extra_config:
            extra_config = cls._as_vllm_extra(extra_config)
        return super().requires_piecewise_for_cudagraph(extra_config)

    # ---- sleep mode (vLLM >= 0.33; 0.32 never calls these) -------------------------

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: KVTransferConfig) -> bool:
        """Whether every child follows sleep mode. vLLM 0.33's MultiConnector
        reads its children from "connectors" and so would find none of ours
        (and refuse sleep mode); a child class without the method (vLLM 0.32's)
        does not."""
        ktc = kv_transfer_config
        for c in parse_children(ktc.kv_connector_extra_config):
            child = type(ktc)(**{"engine_id": ktc.engine_id, "kv_role": ktc.kv_role, **c.ktc})
            supports = getattr(KVConnectorFactory.get_connector_class(child), "supports_sleep_mode", None)
            if supports is None or not supports(child):
                return False
        return True

    def unregister_kv_caches(self) -> None:
        """Every child, in order (see `OffloadConnector.unregister_kv_caches`)."""
        for c in self._connectors:
            if hasattr(c, "unregister_kv_caches"):
                c.unregister_kv_caches()

    def restore_kv_caches(self) -> None:
        """Every child, in order (see `OffloadConnector.restore_kv_caches`)."""
        for c in self._connectors:
            if hasattr(c, "restore_kv_caches"):
                c.restore_kv_caches()

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        best: tuple[float, int, int, bool] | None = None  # score, child, tokens, async
        for i, c in enumerate(self._connectors):
            toks, load_async = c.get_num_new_matched_tokens(request, num_computed_tokens)
            if toks is None:
                return None, False  # a child is still looking: ask again later
            score = toks * self._children[i].load_weight
            if toks > 0 and (best is None or score > best[0]):
                best = (score, i, toks, load_async)
        if best is None:
            self._requests_to_connector.pop(request.request_id, None)
            return 0, False
        self._requests_to_connector[request.request_id] = best[1]
        return best[2], best[3]

    def wait_for_stores(self, timeout_s: float = 60.0) -> int:
        """Each child of ours: see `OffloadConnector.wait_for_stores`."""
        return sum(c.wait_for_stores(timeout_s) for c in self._connectors if hasattr(c, "wait_for_stores"))

    def wait_for_save(self) -> None:
        try:
            super().wait_for_save()  # every child in order; the first to store an entry gathers it
        finally:
            if self._share is not None:
                self._share.clear()

    def build_connector_meta(self, scheduler_output: SchedulerOutput):
        meta = super().build_connector_meta(scheduler_output)
        for child, m in zip(self._children, meta.metadata):
            if not child.store and isinstance(m, OffloadMetadata):
                m.stores.clear()
        return meta


# The name to select in a kv-transfer-config (see the module docstring).
OffloadMultiConnector = MultiConnector
__all__ = ["MultiConnector", "OffloadConnector", "OffloadMultiConnector", "check_children", "parse_children"]
