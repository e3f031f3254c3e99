"""Start-up advice of the scheduler-role connector: engine settings that
cost hits or speed, said once in the log with the fix. Nothing here changes
a setting or refuses to start."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from offload.config import OffloadConfig
    from offload.plan.model import ModelPlan
    from offload.planner import HybridOffloadPlanner

logger = init_logger(__name__)

__all__ = ["advise", "check_cpu_core_reservation", "flags_losing_hits", "share_vllm_logging"]


def share_vllm_logging() -> None:
    """Our non-vLLM modules log under 'offload'; print them like vLLM's."""
    ours, theirs = logging.getLogger("offload"), logging.getLogger("vllm")
    if not ours.handlers and theirs.handlers:
        for h in theirs.handlers:
            ours.addHandler(h)
        ours.setLevel(theirs.level)
        ours.propagate = False


def check_cpu_core_reservation(vllm_config: VllmConfig) -> None:
    """vLLM-CPU reserves one more core per rank for any KV connector (meant
    for NIXL's transfer threads). Our store threads run at idle priority and
    need no core of their own. On a machine with no more cores than that
    reservation, vLLM reserves none at all, so the scheduler and API server
    compete with the model's OpenMP threads: decode measured 20% slower on 2
    cores (docs/operations.md#cpu-machines). Say so, with the fix."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU"):
        return
    if os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto") != "auto":
        return
    pc = vllm_config.parallel_config
    ranks = pc.tensor_parallel_size * pc.pipeline_parallel_size
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 0
    if cores <= 2 * ranks:
        logger.warning("OffloadConnector: vLLM-CPU reserves %d cores when a KV connector is set, and this "
                       "machine has %d, so it reserves none and the scheduler competes with the model's "
                       "OpenMP threads. Set VLLM_CPU_NUM_OF_RESERVED_CPU=%d (vLLM's reservation without a "
                       "connector); this connector's I/O threads need no core of their own",
                       2 * ranks, cores, ranks)


def flags_losing_hits(vllm_config: VllmConfig, planned: dict[str, Any]) -> list[str]:
    """The planned Mamba checkpoint flags this engine runs without, as
    `vllm serve` flags. A prefill step longer than a chunk, or a retention
    interval that drops the states between steps, leaves states only at
    prompt ends (measured, offload/plan/policy.py::serve_flags)."""
    if "prefix_cache_retention_interval" not in planned:
        return []
    chunk = planned["prefix_cache_retention_interval"]
    step = vllm_config.scheduler_config.max_num_batched_tokens
    retention = vllm_config.cache_config.prefix_cache_retention_interval  # None: every state
    lost = []
    if step > chunk:
        lost.append(f"--max-num-batched-tokens {planned['max_num_batched_tokens']} (now {step})")
    if retention is not None and (retention == 0 or chunk % retention):
        lost.append(f"--prefix-cache-retention-interval {chunk} (now {retention})")
    return lost


def advise(vllm_config: VllmConfig, cfg: OffloadConfig, planner: HybridOffloadPlanner, plan: ModelPlan) -> None:
    """Warn about every engine setting that loses stores, hits or speed."""
    if getattr(vllm_config, "shutdown_timeout", 1) == 0:
        logger.warning("OffloadConnector: vLLM's shutdown_timeout is 0, so SIGTERM of a server kills "
                       "its workers at once and stores still in flight are lost; pass "
                       "--shutdown-timeout %d to let them finish", max(1, int(cfg.shutdown_timeout_s)))
    lost = flags_losing_hits(vllm_config, plan.engine_kwargs)
    if lost:
        logger.warning("OffloadConnector: hybrid model, and vLLM keeps a Mamba state only at each prompt's "
                       "last block boundary with these flags: repeated prompts and conversation turns hit, "
                       "but a prefix shared by prompts that differ after it does not. For a state at every "
                       "%d-token chunk boundary set: %s (docs/operations.md#plan)",
                       planner.chunk_size, " ".join(lost))
    if plan.prefix_match_unit and planner.tail_unit is None:
        logger.warning("OffloadConnector: vLLM runs without a usable --prefix-match-unit, so its prefix cache "
                       "and this connector hit only at whole %d-token chunks, and a repeated prompt or the next "
                       "turn of a conversation recomputes everything behind the last one. Set %s",
                       planner.chunk_size, plan.prefix_match)
    check_cpu_core_reservation(vllm_config)
