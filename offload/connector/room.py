"""Room in vLLM's KV cache for an async load to finish its prefill.

A request whose KV this connector loads asynchronously holds its blocks while
it waits, and vLLM cannot preempt a waiting request. vLLM 0.32 admits such a
load only if its blocks leave room for the prefills already in flight to
finish (`Scheduler._inflight_prefill_reserved_blocks`), but that reservation
misses one block for every load that ends inside a Mamba block: once the load
lands, vLLM caches the state block there and copies it on write before the
request goes on (`MambaManager._partial_hit_reqs`), one block more than it
reserved. Partial tails restored to the prefix-match unit are exactly such
loads. With the KV cache full of them and nothing running, none can take its
next block and vLLM stalls for good (tests/test_partial_tail_load.py found it;
tests/test_connector_units.py reproduces it on vLLM's Scheduler).

So a hit is offered only where the free blocks hold what the request still
needs to finish its prompt and what every load already admitted still needs,
that block included. Otherwise the request waits a step (vLLM asks again).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from vllm.logger import init_logger
from vllm.v1.request import RequestStatus

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.request import Request

logger = init_logger(__name__)

__all__ = ["LoadRoom"]


class LoadRoom:
    """Counts blocks as vLLM's own admission does (the coordinator's
    `get_num_blocks_to_allocate` for the full sequence), plus the copy-on-write
    block vLLM 0.32 leaves out of a loading request's reservation."""

    def __init__(self, kv_cache_manager: KVCacheManager, max_model_len: int, extra_tokens: int,
                 mamba_block_sizes: Iterable[int]) -> None:
        self.kvm = kv_cache_manager
        self.max_model_len = max_model_len
        self.extra_tokens = extra_tokens  # spec decode slots, as vLLM adds them to a reservation
        self.mamba_block_sizes = tuple(mamba_block_sizes)
        self._broken = False

    def _partial(self, end: int) -> int:
        """1 where a load ending at `end` leaves a Mamba state inside a block."""
        return int(any(end % bs for bs in self.mamba_block_sizes))

    def _blocks(self, request: Request, computed: int) -> int:
        """Blocks `request` still needs for its whole sequence, `computed` tokens in."""
        full = min(request.num_tokens, self.max_model_len)
        return self.kvm.coordinator.get_num_blocks_to_allocate(
            request_id=request.request_id, num_tokens=full + self.extra_tokens,
            new_computed_blocks=self.kvm.empty_kv_cache_blocks.blocks, num_encoder_tokens=0,
            total_computed_tokens=computed, num_local_computed_tokens=computed, num_tokens_main_model=full,
            apply_admission_cap=True, prefill_end=max(request.num_prompt_tokens, request.num_tokens - 1))

    def fits(self, request: Request, end: int, loading: Iterable[tuple[Request, int]]) -> bool:
        """Can `request`, restored to `end`, and every request in `loading`
        ((request, where its load ends), admitted and not yet running) all
        finish their prompts within the free blocks? True where vLLM's
        block accounting is not the one this was written against."""
        if self._broken:
            return True
        try:
            need = self._blocks(request, end) + self._partial(end)
            if need > self.kvm.block_pool.num_gpu_blocks:
                return True  # never fits, whatever waits: vLLM's own admission decides
            for r, r_end in loading:
                # Once its load has landed vLLM counts the copy itself (the request is in `_partial_hit_reqs`).
                need += self._blocks(r, r.num_computed_tokens) + (
                    self._partial(r_end) if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS else 0)
            return need <= self.kvm.block_pool.get_num_free_blocks()
        except (AttributeError, TypeError) as e:
            self._broken = True
            logger.warning("kvoffload: cannot count vLLM's free KV cache blocks (%s); async loads are offered "
                           "without checking that they can finish, which vLLM 0.32 can stall on (docs/operations.md)",
                           e)
            return True
