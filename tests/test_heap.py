"""The worker's registration freezes the process's heap where nothing has (offload/connector/heap.py).

vLLM-CPU's worker never freezes its heap, so a full collection there walks the model's, torch's and
vLLM's objects while every load thread waits for the GIL. Driven through the real connector under
vLLM's own Scheduler (tests/vllm_unit_utils.py)."""

from __future__ import annotations

import gc

import pytest

from vllm_unit_utils import (
    WorkerStep,
    attention_kv_cache_config,
    create_scheduler,
    create_vllm_config,
    set_connector,
)

LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]  # llama-tiny


def _worker(models_dir, tmp_path):
    cfg = create_vllm_config(str(models_dir / "llama-tiny"), block_size=16, max_num_batched_tokens=256)
    set_connector(cfg, {"store": "fs", "path": str(tmp_path / "cache")})
    kcc = attention_kv_cache_config(LAYERS, block_size=16, num_kv_heads=2, head_size=32, num_blocks=64)
    return WorkerStep(cfg, kcc, create_scheduler(cfg, kcc))  # registers the KV cache


@pytest.fixture
def thawed():
    """The heap as vLLM-CPU's worker has it: nothing frozen (the session froze its own: conftest.py)."""
    gc.unfreeze()
    yield
    gc.collect()
    gc.freeze()


def test_registration_freezes_the_heap_and_shutdown_thaws_it(models_dir, tmp_path, thawed):
    before = len(gc.get_objects())
    worker = _worker(models_dir, tmp_path)
    try:
        frozen = gc.get_freeze_count()
        # Every object the process had by then is out of a full collection's reach.
        assert frozen >= before // 2, (frozen, before)
        assert len(gc.get_objects()) < frozen // 10
    finally:
        worker.connector.shutdown()
    assert gc.get_freeze_count() == 0


def test_a_heap_frozen_already_is_left_as_it_is(models_dir, tmp_path):
    frozen = gc.get_freeze_count()
    assert frozen, "the session's heap is frozen (conftest.py)"
    made = [[i] for i in range(10_000)]  # objects made since the freeze: a second freeze would take them
    worker = _worker(models_dir, tmp_path)
    try:
        # Nothing more frozen (frozen objects may die meanwhile: the count only falls)...
        assert gc.get_freeze_count() <= frozen
        assert any(made[-1] is o for o in gc.get_objects())
    finally:
        worker.connector.shutdown()
    # ... and nothing thawed: shutdown undoes only a freeze of its own.
    assert frozen - 1000 < gc.get_freeze_count() <= frozen
