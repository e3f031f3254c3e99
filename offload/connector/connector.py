"""OffloadConnector: the vLLM glue for one stack of offload tiers.

One instance runs in the scheduler (lookup, planning: connector/scheduler.py)
and one per worker (bytes: connector/worker.py); they agree on keys because
both derive them from the same KVCacheConfig. See docs/data-path.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.logger import init_logger
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from offload.config import EXTRA_CONFIG, ConfigError, OffloadConfig, parse_config
from offload.connector.metadata import OffloadMetadata, WorkerReport
from offload.connector.startup import advise, share_vllm_logging
from offload.keys import FORMAT_VERSION, fingerprint, rank_fingerprint
from offload.layout import fingerprint_fields, group_specs
from offload.metrics import OffloadPromMetrics, OffloadStats, Recorder
from offload.plan.model import plan_from_engine
from offload.plan.policy import check_chunk_size
from offload.planner import ChunkSizeError, GroupKind, HybridOffloadPlanner
from offload.store.base import TierContext, TierIndex, TierSpec
from offload.store.cachedir.owners import CacheDirs
from offload.store.stack import StackOptionError, build_stack
from offload.tailmask import TokenMap

if TYPE_CHECKING:
    import torch
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from offload.connector.stores import SharedGathers

logger = init_logger(__name__)

__all__ = ["OffloadConnector"]


def _tail_unit(kv_cache_config: KVCacheConfig) -> int | None:
    """The token unit vLLM's own prefix cache hits at (`--prefix-match-unit`
    on a hybrid in 'align' mode; the block, or the blocks' LCM, on an
    attention-only model), set by the engine core on the KVCacheConfig
    before any connector exists; None where it is not set. The planner uses
    it for partial tails only where it is finer than a chunk."""
    unit = getattr(kv_cache_config, "cache_hit_alignment_tokens", None)
    return unit if isinstance(unit, int) and unit > 0 else None


def _tp_rank(vllm_config: VllmConfig) -> int:
    """This worker's tensor-parallel rank, as vLLM's own OffloadingConnector
    takes it: the worker sets parallel_config.rank before any connector exists
    (PP is refused), so no distributed group is needed and both roles can be
    built in one process (tests/test_connector_units.py)."""
    pc = vllm_config.parallel_config
    return pc.rank % pc.tensor_parallel_size


def _transfer_config(vllm_config: VllmConfig) -> KVTransferConfig:
    """vLLM's kv_transfer_config, which names this connector wherever it is built."""
    return cast("KVTransferConfig", vllm_config.kv_transfer_config)


