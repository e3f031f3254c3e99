"""vLLM-CPU's other CPU kinds, on this machine: its ISA branches, each by its own switch.

vLLM-CPU chooses the kernel build (`vllm._C` with AVX512-BF16/AMX, `_C_AVX512`,
`_C_AVX2`), and with it block sizes, the GDN state dtype, the conv-state
layout and the tensor-parallel communicator (shared memory where the build has
`init_shm_manager`, torch.distributed otherwise), from what torch says of the
CPU. `tests/isa/sitecustomize.py` makes a process answer as an older CPU kind
would, so a machine runs every kind at or below its own: an Intel machine with
AVX512-BF16 runs all three, an AMD EPYC without AVX512 only its own (the kinds
above it are skipped, with the reason). The native kind runs in the rest of the
suite.

Every expectation comes from the plan or from vLLM under the same switch: the
block size from config.json and the state dtype vLLM picks for that kind, the
communicator from whether that kind's kernel build registers the shared-memory
ops, the restored tokens from the planner.
"""

from __future__ import annotations

import os
import random

import pytest

from conftest import REPO, engine_args, fs_kv_config, layouts, random_prompt
from harness.engine import RunSpec, run_engine
from offload.plan.model import cpu_isa
from offload.plan.run import plan_for_model
from test_plan import config, expected_layout, vllm_cpu_facts

pytestmark = pytest.mark.long  # a plan per kind and TP size, and engine runs (docs/development.md)

KINDS = ("avx2", "avx512", "avx512_bf16")  # from oldest to newest; a CPU runs its own and older ones
NATIVE = cpu_isa()
EMULATED = [k for k in KINDS if NATIVE in KINDS and KINDS.index(k) < KINDS.index(NATIVE)]


def kind_env(kind: str) -> dict[str, str]:
    """The environment under which vLLM takes `kind`'s branches (tests/isa/sitecustomize.py)."""
    path = os.pathsep.join(filter(None, [str(REPO / "tests" / "isa"), os.environ.get("PYTHONPATH")]))
    return {"PYTHONPATH": path, "KVOFFLOAD_TEST_CPU_ISA": kind, "ATEN_CPU_CAPABILITY": kind}


def emulated(kind: str):
    """`kind` as a parameter, skipped where this CPU cannot run it."""
    return pytest.param(kind, marks=pytest.mark.skipif(
        kind not in EMULATED, reason=f"this CPU's vLLM kernels are {NATIVE}; it cannot run {kind}'s"))


@pytest.mark.parametrize("kind", [emulated(k) for k in KINDS[:-1]])
@pytest.mark.parametrize("tp", [1, 2])
def test_plan_under_another_cpu_kind(kind, tp, models_dir, monkeypatch):
    """The Qwen3-Next-80B geometry planned under `kind`'s kernels: its block size and state pages,
    and at TP 2 the communicator that kind's build gives (the shared-memory one needs
    VLLM_DIST_IDENT, which the plan's ranks set as vLLM's CPU worker does)."""
    env = kind_env(kind)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    facts = vllm_cpu_facts(env)
    model = models_dir / "qwen3-next-80b-geometry"
    plan = plan_for_model(model, tensor_parallel_size=tp, max_model_len=4096)
    assert plan.cpu_isa == kind
    exp = expected_layout(config(models_dir, model.name), tp=tp,
                          ssm_bytes=4 if facts["float32_state"] else 2)
    assert plan.block_sizes == [exp["block"]] * 4
    assert [g.page_bytes_per_layer for g in plan.groups] == [exp["state_page"]] * 3 + [exp["attn_page"]]
    assert plan.tp_communicator == ("" if tp == 1 else "shm" if facts["shm"] else "torch.distributed")


@pytest.mark.e2e
@pytest.mark.parametrize("kind", [emulated(k) for k in KINDS[:-1]])
def test_mixed_fleet_shares_a_directory_without_loading_the_other_kinds_files(kind, models_dir, tmp_path,
                                                                              monkeypatch):
    """One cache directory, two CPU kinds (the native one and `kind`), the toy hybrid.

    The native engine stores first. An engine on `kind`'s kernels then serves the same prompts
    into the same directory: where the two kinds' KV cache layouts differ (the GDN state's dtype
    or conv layout), their fingerprints differ and it restores nothing of the native files;
    where they agree it restores them. A restart on `kind` then restores its own files up to
    the planner's hit, with greedy tokens identical to its first run (our connector, nothing
    restored: the reference)."""
    env = kind_env(kind)
    model = models_dir / "qwen3-next-tiny"
    rng = random.Random(21)
    prompts = [random_prompt(rng, n) for n in (390, 500, 420)]
    kv = fs_kv_config(tmp_path)
    spec = RunSpec(str(model), prompts, kv, max_tokens=12, engine_args=engine_args(hybrid=True))

    native = run_engine(spec, env={"PYTHONHASHSEED": "1"})
    [native_dir] = layouts(tmp_path)
    other = run_engine(spec, env={**env, "PYTHONHASHSEED": "2"})
    other_dirs = set(layouts(tmp_path)) - {native_dir}
    restart = run_engine(spec, env={**env, "PYTHONHASHSEED": "3"})

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    planner = plan_for_model(model, max_model_len=4096).planner()
    full = [planner.max_hit_chunks(len(p)) * planner.chunk_size for p in prompts]
    assert [r.restored_tokens for r in native.results] == [0, 0, 0]
    if other_dirs:  # a layout of its own: the native files are another layout's
        assert [r.restored_tokens for r in other.results] == [0, 0, 0]
    else:
        assert [r.restored_tokens for r in other.results] == full
    assert [r.restored_tokens for r in restart.results] == full
    assert not any(r.load_failed for run in (native, other, restart) for r in run.results)
    assert restart.outputs() == other.outputs()
