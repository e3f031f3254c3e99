"""A real vLLM Scheduler and both connector roles in one process, for unit tests.

The pattern is vLLM's own connector unit tests (vllm-project/vllm,
tests/v1/kv_connector/unit/utils.py: `create_vllm_config`, `create_scheduler`,
`create_request`, `create_model_runner_output`, `assert_scheduler_empty`),
which the vllm wheel does not install; these helpers are written for vLLM
0.32's APIs (Apache-2.0 upstream; the ideas, not the code, are theirs).

`WorkerStep` stands in for the model runner: it drives a worker-role
connector exactly as vLLM's `KVConnectorModelRunnerMixin` does (bind the
metadata, `start_load_kv`, the forward, `wait_for_save`,
`get_transfer_results`, `get_kv_connector_stats`,
`build_connector_worker_meta`, clear the metadata), and its "forward" writes
deterministic bytes into the KV cache slots of the tokens each request
computes in the step, so a restored block can be compared byte for byte
with the block that was stored.
"""

from __future__ import annotations

import math
import time
import zlib
from collections.abc import Iterable
from typing import Any

import torch
from vllm import SamplingParams
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import (
    get_request_block_hasher,
    init_none_hash,
    resolve_cache_hit_alignment_tokens,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from offload.metrics import OffloadStats

EOS_TOKEN_ID = 0  # tools/tiny_models.py's tokenizer; the fake forward never samples it


def create_vllm_config(model: str, *, block_size: int = 16, max_num_batched_tokens: int = 256,
                       max_num_seqs: int = 16, max_model_len: int = 4096,
                       kv_connector_extra_config: dict[str, Any] | None = None,
                       kv_load_failure_policy: str = "recompute", **cache_kwargs: Any) -> VllmConfig:
    """A VllmConfig for a local model directory (config only, no weights), with our connector.
    `cache_kwargs` go to CacheConfig (e.g. a hybrid's prefix_cache_retention_interval)."""
    model_config = ModelConfig(model=model, dtype="bfloat16", seed=42, max_model_len=max_model_len)
    scheduler_config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                       max_model_len=max_model_len, enable_chunked_prefill=True,
                                       is_encoder_decoder=model_config.is_encoder_decoder)
    cache_config = CacheConfig(block_size=block_size, gpu_memory_utilization=0.9, cache_dtype="auto",
                               enable_prefix_caching=True, **cache_kwargs)
    vllm_config = VllmConfig(model_config=model_config, scheduler_config=scheduler_config,
                             cache_config=cache_config, device_config=DeviceConfig("cpu"))
    set_connector(vllm_config, kv_connector_extra_config or {}, kv_load_failure_policy)
    return vllm_config


def set_connector(vllm_config: VllmConfig, extra: dict[str, Any], kv_load_failure_policy: str = "recompute") -> None:
    vllm_config.kv_transfer_config = KVTransferConfig(
        kv_connector="OffloadConnector", kv_connector_module_path="offload.connector", kv_role="kv_both",
        kv_connector_extra_config=extra, kv_load_failure_policy=kv_load_failure_policy)


def attention_kv_cache_config(layer_names: list[str], *, block_size: int, num_kv_heads: int, head_size: int,
                              num_blocks: int, dtype: torch.dtype = torch.bfloat16) -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size, dtype=dtype)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(layer_names, spec)])


def hybrid_kv_cache_config(mamba_layers: list[str], attention_layers: list[str], *, block_size: int,
                           mamba_shapes: tuple, mamba_dtypes: tuple, num_kv_heads: int, head_size: int,
                           num_blocks: int, mamba_cache_mode: str,
                           dtype: torch.dtype = torch.bfloat16) -> KVCacheConfig:
    """A Mamba group and an attention group with one page size (the Mamba page
    padded to the attention page), as vLLM's hybrid allocator builds them."""
    attn = FullAttentionSpec(block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size, dtype=dtype)
    mamba = MambaSpec(block_size=block_size, shapes=mamba_shapes, dtypes=mamba_dtypes,
                      mamba_cache_mode=mamba_cache_mode, page_size_padded=attn.page_size_bytes)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(mamba_layers, mamba),
                                          KVCacheGroupSpec(attention_layers, attn)])