class OffloadConnector(KVConnectorBase_V1, SupportsHMA):
    """Offloads KV cache chunks of every group (attention KV, windowed KV,
    Mamba/GDN state) to a stack of tiers (host memory, files, LMCache's
    storage engine), and restores a prefix only when every group can be
    restored at exactly that boundary."""

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        # A stack's hit is attributed to the slowest tier it reads from.
        if not num_external_tokens or self._sched is None:
            return {}
        tier = self.tiers[self._sched.hit_tier(request.request_id)]
        return {CacheHitSource[tier.hit_source]: num_external_tokens}

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config, role, cast("KVCacheConfig", kv_cache_config))  # None is refused below
        share_vllm_logging()
        if kv_cache_config is None:
            raise ConfigError("OffloadConnector needs vLLM's KVCacheConfig (vLLM >= 0.32)")
        ktc = _transfer_config(vllm_config)
        self.cfg: OffloadConfig = parse_config(ktc.kv_connector_extra_config)
        pc = vllm_config.parallel_config
        if pc.pipeline_parallel_size > 1:
            raise ConfigError("OffloadConnector does not support pipeline parallelism yet "
                              f"(pipeline_parallel_size={pc.pipeline_parallel_size}); use 1")
        specs = group_specs(kv_cache_config)
        try:
            self.planner = HybridOffloadPlanner(specs, self.cfg.hybrid_chunk_size,
                                                tail_unit=_tail_unit(kv_cache_config))
            check_chunk_size(specs, self.cfg.hybrid_chunk_size)
        except ChunkSizeError as e:
            raise ConfigError(f"{EXTRA_CONFIG}.{e}") from None
        fields = fingerprint_fields(vllm_config, kv_cache_config, self.planner.chunk_size, self.cfg.model_id)
        self.fingerprint = fingerprint(fields)
        self._layout = fields
        self._num_blocks = kv_cache_config.num_blocks
        self._sched = None
        self._worker = None
        self.recorders = [Recorder(t.tier_name) for t in self.cfg.tiers]
        tp = pc.tensor_parallel_size
        rank = _tp_rank(vllm_config) if role != KVConnectorRole.SCHEDULER else 0
        # With the uniproc executor (TP=1) vLLM builds the scheduler's and the
        # worker's connector in the same engine-core process.
        separate = tp * pc.pipeline_parallel_size > 1 or pc.distributed_executor_backend not in (None, "uni")
        ctx = TierContext(self.planner, rank_fingerprint(self.fingerprint, rank, tp),
                          rank_fingerprint(self.fingerprint, 0, tp), world_size=tp, separate_workers=separate,
                          # Both halves in one process share their directory owners and LMCache
                          # engines through the engine's config object (separate processes do not).
                          dirs=CacheDirs.attached(vllm_config))
        self.stack = build_stack([(t.store, t.options()) for t in self.cfg.tiers], ctx)
        self.tiers: list[TierSpec] = self.stack.specs
        if role == KVConnectorRole.SCHEDULER:
            self._startup_checks(vllm_config)
            from offload.connector.scheduler import SchedulerSide

            self._sched = SchedulerSide(self.cfg, self.planner, self.fingerprint, self._indices(), self.recorders,
                                        world_size=tp)
        else:
            from offload.connector.worker import WorkerSide

            names = [list(g.layer_names) for g in kv_cache_config.kv_cache_groups]
            self._worker = WorkerSide(self.cfg, self.planner, ctx.fingerprint,
                                      self.stack.data, names, self.recorders,
                                      token_map=self._token_map)

    def _token_map(self, group: int, tensor: torch.Tensor, block_dim: int) -> TokenMap:
        """Which token owns each element of a block page of `tensor` (a layer
        of attention group `group`, blocks along `block_dim`), from the layer's
        own cache write."""
        spec = cast("AttentionSpec", self._kv_cache_config.kv_cache_groups[group].kv_cache_spec)  # an attention group
        name = self._kv_cache_config.kv_cache_groups[group].layer_names[0]
        layer = self._vllm_config.compilation_config.static_forward_context[name]

        def write(key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
            layer.impl.do_kv_cache_update(layer, key, value, cache, slots)

        return TokenMap.probe(write, tensor, block_dim, spec.block_size, spec.num_kv_heads,
                              spec.head_size, cast("torch.dtype", self._vllm_config.model_config.dtype))

    def _where(self, i: int) -> str:
        return "" if "tiers" not in (_transfer_config(self._vllm_config).kv_connector_extra_config or {}) \
            else f"tiers[{i}]."

    def _indices(self) -> list[TierIndex]:
        try:
            return self.stack.indices()
        except StackOptionError as e:
            raise ConfigError(f"{EXTRA_CONFIG}.{self._where(e.position)}{e}") from None

    def _startup_checks(self, vllm_config: VllmConfig) -> None:
        ktc = _transfer_config(vllm_config)
        try:
            self.stack.check()
        except StackOptionError as e:
            raise ConfigError(f"{EXTRA_CONFIG}.{self._where(e.position)}{e}") from None
        groups = ", ".join(f"{g.kind.value}/{g.block_size}" for g in self.planner.groups)
        how = "set" if self.cfg.hybrid_chunk_size else "the default for these block sizes"
        logger.info("OffloadConnector: hybrid_chunk_size=%d (%s); groups: %s; tiers, fastest first: %s",
                    self.planner.chunk_size, how, groups,
                    "; ".join(f"[{i}] {c.tier_name} ({c.store}: {t.describe()})"
                              for i, (c, t) in enumerate(zip(self.cfg.tiers, self.tiers))))
        plan = plan_from_engine(vllm_config, self._kv_cache_config, self.cfg.hybrid_chunk_size)
        logger.info("OffloadConnector: plan (as `kvoffload plan` prints it):\n%s", plan.describe())
        if ktc.kv_load_failure_policy != "recompute":
            # A failed or corrupt load must become a miss and a recompute.
            ktc.kv_load_failure_policy = "recompute"
            logger.info("OffloadConnector: kv_load_failure_policy set to 'recompute': a failed load "
                        "of an offloaded prefix is a cache miss, not a request error")
        advise(vllm_config, self.cfg, self.planner, plan)

    # ---- scheduler side ---------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self._sched is not None:
            from offload.connector.room import LoadRoom

            vc = self._vllm_config
            spec = vc.num_speculative_tokens
            self._sched.room = LoadRoom(
                kv_cache_manager, vc.model_config.max_model_len,
                1 + spec + vc.num_lookahead_tokens if spec else 0,
                [g.block_size for g in self.planner.groups if g.kind is GroupKind.MAMBA])

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._sched is not None
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self._sched is not None
        self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> OffloadMetadata:
        assert self._sched is not None
        return self._sched.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self._sched is not None:
            self._sched.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._sched is not None
        return self._sched.request_finished(request)

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        # Stores copy pages out in the step that computed them, so blocks are
        # never held past the request's end.
        assert self._sched is not None
        return self._sched.request_finished(request)

    # ---- worker side --------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        layout = {**self._layout, "base_fingerprint": self.fingerprint.hex(), "format_version": FORMAT_VERSION}
        self._worker.register_kv_caches(kv_caches, self._num_blocks, layout)

    def share_gathers(self, share: SharedGathers) -> None:
        """Worker side: take host copies from, and offer them to, sibling
        connectors of the same worker (a MultiConnector's children), so an
        entry leaves the KV cache once per step. Call before the first step;
        the caller clears `share` after every step's `wait_for_save` of all
        siblings. Ignored in the scheduler, which copies nothing."""
        if self._worker is not None:
            self._worker.share_gathers(share)

    # ---- sleep mode (vLLM >= 0.33; 0.32 never calls these) -------------------------
    # What sleeps is the GPU KV cache only. The tiers keep everything: the
    # host-memory pool stays allocated (host memory, not the GPU's), files
    # and LMCache entries are untouched, the scheduler's index stays valid, so
    # after wake-up a prompt hits the tiers instead of being recomputed.

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        return True

    def unregister_kv_caches(self) -> None:
        """Before vLLM releases the KV cache: wait for the copies in progress,
        then refuse every copy (a load not yet copied becomes a miss and a
        recompute) and drop the page tables with their raw addresses. Stores
        are not waited for: their bytes were gathered into host memory in the
        step that computed them, and they go on being written to the tiers
        below while vLLM sleeps. Idempotent."""
        if self._worker is not None and self._worker.release_kv_caches():
            logger.info("OffloadConnector: KV cache unregistered (sleep); the tiers keep their entries")

    def restore_kv_caches(self) -> None:
        """After vLLM mapped the KV cache again: page tables from the same
        tensors' current addresses, then copies are allowed. Idempotent."""
        if self._worker is not None and self._worker.retake_kv_caches():
            logger.info("OffloadConnector: KV cache restored (wake-up)")

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, OffloadMetadata)
        self._worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are whole-request and asynchronous

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # Mamba layers never call this; all groups are stored in wait_for_save

    def wait_for_save(self) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, OffloadMetadata)
        self._worker.wait_for_save(meta)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self._worker is not None
        return self._worker.get_transfer_results()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending or None, r.finished_recving or None

    def build_connector_worker_meta(self) -> WorkerReport | None:
        """Worker side, after every step: the stores dropped and warm entries settled since the last one."""
        return self._worker.take_report() if self._worker is not None else None

    def wait_for_stores(self, timeout_s: float = 60.0) -> int:
        """Worker side: wait for the stores queued so far to land; returns how
        many are still pending after `timeout_s`. For harnesses that must not
        start a pass before the last one's stores are readable (vLLM never calls it)."""
        return self._worker.drain(timeout_s) if self._worker is not None else 0

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._sched is not None:
            self._sched.close()

    # ---- metrics (see offload/metrics.py) -------------------------------------------

    def get_kv_connector_stats(self) -> OffloadStats | None:
        """Called by vLLM after every step, in the scheduler and in each worker."""
        side = self._sched if self._sched is not None else self._worker
        if side is not None:
            side.report()
        out: OffloadStats | None = None
        for rec in self.recorders:
            stats = rec.take()
            if stats is not None:
                out = stats if out is None else out.aggregate(stats)
        return out

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> OffloadStats:
        return OffloadStats(data=data or {})

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> OffloadPromMetrics:
        return OffloadPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


# vLLM's MultiConnector rebuilds its children's stats by registered name in
# the API server; registering also lets a config omit kv_connector_module_path.
try:
    KVConnectorFactory.register_connector("OffloadConnector", __name__, "OffloadConnector")
except ValueError:  # registered already (module imported twice under another name)
    pass
