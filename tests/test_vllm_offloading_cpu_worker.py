"""The torch-copy worker of bench/vllm_offloading_cpu.py on its own (no engine): vLLM's chunk
arithmetic with 2 blocks per chunk, a partial first chunk, two groups, and an un-padded page
smaller than the tensor's page (only the un-padded bytes move)."""

from __future__ import annotations

import sys

import torch

from conftest import REPO

if str(REPO) not in sys.path:  # bench/ is not installed; it runs from the checkout
    sys.path.insert(0, str(REPO))

from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

from bench.vllm_offloading_cpu import TorchCopyOffloadingWorker


def _caches(t0: torch.Tensor, t1: torch.Tensor) -> CanonicalKVCaches:
    return CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(t0, 64), CanonicalKVCacheTensor(t1, 32)],
        group_data_refs=[[CanonicalKVCacheRef(0, 64)], [CanonicalKVCacheRef(1, 24)]],
    )


def test_store_then_load_round_trip_with_partial_first_chunk():
    g = torch.Generator().manual_seed(0)
    src0 = torch.randint(-128, 127, (10, 64), dtype=torch.int8, generator=g)
    src1 = torch.randint(-128, 127, (10, 32), dtype=torch.int8, generator=g)
    w = TorchCopyOffloadingWorker(_caches(src0, src1), blocks_per_chunk=2, num_cpu_chunks=6)
    # group 0: logical blocks 1..3 (skip 1 in the first chunk) -> chunks 0, 1; group 1: blocks 2..3 -> chunk 4
    store_dev = GPULoadStoreSpec([3, 4, 5, 7, 8], group_sizes=[3, 2], block_indices=[1, 2])
    host = CPULoadStoreSpec([0, 1, 4])
    assert w.submit_store(1, store_dev, host)
    [res] = w.get_finished()
    assert res.job_id == 1 and res.success and res.transfer_size == 3 * 64 + 2 * 24
    h0, h1 = w.host[0], w.host[1]  # (chunks, blocks_per_chunk, page)
    assert torch.equal(h0[0, 1], src0[3]) and torch.equal(h0[1, 0], src0[4]) and torch.equal(h0[1, 1], src0[5])
    assert not h0[0, 0].any()
    assert torch.equal(h1[4, 0, :24], src1[7, :24]) and torch.equal(h1[4, 1, :24], src1[8, :24])
    assert not h1[4, :, 24:].any()  # padding is not copied

    dst0, dst1 = torch.zeros_like(src0), torch.zeros_like(src1)
    w2 = TorchCopyOffloadingWorker(_caches(dst0, dst1), blocks_per_chunk=2, num_cpu_chunks=6)
    w2.host[0].copy_(h0)
    w2.host[1].copy_(h1)
    assert w2.submit_load(2, host, GPULoadStoreSpec([0, 1, 2, 5, 6], group_sizes=[3, 2], block_indices=[1, 2]))
    assert [r.job_id for r in w2.get_finished()] == [2]
    assert torch.equal(dst0[:3], src0[3:6]) and not dst0[3:].any()
    assert torch.equal(dst1[5:7, :24], src1[7:9, :24]) and not dst1[5:7, 24:].any()