def create_scheduler(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> Scheduler:
    """vLLM's Scheduler, which builds the scheduler-role connector itself (KVConnectorFactory).
    Block and hash sizes resolved as the engine core resolves them (a
    `prefix_match_unit` in the cache config gives sub-block hashes), and set on
    the KVCacheConfig as the engine core sets them for its connector."""
    vllm_config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
    block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    kv_cache_config.hash_block_size = hash_block_size
    kv_cache_config.cache_hit_alignment_tokens = resolve_cache_hit_alignment_tokens(
        kv_cache_config, vllm_config, block_size, hash_block_size)
    return Scheduler(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                     structured_output_manager=StructuredOutputManager(vllm_config),
                     block_size=block_size, hash_block_size=hash_block_size, log_stats=True)


_none_hash_ready = False


def create_request(request_id: str, prompt_token_ids: list[int], *, max_tokens: int = 4,
                   block_size: int = 16) -> Request:
    global _none_hash_ready
    if not _none_hash_ready:
        init_none_hash(sha256)
        _none_hash_ready = True
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    params.update_from_generation_config({}, EOS_TOKEN_ID)
    return Request(request_id=request_id, prompt_token_ids=list(prompt_token_ids), sampling_params=params,
                   pooling_params=None, block_hasher=get_request_block_hasher(block_size, sha256))


def create_model_runner_output(req_ids: list[str], sampled: dict[str, list[int]],
                               kv_connector_output: KVConnectorOutput | None) -> ModelRunnerOutput:
    return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                             sampled_token_ids=[sampled.get(r, []) for r in req_ids], logprobs=None,
                             prompt_logprobs_dict={}, pooler_output=None, kv_connector_output=kv_connector_output)


def assert_scheduler_empty(scheduler: Scheduler) -> None:
    """No request, queue entry, or held block left (vLLM's check of the same name)."""
    assert not scheduler.requests, list(scheduler.requests)
    assert not scheduler.running and not len(scheduler.waiting)
    assert not scheduler.finished_recving_kv_req_ids and not scheduler.failed_recving_kv_req_ids
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.free_block_queue.num_free_blocks == pool.num_gpu_blocks - 1  # all but the null block
    assert all(b.ref_cnt == 0 for b in pool.blocks[1:])


def cpu_kv_caches(kv_cache_config: KVCacheConfig) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Per-layer KV cache as vLLM-CPU registers it, and each layer's raw per-block bytes.

    Attention: [num_blocks, heads, block_size, 2 * head_size]. Mamba: a list
    of state views (e.g. conv, ssm) packed into one padded page per block,
    as vLLM lays them out for the hybrid allocator (page_size_padded)."""
    caches: dict[str, Any] = {}
    raw: dict[str, torch.Tensor] = {}
    n = kv_cache_config.num_blocks
    for g in kv_cache_config.kv_cache_groups:
        s = g.kv_cache_spec
        for name in g.layer_names:
            if isinstance(s, MambaSpec):
                base = torch.zeros(n, s.page_size_bytes, dtype=torch.uint8)
                views, off = [], 0
                for shape, dtype in zip(s.shapes, s.dtypes):
                    nbytes = math.prod(shape) * dtype.itemsize
                    views.append(base[:, off:off + nbytes].view(dtype).view(n, *shape))
                    off += nbytes
                caches[name], raw[name] = views, base[:, :off]
            else:
                t = torch.zeros(n, s.num_kv_heads, s.block_size, 2 * s.head_size, dtype=s.dtype)
                caches[name], raw[name] = t, t.view(n, -1).view(torch.uint8)
    return caches, raw


class _CpuAttentionLayer:
    """What the connector asks of an attention layer (`impl.do_kv_cache_update`),
    written with vLLM-CPU's own cache-write kernel for this machine's ISA, so
    the bytes of a token inside a block sit where a real engine puts them."""

    def __init__(self, spec: Any) -> None:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        self.block_size, self.heads = spec.block_size, spec.num_kv_heads
        self.isa = _get_attn_isa(spec.dtype, spec.block_size, spec.head_size)
        self.impl = self

    def do_kv_cache_update(self, layer: Any, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
        from vllm import _custom_ops as ops

        n = kv_cache.shape[0]
        key_cache, value_cache = kv_cache.view(n, self.heads, 2 * self.block_size, -1).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, self.isa)


class WorkerStep:
    """The model runner's side of a step, in this process."""

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, scheduler: Scheduler) -> None:
        from offload.connector import OffloadConnector

        self.scheduler = scheduler
        self.groups = kv_cache_config.kv_cache_groups
        self.layers: dict[str, _CpuAttentionLayer] = {}
        ctx = vllm_config.compilation_config.static_forward_context
        for g in self.groups:
            if not isinstance(g.kv_cache_spec, MambaSpec):
                for name in g.layer_names:
                    self.layers[name] = ctx[name] = _CpuAttentionLayer(g.kv_cache_spec)
        self.connector = OffloadConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
        self.kv_caches, self.raw = cpu_kv_caches(kv_cache_config)
        self.connector.register_kv_caches(self.kv_caches)

    # -- the fake forward: bytes that depend only on the token prefix they stand for --

    @staticmethod
    def token_value(prefix_crc: int, layer: int) -> int:
        return ((prefix_crc ^ (layer * 0x9E3779B1)) & 0x3FFF) | 1  # never 0 ("unwritten"), a finite bf16

    @staticmethod
    def prefix_crcs(tokens: list[int], start: int, end: int) -> list[int]:
        """The fake forward's per-token seed: a CRC of the prefix up to each token."""
        crcs, crc = [], zlib.crc32(bytes(str(tokens[:start]), "ascii"))
        for pos in range(start, end):
            crc = zlib.crc32(tokens[pos].to_bytes(4, "little"), crc)
            crcs.append(crc)
        return crcs

    def write_attention(self, name: str, layer: int, cache: torch.Tensor, crcs: list[int],
                        slots: list[int]) -> None:
        """Tokens' K and V (each filled with its token value) into their slots, by vLLM-CPU's kernel."""
        spec = self.layers[name]
        head = cache.shape[-1] // 2
        kv = torch.empty(len(slots), spec.heads, head, dtype=cache.dtype)
        for i, crc in enumerate(crcs):
            kv[i].view(torch.int16).fill_(self.token_value(crc, layer))
        spec.do_kv_cache_update(spec, kv, kv, cache, torch.tensor(slots, dtype=torch.long))

    def token_bytes(self, name: str, slot: int) -> torch.Tensor:
        """Which bytes of one block page of attention layer `name` hold the
        token in `slot` of the block (a bool per byte), by vLLM-CPU's kernel."""
        spec = self.layers[name]
        scratch = torch.zeros((2, *self.kv_caches[name].shape[1:]), dtype=self.kv_caches[name].dtype)
        ones = torch.ones(1, spec.heads, scratch.shape[-1] // 2, dtype=scratch.dtype)  # bf16 1.0: no zero byte
        spec.do_kv_cache_update(spec, ones, ones, scratch, torch.tensor([spec.block_size + slot]))
        return scratch[1].contiguous().view(-1).view(torch.uint8) != 0

    def expected_block(self, tokens: list[int], group: int, block: int, upto: int) -> list[bytes]:
        """Per layer, the bytes a zeroed attention block `block` of `group`
        holds once tokens [block start, upto) are written, and nothing else."""
        out, layer = [], 0
        bs = self.groups[group].kv_cache_spec.block_size
        start = block * bs
        crcs = self.prefix_crcs(tokens, start, upto)
        for g, grp in enumerate(self.groups):
            for name in grp.layer_names:
                layer += 1
                if g != group:
                    continue
                scratch = torch.zeros((2, *self.kv_caches[name].shape[1:]), dtype=self.kv_caches[name].dtype)
                self.write_attention(name, layer, scratch, crcs, [bs + pos - start for pos in range(start, upto)])
                out.append(scratch[1].contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        return out

    def forward(self, so: SchedulerOutput) -> None:
        """Attention: each computed token's slot. Mamba: the state after the
        step's last token, in the block holding that token (vLLM's "align"
        mode keeps a state per block boundary)."""
        for copy in so.kv_cache_block_copies or ():  # vLLM's copy-on-write, before the forward
            for t in self.raw.values():
                t[copy.dst_block_id] = t[copy.src_block_id]
        for req_id, n in so.num_scheduled_tokens.items():
            req = self.scheduler.requests[req_id]
            after = req.num_computed_tokens  # advanced by schedule() already
            tables = self.scheduler.kv_cache_manager.get_block_ids(req_id)
            tokens = req.all_token_ids
            crcs = self.prefix_crcs(tokens, after - n, after)
            layer = 0
            for g, group in enumerate(self.groups):
                bs = group.kv_cache_spec.block_size
                for name in group.layer_names:
                    layer += 1
                    if isinstance(group.kv_cache_spec, MambaSpec):
                        self.raw[name][tables[g][(after - 1) // bs]].view(torch.int16).fill_(
                            self.token_value(crcs[-1], layer))
                        continue
                    self.write_attention(name, layer, self.kv_caches[name], crcs,
                                         [tables[g][pos // bs] * bs + pos % bs for pos in range(after - n, after)])

    def blocks_bytes(self, block_ids: Iterable[int], group: int = 0) -> list[bytes]:
        """The bytes of these blocks in every layer of a group, for byte-for-byte comparison."""
        ids = list(block_ids)
        return [self.raw[name][ids].contiguous().numpy().tobytes() for name in self.groups[group].layer_names]

    def scramble(self) -> None:
        for t in self.raw.values():
            t.fill_(0x5A)

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        c = self.connector
        c.bind_connector_metadata(so.kv_connector_metadata)
        c.start_load_kv(None)
        self.forward(so)
        c.wait_for_save()
        results = c.get_transfer_results(so.finished_req_ids)
        stats = c.get_kv_connector_stats()
        worker_meta = c.build_connector_worker_meta()
        c.clear_connector_metadata()
        out = KVConnectorOutput(finished_sending=results.finished_sending or None,
                                finished_recving=results.finished_recving or None,
                                failed_recving=results.failed_recving or set(),
                                kv_connector_stats=stats, kv_connector_worker_meta=worker_meta)
        sampled = {}
        for req_id in so.num_scheduled_tokens:
            req = self.scheduler.requests[req_id]
            if req.num_computed_tokens >= req.num_prompt_tokens:
                sampled[req_id] = [7 + len(req.output_token_ids)]
        return create_model_runner_output(list(so.num_scheduled_tokens), sampled, out)


class Engine:
    """schedule → execute → update_from_output, as EngineCore.step does; collects
    finished requests' kv_transfer_params and the scheduler-side connector stats."""

    def __init__(self, scheduler: Scheduler, worker: WorkerStep) -> None:
        self.scheduler = scheduler
        self.worker = worker
        self.finished: dict[str, dict[str, Any] | None] = {}
        self.scheduled: dict[str, int] = {}  # tokens computed per request, over all steps
        self.sched_stats = OffloadStats(data={})

    def step(self, between=None) -> SchedulerOutput:
        so = self.scheduler.schedule()
        for req_id, n in so.num_scheduled_tokens.items():
            self.scheduled[req_id] = self.scheduled.get(req_id, 0) + n
        mro = self.worker.execute(so)
        if between is not None:
            between()
        outs = self.scheduler.update_from_output(so, mro)
        for eco in outs.values():
            for o in eco.outputs:
                if o.finish_reason is not None:
                    self.finished[o.request_id] = o.kv_transfer_params
            st = eco.scheduler_stats
            if st is not None and st.kv_connector_stats:
                data = st.kv_connector_stats
                self.sched_stats.aggregate(OffloadStats(data=data if isinstance(data, dict) else data.data))
        return so

    def run_until(self, done, timeout: float = 60.0) -> int:
        """Step until `done()`. Loads finish on the connector's I/O threads, so
        this waits in time, not in steps: a step that computes nothing (every
        request waiting for its load) yields the CPU to those threads."""
        deadline = time.monotonic() + timeout
        steps = 0
        while not done():
            if time.monotonic() > deadline:
                raise AssertionError(f"not done after {timeout}s ({steps} steps)")
            if not self.step().total_num_scheduled_tokens:
                time.sleep(0.002)
            steps += 1
        return steps

    def run_to_completion(self, timeout: float = 60.0) -> int:
        return self.run_until(lambda: not self.scheduler.has_requests(), timeout)

    def status(self, req_id: str) -> RequestStatus | None:
        r = self.scheduler.requests.get(req_id)
        return None if r is None else r.status

    def totals(self) -> dict[str, float]:
        """Counter totals over every step, both roles (what the Prometheus counters would add up to)."""
        both = OffloadStats(data={})
        both.aggregate(self.sched_stats)
        return both.reduce()


def run_and_snapshot(eng: Engine, req_id: str, tokens: list[int], *, block_size: int) -> list[bytes]:
    """Run a request to completion (2 output tokens); return the bytes, per
    layer of group 0, of the blocks of the tokens a repeat of the prompt
    restores (the connector's planner: `repeat_hit`), taken in the step that
    computed them. Stores may still be landing when it returns."""
    hit = eng.scheduler.connector.planner.repeat_hit(len(tokens))
    req = create_request(req_id, tokens, max_tokens=2, block_size=block_size)
    eng.scheduler.add_request(req)
    snapshot = None
    while req_id in eng.scheduler.requests:
        eng.step()
        if snapshot is None and req.num_computed_tokens >= hit:
            blocks = eng.scheduler.kv_cache_manager.get_block_ids(req_id)[0][:hit // block_size]
            snapshot = eng.worker.blocks_bytes(blocks)
    assert snapshot is not None, f"{req_id}: never computed the {hit} tokens a repeat restores"
    return snapshot


def tiny_hybrid_engine(model_dir: str, num_blocks: int, unit: int, max_model_len: int = 1536) -> Engine:
    """The tiny hybrid (tools/tiny_models.py's qwen3-next-tiny: 128-token blocks) under vLLM's
    Scheduler with `num_blocks` KV cache blocks, prefix-match unit `unit` and a 16 MiB host-memory tier."""
    cfg = create_vllm_config(model_dir, block_size=128, max_num_batched_tokens=128, max_model_len=max_model_len,
                             prefix_cache_retention_interval=128, prefix_match_unit=unit)
    set_connector(cfg, {"store": "cpu", "cpu_bytes": 1 << 24})
    kcc = hybrid_kv_cache_config(["model.layers.0.linear_attn", "model.layers.2.linear_attn"],
                                 ["model.layers.1.self_attn.attn", "model.layers.3.self_attn.attn"],
                                 block_size=128, mamba_shapes=((3, 192), (1, 64, 64)),
                                 mamba_dtypes=(torch.bfloat16, torch.float32), num_kv_heads=4, head_size=64,
                                 num_blocks=num_blocks, mamba_cache_mode=cfg.cache_config.mamba_cache_mode)
    sched = create_scheduler(cfg, kcc)
    return Engine(sched, WorkerStep(cfg, kcc, sched))
