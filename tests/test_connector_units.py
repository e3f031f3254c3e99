"""OffloadConnector under vLLM's real Scheduler, both roles in one process.

vLLM's Scheduler builds the scheduler-role connector itself and calls it as
in an engine (lookup, `update_state_after_alloc`, `build_connector_meta`,
`update_connector_output`, `request_finished_all_groups`); a worker-role
OffloadConnector registered against real CPU KV cache tensors (vLLM-CPU's
attention layout) is driven as vLLM's model runner drives it
(tests/vllm_unit_utils.py). No model weights, no engine process: a step is a
few milliseconds, so the cases can pin down exact bytes, token counts and
counters.

Most cases use an attention-only KV cache (tools/tiny_models.py's llama-tiny,
16-token blocks, so 256-token chunks); the first also runs on a hybrid one
(the tiny Qwen3-Next: a Mamba group in vLLM's "align" mode beside an
attention group, 128-token blocks and chunks), where a hit must restore the
attention pages and the Mamba state at the hit boundary.
"""

from __future__ import annotations

import errno
import json
import os
import random
import threading
import time
from pathlib import Path

import pytest
import torch
from vllm.v1.request import RequestStatus

import offload.store
from offload.store.cachedir.paths import LAYOUT_DIR
from offload.store.cpu import CpuIndex
from vllm_unit_utils import (
    Engine,
    WorkerStep,
    assert_scheduler_empty,
    attention_kv_cache_config,
    create_request,
    create_scheduler,
    create_vllm_config,
    hybrid_kv_cache_config,
    run_and_snapshot,
    set_connector,
    tiny_hybrid_engine,
)

LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]  # llama-tiny
BS = 16
CHUNK = 256  # attention-only default: the smallest multiple of the block size >= 256
PROMPT = 600  # two whole chunks and a tail of whole blocks behind them (hit(): what the planner restores)
CHUNK_BYTES = 2 * (CHUNK // BS) * 2 * BS * 2 * 32 * 2  # layers x blocks x (K+V, 16 tokens, 2 heads, 32 dims, bf16)
BLOCK_BYTES = CHUNK_BYTES // (CHUNK // BS)
WAITING_FOR_KV = RequestStatus.WAITING_FOR_REMOTE_KVS


@pytest.fixture(scope="module")
def vllm_config(models_dir):
    return create_vllm_config(str(models_dir / "llama-tiny"), block_size=BS, max_num_batched_tokens=256)


@pytest.fixture
def make(vllm_config, tmp_path, monkeypatch):
    workers: list[WorkerStep] = []

    def _make(store: str = "cpu", num_blocks: int = 128, **options) -> Engine:
        cpu = {"store": "cpu", "cpu_bytes": 4 << 20}  # 32 chunks: no eviction here
        fs = {"store": "fs", "path": str(tmp_path / "cache")}
        toy = fs | {"store": "toy"}  # tests/toy_tier.py
        if store == "toy":  # a new tier's one registration line (docs/tiers.md), for this test only
            monkeypatch.setitem(offload.store.TIERS, "toy", "toy_tier:ToyOptions")
        extra = {"cpu": cpu, "fs": fs, "toy": toy, "stack": {"tiers": [cpu, fs]}}[store] | options
        set_connector(vllm_config, extra)
        kcc = attention_kv_cache_config(LAYERS, block_size=BS, num_kv_heads=2, head_size=32, num_blocks=num_blocks)
        scheduler = create_scheduler(vllm_config, kcc)
        workers.append(WorkerStep(vllm_config, kcc, scheduler))
        return Engine(scheduler, workers[-1])

    yield _make
    for w in workers:
        w.connector.shutdown()


def hit(eng: Engine, n: int = PROMPT) -> int:
    """Tokens a repeat of a stored n-token prompt restores, as the connector's
    planner states it: its whole chunks, or the tail of whole blocks behind
    them up to vLLM's own last hittable block (attention only: 592 of 600)."""
    return eng.scheduler.connector.planner.repeat_hit(n)


def entries(eng: Engine, n: int = PROMPT) -> int:
    """Entries (one group here: files) an n-token prompt stores: its whole chunks, then its tail
    behind them as a chain of one-block entries (attention only)."""
    p = eng.scheduler.connector.planner
    t = p.tail_boundary(n)
    return p.max_hit_chunks(n) + (len(p.tail_entries(t // p.chunk_size, t // p.chunk_size * p.chunk_size, t))
                                  if t else 0)


def prompt(seed: int, n: int = PROMPT) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, 1000) for _ in range(n)]


def pinned(eng: Engine) -> int:
    """Entries pinned by loads, counted twice: by the scheduler half and
    inside the host-memory tier itself (offload/store/cpu.py), which must agree."""
    sched = eng.scheduler.connector._sched
    host = [ix for ix in sched.indices if isinstance(ix, CpuIndex)]
    if host and all(isinstance(ix, CpuIndex) for ix in sched.indices):  # every pin is a host-memory one
        in_arena = sum(e.pins for ix in host for e in ix.entries.values())
        assert in_arena == sched.pinned_entries, (in_arena, sched.pinned_entries)
    return sched.pinned_entries


def wait_for_files(path: Path, n: int, timeout: float = 30.0) -> None:
    """The file tier writes on its I/O threads: wait until `n` chunk files are visible."""
    deadline = time.monotonic() + timeout
    while len(list(path.glob(f"{LAYOUT_DIR}/*/g*/*/*.kv"))) < n:
        assert time.monotonic() < deadline, f"fewer than {n} chunk files under {path} after {timeout}s"
        time.sleep(0.01)


def wait_for_stored_tokens(eng: Engine, n: int, timeout: float = 30.0) -> None:
    """The file tier counts a store when its I/O thread has written it; the
    count reaches the scheduler with a later step's worker stats."""
    deadline = time.monotonic() + timeout
    while eng.totals().get("stored_tokens", 0) < n:
        assert time.monotonic() < deadline, f"stored tokens {eng.totals()} < {n} after {timeout}s"
        time.sleep(0.01)
        eng.step()


def assert_same_bytes(actual: list[bytes], expected: list[bytes], what: str) -> None:
    """Per layer; on a difference, say where instead of printing megabytes."""
    assert len(actual) == len(expected)
    for layer, (a, e) in enumerate(zip(actual, expected)):
        if a != e:
            diff = sum(x != y for x, y in zip(a, e))
            first = next(i for i, (x, y) in enumerate(zip(a, e)) if x != y)
            raise AssertionError(f"{what}: layer {layer} differs in {diff} of {len(e)} bytes (first at byte "
                                 f"{first}: {a[first]:#04x}, stored {e[first]:#04x}; 0x5a is the scrambled value)")


def table(eng: Engine, req_id: str) -> list[int]:
    return eng.scheduler.kv_cache_manager.get_block_ids(req_id)[0]


def table_all(eng: Engine, req_id: str) -> tuple[list[int], ...]:
    return eng.scheduler.kv_cache_manager.get_block_ids(req_id)


def store_prompt(eng: Engine, req_id: str, tokens: list[int], tmp_path: Path) -> list[bytes]:
    """Run a request to completion; return the bytes of the blocks of the
    tokens a repeat restores. vLLM's own prefix cache is then reset (so a
    repeat can only hit our tier) and the KV cache scrambled (so only a load
    can restore it)."""
    snapshot = run_and_snapshot(eng, req_id, tokens, block_size=BS)
    if eng.scheduler.connector.cfg.tiers[0].holds_files:
        wait_for_files(tmp_path / "cache", entries(eng, len(tokens)))
    assert eng.scheduler.reset_prefix_cache()
    eng.worker.scramble()
    return snapshot


def tier_params(eng: Engine, req_id: str) -> dict:
    """The connector's per-request result in the request's final output (kv_transfer_params)."""
    params = eng.finished[req_id]
    assert params is not None, f"{req_id}: no kv_transfer_params in its final output"
    [(key, value)] = params.items()
    assert key == f"kvoffload:{eng.scheduler.connector.cfg.tiers[0].tier_name}"
    return value


# ---- a store, then a lookup hit and a load that restores the exact bytes ----------------------


def test_short_prompts_sharing_a_prefix_shorter_than_a_chunk_restore_what_vllms_cache_hits(make, tmp_path):
    """16-token blocks (CUDA's default), the shipped stack (host memory, then
    files): four 150-token prompts sharing 96 tokens are served, vLLM's
    prefix cache is reset, and three more with the same 96 tokens arrive.
    vLLM's own cache would hit 96 for each: so must we."""
    eng = make("stack")
    shared = prompt(40, 96)
    for i in range(4):  # served together
        eng.scheduler.add_request(create_request(f"a{i}", shared + prompt(50 + i, 54), max_tokens=2, block_size=BS))
    eng.run_to_completion()
    wait_for_stored_tokens(eng, 1)
    assert eng.scheduler.reset_prefix_cache()
    eng.worker.scramble()
    for i in range(3):  # they arrive together: none of them finds the others' blocks in vLLM's cache
        eng.scheduler.add_request(create_request(f"b{i}", shared + prompt(60 + i, 54), max_tokens=2, block_size=BS))
    eng.run_to_completion()
    for i in range(3):
        restored = {k: v["restored_tokens"] for k, v in eng.finished[f"b{i}"].items()}  # one key per tier
        assert sum(restored.values()) == 96, (i, restored)
    assert pinned(eng) == 0




@pytest.mark.parametrize("store", ["cpu", "fs", "toy"])
def test_store_then_hit_restores_the_exact_bytes(make, tmp_path, store):
    eng = make(store)
    HIT = hit(eng)
    assert HIT > PROMPT // CHUNK * CHUNK  # the tail of whole blocks behind the last whole chunk
    tokens = prompt(1)
    stored = store_prompt(eng, "a", tokens, tmp_path)

    b = create_request("b", tokens, max_tokens=3, block_size=BS)
    eng.scheduler.add_request(b)
    eng.step()  # lookup, allocation, load planned and started
    assert eng.status("b") == WAITING_FOR_KV
    dest = table(eng, "b")[:HIT // BS]
    eng.run_until(lambda: eng.status("b") != WAITING_FOR_KV and b.num_computed_tokens > HIT)
    assert_same_bytes(eng.worker.blocks_bytes(dest), stored, "restored blocks")
    eng.run_to_completion()
    wait_for_stored_tokens(eng, HIT)

    assert eng.scheduled["b"] == PROMPT - HIT + 2  # the tail and two decode steps; the hit was not recomputed
    assert tier_params(eng, "b") == {"restored_tokens": HIT, "load_failed": False}
    t = eng.totals()
    assert t.get("stored_tokens") == HIT  # the two whole chunks and the tail's whole blocks, not the rest
    assert t.get("lookups") == 2 and t.get("lookup_hit_tokens") == HIT
    assert t.get("restored_tokens") == HIT and t.get("restored_bytes") == HIT // BS * BLOCK_BYTES
    assert "failed_loads" not in t
    if store == "cpu":
        assert pinned(eng) == 0
    assert_scheduler_empty(eng.scheduler)


def test_chunk_aligned_prompt_hits_whole_and_vllm_computes_its_last_token_again(make, tmp_path):
    """Attention only: a 512-token prompt (two whole chunks) is restored
    whole. vLLM's scheduler steps back one token after a load that covers
    the prompt and computes it again over the restored KV, which rewrites
    that slot with the same values; nothing else is recomputed."""
    eng = make("cpu")
    HIT = 2 * CHUNK
    assert hit(eng, HIT) == HIT and entries(eng, HIT) == 2  # whole chunks reach past any tail: no tail file
    tokens = prompt(7, HIT)
    stored = store_prompt(eng, "a", tokens, tmp_path)
    b = create_request("b", tokens, max_tokens=3, block_size=BS)
    eng.scheduler.add_request(b)
    eng.step()
    assert eng.status("b") == WAITING_FOR_KV
    dest = table(eng, "b")[:HIT // BS]
    eng.run_to_completion()
    assert eng.scheduled["b"] == 1 + 2  # the last prompt token again, then two decode steps
    # Every slot but the last token's is the load's; the harness writes a
    # recomputed slot with a value that depends on the step split (a model
    # would rewrite it with the same KV up to rounding).
    got = eng.worker.blocks_bytes(dest)
    last = [bytearray(x) for x in stored]
    for layer, g in enumerate(got):  # the last token's bytes in the last block (where vLLM-CPU's kernel puts them)
        block = len(g) // len(dest)
        mine = eng.worker.token_bytes(LAYERS[layer], BS - 1).nonzero().flatten().tolist()
        at = [(len(dest) - 1) * block + i for i in mine]
        assert any(g[i] != 0x5A for i in at), "the last token was computed again"
        for i in at:
            last[layer][i] = g[i]
    assert_same_bytes(got, [bytes(x) for x in last], "restored blocks")
    assert tier_params(eng, "b") == {"restored_tokens": HIT, "load_failed": False}
    t = eng.totals()
    assert t.get("stored_tokens") == HIT and t.get("lookup_hit_tokens") == HIT  # the replay stores nothing again
    assert pinned(eng) == 0
    assert_scheduler_empty(eng.scheduler)


def run(eng: Engine, req_id: str, tokens: list[int]) -> None:
    eng.scheduler.add_request(create_request(req_id, tokens, max_tokens=2, block_size=BS))
    eng.run_to_completion()


def test_attention_only_tails_a_short_prompt_a_next_turn_and_a_tail_vllm_cached(make, tmp_path):
    """Attention only, vLLM's own cache hits at every block, ours behind the
    last whole chunk too, as a chain of one-block tail entries:
    - a prompt shorter than a chunk restores its last whole block before its
      last token (nothing without tails);
    - the next turn of a stored prompt restores the earlier prompt's tail
      (probed inside the chunk where the stored chunks end) and stores only
      the entries past it: at most a chunk's blocks of tail entries per prompt;
    - a prompt whose tail vLLM's own cache already held (a longer prompt
      computed it inside a whole chunk) stores that tail anyway: the whole
      blocks are computed KV, so after a reset a repeat restores it with the
      exact bytes."""
    eng = make("fs")
    planner = eng.scheduler.connector.planner
    files = lambda: sorted(tmp_path.glob(f"cache/{LAYOUT_DIR}/*/g*/*/*.kv"))
    short = prompt(21, CHUNK - 50)
    assert hit(eng, len(short)) == (len(short) - 1) // BS * BS > 0 and planner.max_hit_chunks(len(short)) == 0
    store_prompt(eng, "s", short, tmp_path)
    assert len(files()) == entries(eng, len(short)) == hit(eng, len(short)) // BS  # one file per block
    run(eng, "s2", short)
    assert tier_params(eng, "s2") == {"restored_tokens": hit(eng, len(short)), "load_failed": False}
    assert eng.scheduled["s2"] == len(short) - hit(eng, len(short)) + 1  # the rest of the prompt, one decode step

    # The next turn: the earlier prompt's tail restored, then the rest of its own tail stored.
    a = prompt(22)
    store_prompt(eng, "a", a, tmp_path)
    wait_for_files(tmp_path / "cache", entries(eng, len(short)) + entries(eng))  # the short prompt's and a's
    turn = a + prompt(23, 150)
    run(eng, "t", turn)
    assert tier_params(eng, "t") == {"restored_tokens": hit(eng), "load_failed": False}
    # turn's entries are a's (its chunks and tail entries, restored) and the tail entries past them.
    wait_for_files(tmp_path / "cache", entries(eng, len(short)) + entries(eng, len(turn)))
    assert len(files()) == entries(eng, len(short)) + entries(eng, len(turn))
    assert entries(eng, len(turn)) - entries(eng) == (hit(eng, len(turn)) - hit(eng)) // BS < CHUNK // BS

    # vLLM's own cache holds b's tail (long computed it, inside its whole chunk 2): b stores it from there.
    assert eng.scheduler.reset_prefix_cache()
    before = len(files())
    long = prompt(24, 3 * CHUNK + 20)
    b = [*long[:PROMPT], 1]  # vLLM's own hit stops at b's tail, the last block before its last token
    assert planner.tail_boundary(len(b)) and planner.tail_boundary(len(b)) < PROMPT
    b_tail = entries(eng, len(b)) - planner.max_hit_chunks(len(b))  # its tail entries: in no entry of long's
    req_long = create_request("long", long, max_tokens=2, block_size=BS)
    eng.scheduler.add_request(req_long)
    snapshot = None
    while "long" in eng.scheduler.requests:
        eng.step()
        if snapshot is None and req_long.num_computed_tokens >= hit(eng, len(b)):
            snapshot = eng.worker.blocks_bytes(table(eng, "long")[:hit(eng, len(b)) // BS])
    run(eng, "b", b)
    assert eng.scheduled["b"] == len(b) - planner.tail_boundary(len(b)) + 1, "vLLM's own cache did not hold b's tail"
    assert tier_params(eng, "b") == {"restored_tokens": 0, "load_failed": False}
    wait_for_files(tmp_path / "cache", before + entries(eng, len(long)) + b_tail)  # long's entries, then b's tail
    assert len(files()) == before + entries(eng, len(long)) + b_tail
    assert eng.scheduler.reset_prefix_cache()
    eng.worker.scramble()
    c = create_request("c", b, max_tokens=2, block_size=BS)
    eng.scheduler.add_request(c)
    eng.step()
    assert eng.status("c") == WAITING_FOR_KV
    dest = table(eng, "c")[:hit(eng, len(b)) // BS]
    eng.run_until(lambda: eng.status("c") != WAITING_FOR_KV)
    assert_same_bytes(eng.worker.blocks_bytes(dest), snapshot, "b's chunks and tail, stored from vLLM's own cache")
    eng.run_to_completion()
    assert tier_params(eng, "c") == {"restored_tokens": hit(eng, len(b)), "load_failed": False}
    assert pinned(eng) == 0
    assert_scheduler_empty(eng.scheduler)


def test_attention_only_shared_prefix_restores_every_block_vllms_own_cache_hits(make, tmp_path):
    """A (600 tokens) and a short prompt S (200) stored: A's two chunks and
    its tail [512, 592) as one-block entries, S's twelve. Prompts that share
    only a prefix of them, ending inside that tail (560, 520, and 550 being
    their whole length) or inside S, restore up to the last block boundary of
    the shared prefix, capped by their own last block before their last token:
    exactly what vLLM's own prefix cache hits on A (or S) then them in one
    process, measured first on an engine of its own. The restored blocks hold
    A's (S's) bytes."""
    a, short = prompt(31), prompt(32, 200)
    rng = random.Random(33)
    cases = [(a, 560, 700), (a, 520, 700), (a, 550, 550), (short, 150, 300)]
    bs = [base[:shared] + [rng.randrange(1000, 2000) for _ in range(n - shared)] for base, shared, n in cases]

    own = make("cpu")  # vLLM's own cache: the bases, then each b with nothing reset
    for i, base in enumerate((a, short)):
        run(own, f"base{i}", base)
    vllm_hits = []
    for i, b in enumerate(bs):
        run(own, f"b{i}", b)
        assert tier_params(own, f"b{i}")["restored_tokens"] == 0
        vllm_hits.append(len(b) + 1 - own.scheduled[f"b{i}"])  # prompt - cached + one decode step
    assert vllm_hits[0] > PROMPT // CHUNK * CHUNK and vllm_hits[3] > 0, vllm_hits  # inside the tail region

    eng = make("fs")
    stored = [store_prompt(eng, name, base, tmp_path) for name, base in (("a", a), ("s", short))]
    assert entries(eng) == 2 + (hit(eng) - 2 * CHUNK) // BS  # two chunks, one entry per tail block
    wait_for_files(tmp_path / "cache", entries(eng) + entries(eng, len(short)))
    per_block = BLOCK_BYTES // len(LAYERS)
    for i, ((base, shared, n), b) in enumerate(zip(cases, bs)):
        rid = f"r{i}"
        assert eng.scheduler.reset_prefix_cache()  # only our tier can hit
        eng.worker.scramble()
        eng.scheduler.add_request(create_request(rid, b, max_tokens=2, block_size=BS))
        eng.step()
        assert eng.status(rid) == WAITING_FOR_KV, (shared, n)
        dest = table(eng, rid)[:vllm_hits[i] // BS]
        eng.run_until(lambda rid=rid: eng.status(rid) != WAITING_FOR_KV)
        assert_same_bytes(eng.worker.blocks_bytes(dest), [x[:len(dest) * per_block] for x in stored[base is short]],
                          f"the first {vllm_hits[i]} tokens of a prompt sharing {shared} tokens")
        eng.run_to_completion()
        assert tier_params(eng, rid) == {"restored_tokens": vllm_hits[i], "load_failed": False}, (shared, n)
        assert eng.scheduled[rid] == len(b) - vllm_hits[i] + 1
    assert pinned(eng) == 0
    assert_scheduler_empty(eng.scheduler)


# ---- the same on a hybrid KV cache: attention pages and the Mamba state at the boundary ------------


@pytest.fixture(scope="module")
def hybrid_config(models_dir):
    return create_vllm_config(str(models_dir / "qwen3-next-tiny"), block_size=128, max_num_batched_tokens=128,
                              prefix_cache_retention_interval=128)  # what `kvoffload plan` prints for it


def hybrid_engine(cfg, extra: dict) -> Engine:
    """vLLM's Scheduler and both connector halves over the tiny hybrid's KV cache (GDN state, attention)."""
    set_connector(cfg, extra)
    kcc = hybrid_kv_cache_config(["model.layers.0.linear_attn", "model.layers.2.linear_attn"],
                                 ["model.layers.1.self_attn.attn", "model.layers.3.self_attn.attn"],
                                 block_size=128, mamba_shapes=((3, 192), (1, 64, 64)),
                                 mamba_dtypes=(torch.bfloat16, torch.float32), num_kv_heads=4, head_size=64,
                                 num_blocks=64, mamba_cache_mode=cfg.cache_config.mamba_cache_mode)
    scheduler = create_scheduler(cfg, kcc)
    return Engine(scheduler, WorkerStep(cfg, kcc, scheduler))


def test_hybrid_store_then_hit_restores_attention_pages_and_mamba_state(hybrid_config, tmp_path):
    h_bs = 128  # block size and chunk of both groups
    eng = hybrid_engine(hybrid_config, {"store": "cpu", "cpu_bytes": 1 << 24})
    scheduler = eng.scheduler
    try:
        tokens = prompt(6)
        n_hit = (PROMPT - 1) // h_bs * h_bs  # 512: four chunks
        a = create_request("a", tokens, max_tokens=2, block_size=h_bs)
        scheduler.add_request(a)
        attn = state = None
        while "a" in scheduler.requests:
            eng.step()
            if a.num_computed_tokens == n_hit:  # steps end on chunk boundaries: the state at 512 is fresh
                mamba_table, attn_table = table_all(eng, "a")
                state = eng.worker.blocks_bytes([mamba_table[n_hit // h_bs - 1]], group=0)
                attn = eng.worker.blocks_bytes(attn_table[:n_hit // h_bs], group=1)
        assert attn is not None and state is not None
        assert eng.totals().get("stored_tokens") == 2 * n_hit  # each chunk: its attention pages and its state
        assert scheduler.reset_prefix_cache()
        eng.worker.scramble()

        b = create_request("b", tokens, max_tokens=2, block_size=h_bs)
        scheduler.add_request(b)
        eng.step()
        assert eng.status("b") == WAITING_FOR_KV
        mamba_table, attn_table = table_all(eng, "b")
        eng.run_until(lambda: eng.status("b") != WAITING_FOR_KV)
        boundary = n_hit // h_bs
        assert_same_bytes(eng.worker.blocks_bytes(attn_table[:boundary], group=1), attn, "restored attention pages")
        assert_same_bytes(eng.worker.blocks_bytes([mamba_table[boundary - 1]], group=0), state, "restored Mamba state")
        assert all(blk == 0 for blk in mamba_table[:n_hit // h_bs - 1])  # no state but the boundary's is loaded
        eng.run_to_completion()
        assert eng.scheduled["b"] == PROMPT - n_hit + 1
        assert tier_params(eng, "b") == {"restored_tokens": n_hit, "load_failed": False}
        assert pinned(eng) == 0
        assert_scheduler_empty(scheduler)
    finally:
        eng.worker.connector.shutdown()


@pytest.mark.parametrize("policy", ["by_use", "all", "tails"])
def test_states_are_stored_by_class_under_the_state_policy(hybrid_config, tmp_path, policy):
    """A prompt's states at internal chunk boundaries, its tail, and the
    branch point where another prompt's lookup found the stored prefix
    ending: `by_use` stores internal states cold, `all` hot, `tails` not at
    all; tails and branch points are always stored hot."""
    h_bs = 128
    eng = hybrid_engine(hybrid_config, {"store": "cpu", "cpu_bytes": 1 << 24, "state_policy": policy})
    scheduler = eng.scheduler
    idx = scheduler.connector._sched.indices[0]

    def states() -> dict[tuple[str, bool], int]:
        out: dict[tuple[str, bool], int] = {}
        for e in idx.entries.values():
            if e.state is not None:
                out[e.state.value, e.cold] = out.get((e.state.value, e.cold), 0) + 1
        return out

    try:
        a_tokens = prompt(6)  # 600 tokens: boundaries 128, 256, 384 internal, 512 its tail
        scheduler.add_request(create_request("a", a_tokens, max_tokens=2, block_size=h_bs))
        eng.run_to_completion()
        internal = {"by_use": {("internal", True): 3}, "all": {("internal", False): 3}, "tails": {}}[policy]
        assert states() == {("tail", False): 1, **internal}
        assert idx.usage().skipped == (3 if policy == "tails" else 0)
        assert scheduler.reset_prefix_cache()
        # b shares a's first 300 tokens: its lookup finds a's attention chunks up to 256.
        b_tokens = a_tokens[:300] + prompt(7)[300:]
        scheduler.add_request(create_request("b", b_tokens, max_tokens=2, block_size=h_bs))
        eng.run_to_completion()
        restored = tier_params(eng, "b")["restored_tokens"]
        if policy == "tails":  # a stored no state at 256: b computed it, and stored it as its branch point
            assert restored == 0
            assert states() == {("tail", False): 2, ("branch", False): 1}
        else:  # b restored 256 from a's internal state there (a read: hot from now on), and stored 384 and 512
            assert restored == 256
            after = {"by_use": {("internal", True): 3, ("internal", False): 1}, "all": {("internal", False): 4}}
            assert states() == {("tail", False): 2, **after[policy]}
            assert dict(idx.usage().state_hits) == {"internal": 1}
        assert pinned(eng) == 0
    finally:
        eng.worker.connector.shutdown()


# ---- allocation mismatch -------------------------------------------------------------------------


def test_allocation_mismatch_fails_the_load_and_the_request_recomputes(make, tmp_path, monkeypatch):
    """The Scheduler allocates one block less than the connector offered: the
    connector must not guess which bytes go where. The load is reported
    failed, vLLM's recompute policy resets the request, its retry is not
    offered the same hit, and nothing stays pinned. (vLLM 0.32's Scheduler
    itself only trims a hit to a block boundary, which chunk-aligned hits
    already are, or drops it to 0; a wrapper between it and the connector,
    such as a MultiConnector, can pass another count. The wrapper here is
    that wrapper.)"""
    eng = make("cpu")
    HIT = hit(eng)
    tokens = prompt(2)
    store_prompt(eng, "a", tokens, tmp_path)
    conn = eng.scheduler.connector
    real = conn.get_num_new_matched_tokens
    offered: list[int] = []

    def trimmed(request, num_computed_tokens):
        n, is_async = real(request, num_computed_tokens)
        if request.request_id == "b":
            offered.append(n)
            return (n - BS if n else n), is_async
        return n, is_async

    monkeypatch.setattr(conn, "get_num_new_matched_tokens", trimmed)
    b = create_request("b", tokens, max_tokens=2, block_size=BS)
    eng.scheduler.add_request(b)
    eng.step()
    assert eng.status("b") == WAITING_FOR_KV
    assert pinned(eng) == 0  # refused before pinning anything
    eng.run_to_completion()

    assert offered == [HIT, 0], offered  # the retry after the failure is a miss
    assert eng.scheduled["b"] == PROMPT + 1  # recomputed from token 0
    assert tier_params(eng, "b") == {"restored_tokens": 0, "load_failed": True}
    t = eng.totals()
    assert t.get("failed_loads") == 1 and "restored_tokens" not in t and "restored_bytes" not in t
    assert pinned(eng) == 0
    assert_scheduler_empty(eng.scheduler)


# ---- preemption ------------------------------------------------------------------------------------


def test_preemption_with_a_store_pending(make, tmp_path):
    """A request is preempted in the step after its first chunk was staged
    for the file tier (the write still on the I/O threads), its blocks are
    reused (scrambled), and it resumes: the pending store still writes the
    bytes the request had computed, the resumed request restores them from
    the tier, and its second chunk is stored once."""
    eng = make("fs")
    tokens = prompt(3)
    a = create_request("a", tokens, max_tokens=2, block_size=BS)
    eng.scheduler.add_request(a)
    eng.step()
    assert a.num_computed_tokens == CHUNK and a.status == RequestStatus.RUNNING
    chunk0 = eng.worker.blocks_bytes(table(eng, "a")[:CHUNK // BS])
    # vLLM's own way to preempt every running request (and drop its prefix cache).
    assert eng.scheduler.reset_prefix_cache(reset_running_requests=True)
    assert a.status == RequestStatus.PREEMPTED and a.num_computed_tokens == 0
    eng.worker.scramble()
    wait_for_files(tmp_path / "cache", 1)

    eng.step()  # the resumed request looks up again: chunk 0 is in the tier
    assert eng.status("a") == WAITING_FOR_KV
    dest = table(eng, "a")[:CHUNK // BS]
    eng.run_until(lambda: eng.status("a") != WAITING_FOR_KV)
    assert_same_bytes(eng.worker.blocks_bytes(dest), chunk0, "restored blocks")
    eng.run_to_completion()
    HIT = hit(eng)  # what the whole prompt stores: its whole chunks and its tail
    wait_for_stored_tokens(eng, HIT)

    assert tier_params(eng, "a") == {"restored_tokens": CHUNK, "load_failed": False}
    t = eng.totals()
    assert t.get("stored_tokens") == HIT and "stores_deduplicated" not in t  # each entry stored once
    assert t.get("restored_tokens") == CHUNK and "failed_loads" not in t
    assert_scheduler_empty(eng.scheduler)


def test_preemption_after_a_load_loads_again(make, tmp_path):
    """A request whose hit was loaded is preempted while running, and looks
    up and loads again on resume: both loads restore the exact bytes, both
    count (docs/metrics.md), and their pins are all released."""
    eng = make("cpu")
    HIT = hit(eng)
    tokens = prompt(4)
    stored = store_prompt(eng, "a", tokens, tmp_path)
    b = create_request("b", tokens, max_tokens=3, block_size=BS)
    eng.scheduler.add_request(b)
    eng.run_until(lambda: eng.status("b") == RequestStatus.RUNNING)
    assert_same_bytes(eng.worker.blocks_bytes(table(eng, "b")[:HIT // BS]), stored, "restored blocks")
    assert eng.scheduler.reset_prefix_cache(reset_running_requests=True)
    assert b.status == RequestStatus.PREEMPTED
    eng.worker.scramble()
    assert pinned(eng) == 0

    eng.step()
    assert eng.status("b") == WAITING_FOR_KV
    dest = table(eng, "b")[:HIT // BS]
    eng.run_until(lambda: eng.status("b") != WAITING_FOR_KV)
    assert_same_bytes(eng.worker.blocks_bytes(dest), stored, "restored blocks")
    eng.run_to_completion()

    assert tier_params(eng, "b") == {"restored_tokens": 2 * HIT, "load_failed": False}
    t = eng.totals()
    assert t.get("restored_tokens") == 2 * HIT and t.get("restored_bytes") == 2 * HIT // BS * BLOCK_BYTES
    assert t.get("lookups") == 2  # one per request, not per admission
    assert pinned(eng) == 0
    assert_scheduler_empty(eng.scheduler)


# ---- abort while a load is in flight ----------------------------------------------------------------


@pytest.fixture
def held_loads(monkeypatch):
    """Hold every load at its scatter into the KV cache until released."""
    from offload.copier import GroupPages

    release, entered = threading.Event(), threading.Event()
    real = GroupPages.scatter

    def scatter(self, *args, **kwargs):
        entered.set()
        assert release.wait(30), "load held for 30 s"
        return real(self, *args, **kwargs)

    monkeypatch.setattr(GroupPages, "scatter", scatter)
    yield release, entered
    release.set()


def test_abort_while_a_load_is_in_flight(make, tmp_path, held_loads):
    """vLLM keeps an aborted request's blocks until its load reports
    finished; the connector releases its pins then, counts the moved bytes
    but no restored tokens, and the tier entries stay usable."""
    release, entered = held_loads
    eng = make("cpu")
    HIT = hit(eng)
    tokens = prompt(5)
    stored = store_prompt(eng, "a", tokens, tmp_path)
    b = create_request("b", tokens, max_tokens=2, block_size=BS)
    eng.scheduler.add_request(b)
    eng.step()
    assert entered.wait(10) and eng.status("b") == WAITING_FOR_KV
    assert pinned(eng) == entries(eng)

    eng.scheduler.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    assert "b" in eng.scheduler.requests  # blocks held: the load still writes into them
    eng.step()
    assert "b" in eng.scheduler.requests and pinned(eng) == entries(eng)
    release.set()
    eng.run_until(lambda: "b" not in eng.scheduler.requests)

    assert pinned(eng) == 0
    assert_scheduler_empty(eng.scheduler)
    t = eng.totals()
    assert "restored_tokens" not in t and "failed_loads" not in t
    assert t.get("restored_bytes") == HIT // BS * BLOCK_BYTES  # every completed load, aborted or not

    # The entries are neither leaked nor lost: the next request restores them.
    eng.worker.scramble()
    c = create_request("c", tokens, max_tokens=2, block_size=BS)
    eng.scheduler.add_request(c)
    eng.step()
    dest = table(eng, "c")[:HIT // BS]
    eng.run_until(lambda: eng.status("c") != WAITING_FOR_KV)
    assert_same_bytes(eng.worker.blocks_bytes(dest), stored, "restored blocks")
    eng.run_to_completion()
    assert tier_params(eng, "c") == {"restored_tokens": HIT, "load_failed": False}
    assert pinned(eng) == 0
    assert_scheduler_empty(eng.scheduler)


# ---- vLLM's own prefix cache covers part of the hit ---------------------------------------------------


def test_local_prefix_hit_then_tier_hit_loads_only_the_rest(make, tmp_path):
    """vLLM evicts a finished request's blocks tail first, so a repeat finds
    the first chunk in its own prefix cache and asks the connector from
    there: the connector offers, pins and loads only the second chunk."""
    eng = make("cpu", num_blocks=128)
    HIT = hit(eng)
    tokens = prompt(7)
    stored = store_prompt(eng, "a", tokens, tmp_path)  # resets vLLM's prefix cache: run "a" again to refill it
    a2 = create_request("a2", tokens, max_tokens=2, block_size=BS)
    eng.scheduler.add_request(a2)
    eng.run_to_completion()
    # A request that needs every never-used block plus all of "a2"'s but its first chunk's 16.
    c = create_request("c", prompt(8, (127 - 16) * BS - 1), max_tokens=1, block_size=BS)
    eng.scheduler.add_request(c)
    eng.run_to_completion()
    eng.worker.scramble()  # so that chunk 1's blocks hold the stored bytes only if the connector loads them
    lookups: list[tuple[int, int]] = []
    conn = eng.scheduler.connector
    real = conn.get_num_new_matched_tokens

    def spy(request, num_computed_tokens):
        n, is_async = real(request, num_computed_tokens)
        if request.request_id == "b":
            lookups.append((num_computed_tokens, n))
        return n, is_async

    conn.get_num_new_matched_tokens = spy
    b = create_request("b", tokens, max_tokens=2, block_size=BS)
    eng.scheduler.add_request(b)
    eng.step()
    assert lookups == [(CHUNK, HIT - CHUNK)], lookups  # vLLM's hit: chunk 0; ours: chunk 1 and the tail
    assert eng.status("b") == WAITING_FOR_KV
    dest = table(eng, "b")[CHUNK // BS:HIT // BS]
    eng.run_until(lambda: eng.status("b") != WAITING_FOR_KV)
    assert_same_bytes(eng.worker.blocks_bytes(dest), [s[CHUNK // BS * BLOCK_BYTES // len(LAYERS):] for s in stored],
                      "restored chunk 1 and the tail")
    eng.run_to_completion()
    assert eng.scheduled["b"] == PROMPT - HIT + 1
    assert tier_params(eng, "b") == {"restored_tokens": HIT - CHUNK, "load_failed": False}
    assert pinned(eng) == 0
    assert_scheduler_empty(eng.scheduler)


def test_reset_prefix_cache_while_a_load_is_in_flight(make, tmp_path, held_loads):
    """What vLLM does when its prefix cache is reset during one of our loads
    (RLHF weight updates call it): a plain reset is refused (False) and the
    load completes normally; with reset_running_requests=True vLLM 0.32
    raises RuntimeError ("... waiting for remote KV transfer, which is not
    supported yet"), in the engine core. This pins vLLM's behaviour: it is
    a hazard for any connector that loads asynchronously, ours included."""
    release, entered = held_loads
    eng = make("cpu")
    HIT = hit(eng)
    tokens = prompt(9)
    stored = store_prompt(eng, "a", tokens, tmp_path)
    b = create_request("b", tokens, max_tokens=2, block_size=BS)
    eng.scheduler.add_request(b)
    eng.step()
    assert entered.wait(10) and eng.status("b") == WAITING_FOR_KV
    assert eng.scheduler.reset_prefix_cache() is False
    with pytest.raises(RuntimeError, match="waiting for remote KV transfer"):
        eng.scheduler.reset_prefix_cache(reset_running_requests=True)
    release.set()
    dest = table(eng, "b")[:HIT // BS]
    eng.run_until(lambda: eng.status("b") != WAITING_FOR_KV)
    assert_same_bytes(eng.worker.blocks_bytes(dest), stored, "restored blocks")
    eng.run_to_completion()
    assert tier_params(eng, "b") == {"restored_tokens": HIT, "load_failed": False}
    assert pinned(eng) == 0
    assert_scheduler_empty(eng.scheduler)


# ---- a load planned while the entry's write is still queued -------------------------------------------


def test_load_of_an_entry_still_queued_for_its_tier_reads_the_queued_bytes(make, tmp_path, monkeypatch):
    """A ledger tier (LMCache with the worker in its own process) reports an
    entry once the scheduler planned its store, so a lookup can plan a load
    while the write still waits on a starved I/O thread (measured in CI:
    LMCache promotions, SCHED_IDLE store threads, a busy machine). The load
    must read the queued bytes rather than miss. Here the file tier's writes
    are held and its index answers from the scheduler's reservations, as a
    ledger does."""
    from offload.store.fs import FsData, FsIndex

    eng = make("fs")
    HIT = hit(eng)
    reserved: set[tuple[int, bytes]] = set()
    real_reserve = FsIndex.reserve

    def reserve(self, group, key, parent, *policy):
        reserved.add((group, bytes(key)))
        return real_reserve(self, group, key, parent, *policy)

    monkeypatch.setattr(FsIndex, "reserve", reserve)
    monkeypatch.setattr(FsIndex, "contains", lambda self, group, key: (group, bytes(key)) in reserved)
    release, real_put = threading.Event(), FsData.put

    def held_put(self, *args, **kwargs):
        assert release.wait(30), "write held for 30 s"
        return real_put(self, *args, **kwargs)

    monkeypatch.setattr(FsData, "put", held_put)
    tokens = prompt(9)
    a = create_request("a", tokens, max_tokens=2, block_size=BS)
    eng.scheduler.add_request(a)
    snapshot = None
    while "a" in eng.scheduler.requests:
        eng.step()
        if snapshot is None and a.num_computed_tokens >= HIT:
            snapshot = eng.worker.blocks_bytes(table(eng, "a")[:HIT // BS])
    assert snapshot is not None and len(reserved) == entries(eng)
    assert not list((tmp_path / "cache").glob(f"{LAYOUT_DIR}/*/g*/*/*.kv")), "a write landed while held"
    assert eng.scheduler.reset_prefix_cache()
    eng.worker.scramble()

    b = create_request("b", tokens, max_tokens=2, block_size=BS)
    eng.scheduler.add_request(b)
    eng.step()
    assert eng.status("b") == WAITING_FOR_KV
    dest = table(eng, "b")[:HIT // BS]
    eng.run_until(lambda: eng.status("b") != WAITING_FOR_KV and b.num_computed_tokens > HIT)
    assert_same_bytes(eng.worker.blocks_bytes(dest), snapshot, "restored from the queued write")
    assert not list((tmp_path / "cache").glob(f"{LAYOUT_DIR}/*/g*/*/*.kv")), "a write landed while held"
    release.set()
    eng.run_to_completion()
    assert tier_params(eng, "b") == {"restored_tokens": HIT, "load_failed": False}
    wait_for_files(tmp_path / "cache", entries(eng))  # the held writes still land
    assert_scheduler_empty(eng.scheduler)


# ---- a promotion in flight is not offered before its bytes land ------------------------------------


def restarted(make, tmp_path, seed: int, **options) -> tuple[Engine, int, list[int], bytes]:
    """A tier stack stores one prompt and shuts down; a new one opens the same directory (a restart,
    host memory empty). Returns it, the prompt's hit, its tokens and the bytes stored."""
    first = make("stack")
    tokens = prompt(seed)
    stored = store_prompt(first, "a", tokens, tmp_path)
    first.worker.connector.shutdown()
    return make("stack", **options), hit(first), tokens, stored


def ledger_loaded(eng: Engine) -> None:
    """Wait (up to 30 s) for the file tier's housekeeper to load the ledger index and gather warm
    start's candidates from it, in the background, as it does at start."""
    fs = eng.scheduler.connector._sched.indices[1]
    deadline = time.monotonic() + 30
    while fs.warm_candidates() is None and time.monotonic() < deadline:
        time.sleep(0.01)


def test_after_a_restart_warm_start_offers_host_memory_at_once_and_a_load_reads_what_it_needs_first(
        make, tmp_path, held_loads):
    """Warm start (on by default over files): a restart plans the files' entries into host memory at
    the first lookup, so that lookup is already a host-memory hit. Its load finds its entries not yet
    copied (or being copied), reads them itself or waits, and fills host memory from the same bytes;
    the same bytes reach the KV cache, and a second request after reset restores from host memory."""
    release, entered = held_loads
    eng, HIT, tokens, stored = restarted(make, tmp_path, 13)
    names = [t.tier_name for t in eng.scheduler.connector.cfg.tiers]
    sched = eng.scheduler.connector._sched
    ledger_loaded(eng)
    b = create_request("b", tokens, max_tokens=2, block_size=BS)
    eng.scheduler.add_request(b)
    eng.step()
    assert sched.hit_tier("b") == 0, "warm start's slots: host memory"
    dest = table(eng, "b")[:HIT // BS]
    release.set()
    eng.run_until(lambda: eng.status("b") != WAITING_FOR_KV)
    assert_same_bytes(eng.worker.blocks_bytes(dest), stored, "restored through warm start")
    eng.run_to_completion()
    assert eng.finished["b"] == {f"kvoffload:{names[0]}": {"restored_tokens": HIT, "load_failed": False},
                                 f"kvoffload:{names[1]}": {"restored_tokens": 0, "load_failed": False}}
    assert "failed_loads" not in eng.totals()
    warm = eng.worker.connector._worker.warm
    deadline = time.monotonic() + 30
    while not warm.done and time.monotonic() < deadline:
        time.sleep(0.01)
    assert warm.done and warm.planned == entries(eng), "every entry the files hold, copied"
    assert eng.scheduler.reset_prefix_cache()
    eng.worker.scramble()
    d = create_request("d", tokens, max_tokens=2, block_size=BS)
    eng.scheduler.add_request(d)
    eng.step()
    assert sched.hit_tier("d") == 0
    dest = table(eng, "d")[:HIT // BS]
    eng.run_until(lambda: eng.status("d") != WAITING_FOR_KV)
    assert_same_bytes(eng.worker.blocks_bytes(dest), stored, "restored from host memory")
    eng.run_to_completion()
    assert "failed_loads" not in eng.totals()


def test_a_corrupt_file_during_warm_start_is_counted_dropped_and_recomputed_never_served(make, tmp_path):
    """A file damaged on disk: warm start's read fails its CRC (quarantined, counted under
    `corrupt`), host memory drops the entry with every entry chained behind it, the request that
    was offered it recomputes (its load reads the file, which fails too), and the engine serves on."""
    from offload.store.format import HEADER_LEN, ChunkHeader

    first = make("stack")
    tokens = prompt(14)
    store_prompt(first, "a", tokens, tmp_path)
    first.worker.connector.shutdown()

    files = [f for f in tmp_path.glob(f"cache/{LAYOUT_DIR}/*/g*/*/*.kv")
             if ChunkHeader.unpack(f.read_bytes()[:HEADER_LEN]).token_start == 0]
    with open(files[0], "r+b") as f:  # the chain's first chunk: a payload byte flipped
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    eng = make("stack")
    sched = eng.scheduler.connector._sched
    warm = eng.worker.connector._worker.warm
    ledger_loaded(eng)
    eng.scheduler.add_request(create_request("b", tokens, max_tokens=2, block_size=BS))
    eng.run_to_completion()
    deadline = time.monotonic() + 30
    while not warm.done and time.monotonic() < deadline:
        time.sleep(0.01)
    eng.step()  # the worker's report reaches the scheduler
    rec = eng.worker.connector._worker.recorders[0]
    assert rec.by("kvoffload_warm_failures", "reason").get("corrupt", 0) == 1
    assert rec.total("kvoffload_warm_entries") == warm.planned - 1
    names = [t.tier_name for t in eng.scheduler.connector.cfg.tiers]
    assert eng.finished["b"][f"kvoffload:{names[0]}"]["load_failed"]
    cpu = sched.indices[0]
    assert not any(e.warm and not e.gone for e in cpu.entries.values()), "the chain behind the bad file is dropped"
    assert len(list(tmp_path.glob(f"cache/{LAYOUT_DIR}/*/quarantine/*"))) == 1, "the bad file is quarantined"
    # The engine serves on: the same prompt again is computed (nothing left to restore before the bad chunk).
    eng.scheduler.add_request(create_request("c", tokens, max_tokens=2, block_size=BS))
    eng.run_to_completion()
    assert eng.finished["c"][f"kvoffload:{names[0]}"] == {"restored_tokens": 0, "load_failed": False}


def test_an_entry_a_load_is_promoting_is_offered_only_once_its_bytes_landed(make, tmp_path, held_loads):
    """A load from the file tier also copies the entries up into host memory
    (a promotion), on the load's I/O thread. Until those bytes land, a second
    request's lookup must not be offered the host-memory entry: its load
    would find the slot empty (a counted miss and a recompute, measured
    under concurrent load). It reads the files instead; once the first load
    finished, a third request restores from host memory."""
    release, entered = held_loads
    # A restart on the same directory: host memory empty, the files there (warm start off: it would
    # offer host memory at once, the test above).
    eng, HIT, tokens, stored = restarted(make, tmp_path, 12, warm_start=False)
    names = [t.tier_name for t in eng.scheduler.connector.cfg.tiers]

    b = create_request("b", tokens, max_tokens=2, block_size=BS)
    eng.scheduler.add_request(b)
    eng.step()
    assert entered.wait(10) and eng.status("b") == WAITING_FOR_KV  # held before its scatter and promotion
    c = create_request("c", tokens, max_tokens=2, block_size=BS)
    eng.scheduler.add_request(c)
    eng.step()
    assert eng.status("c") == WAITING_FOR_KV
    assert eng.scheduler.connector._sched.hit_tier("c") == 1  # the files, not the empty slots
    release.set()
    eng.run_to_completion()
    for rid in ("b", "c"):
        assert eng.finished[rid] == {f"kvoffload:{names[0]}": {"restored_tokens": 0, "load_failed": False},
                                     f"kvoffload:{names[1]}": {"restored_tokens": HIT, "load_failed": False}}, rid
    assert "failed_loads" not in eng.totals()

    assert eng.scheduler.reset_prefix_cache()
    eng.worker.scramble()
    d = create_request("d", tokens, max_tokens=2, block_size=BS)
    eng.scheduler.add_request(d)
    eng.step()
    dest = table(eng, "d")[:HIT // BS]
    eng.run_until(lambda: eng.status("d") != WAITING_FOR_KV)
    assert_same_bytes(eng.worker.blocks_bytes(dest), stored, "restored from host memory")
    eng.run_to_completion()
    assert eng.finished["d"][f"kvoffload:{names[0]}"] == {"restored_tokens": HIT, "load_failed": False}
    assert pinned(eng) == 0
    assert_scheduler_empty(eng.scheduler)


# ---- stores dropped under backpressure stay prefix-closed ------------------------------------------


def test_a_store_dropped_for_backpressure_drops_the_entries_chained_behind_it(make, tmp_path, monkeypatch):
    """Past `max_pending_store_bytes` the writer drops a store. The entries
    chained behind it must not be written either: the lookup binary-searches
    the attention prefix as prefix-closed, so a file behind a hole would be
    offered as a hit whose load then misses (and fsck calls it a chain hole).
    Here the file tier's writes are held until the pending budget (8 chunks)
    is full and the 9th chunk is dropped; then they land, and the rest of the
    prompt's entries (3 whole chunks, then a tail) come while the queue is
    empty: a binary search over those 12 chunks never probes the 9th."""
    from offload.cli.cache import scan
    from offload.cli.chains import chunks
    from offload.store.fs import FsData

    eng = make("fs", num_blocks=256, max_pending_store_bytes=1 << 20)
    worker = eng.worker.connector._worker
    budget_chunks = (1 << 20) // CHUNK_BYTES
    n = (budget_chunks + 4) * CHUNK + 40  # whole chunks past the budget, then a tail
    planner = eng.scheduler.connector.planner
    assert planner.max_hit_chunks(n) == budget_chunks + 4 and planner.repeat_hit(n) > (budget_chunks + 4) * CHUNK
    release, real_put = threading.Event(), FsData.put

    def held_put(self, *args, **kwargs):
        assert release.wait(30), "write held for 30 s"
        return real_put(self, *args, **kwargs)

    monkeypatch.setattr(FsData, "put", held_put)
    tokens = prompt(11, n)
    eng.scheduler.add_request(create_request("a", tokens, max_tokens=2, block_size=BS))
    eng.run_until(lambda: worker.recorders[0].total("kvoffload_stores_dropped", reason="backpressure"))
    assert worker.recorders[0].by("kvoffload_stores_dropped", "reason") == {"backpressure": 1}
    release.set()
    wait_for_files(tmp_path / "cache", budget_chunks)
    eng.run_to_completion()
    eng.run_until(lambda: worker.stores.pending_bytes == 0)

    # Only the chain's stored prefix is on disk, and nothing behind the dropped chunk.
    drops = worker.recorders[0].by("kvoffload_stores_dropped", "reason")
    assert drops == {"backpressure": 1, "parent_dropped": entries(eng, n) - budget_chunks - 1}, drops
    files = list((tmp_path / "cache").glob(f"{LAYOUT_DIR}/*/g*/*/*.kv"))
    assert len(files) == budget_chunks, files
    dirs = scan(tmp_path / "cache").dirs
    problems = [(f.path, f.problem) for d in dirs for f in d.files if f.problem]
    problems += [(c.pos, c.orphan) for d in dirs for c in chunks(d).values() if c.orphan]
    assert not problems, problems

    # A repeat restores that prefix, and no load fails.
    assert eng.scheduler.reset_prefix_cache()
    eng.worker.scramble()
    eng.scheduler.add_request(create_request("b", tokens, max_tokens=2, block_size=BS))
    eng.run_to_completion()
    assert tier_params(eng, "b") == {"restored_tokens": budget_chunks * CHUNK, "load_failed": False}
    assert "failed_loads" not in eng.totals()
    assert_scheduler_empty(eng.scheduler)


def test_a_store_whose_parent_the_budget_evicted_while_it_waited_is_dropped_with_those_behind_it(
        make, tmp_path, monkeypatch):
    """Under load a store can wait in the queue while the byte budget evicts
    its parent (a leaf until the child lands). Written, the child would stand
    behind a hole: offered by the lookup's binary search, then a failed load.
    Here chunk 0 lands and is evicted while the rest of the prompt's writes
    wait; they are all dropped, and a repeat restores nothing and fails nothing.
    (A parent still queued is no hole: the other unit tests store chains whose
    entries are all queued at once.)"""
    from offload.cli.cache import scan
    from offload.cli.chains import chunks
    from offload.store.fs import FsData

    eng = make("fs", num_blocks=256)
    worker = eng.worker.connector._worker
    n = 4 * CHUNK + 40
    release, real_put = threading.Event(), FsData.put

    def held_put(self, header, *args, **kwargs):
        if header.token_start > 0:
            assert release.wait(30), "write held for 30 s"
        return real_put(self, header, *args, **kwargs)

    monkeypatch.setattr(FsData, "put", held_put)
    tokens = prompt(12, n)
    eng.scheduler.add_request(create_request("a", tokens, max_tokens=2, block_size=BS))
    eng.run_until(lambda: worker.recorders[0].count("kvoffload_store_seconds") == 1)
    [first] = list((tmp_path / "cache").glob(f"{LAYOUT_DIR}/*/g*/*/*.kv"))
    worker.tiers[0].store.remove(first)  # what the budget's evictor does to a leaf
    release.set()
    eng.run_to_completion()
    eng.run_until(lambda: worker.stores.pending_bytes == 0)

    assert worker.recorders[0].by("kvoffload_stores_dropped", "reason") == {"parent_dropped": entries(eng, n) - 1}
    assert not list((tmp_path / "cache").glob(f"{LAYOUT_DIR}/*/g*/*/*.kv"))
    dirs = scan(tmp_path / "cache").dirs
    problems = [(f.path, f.problem) for d in dirs for f in d.files if f.problem]
    problems += [(c.pos, c.orphan) for d in dirs for c in chunks(d).values() if c.orphan]
    assert not problems, problems

    assert eng.scheduler.reset_prefix_cache()
    eng.scheduler.add_request(create_request("b", tokens, max_tokens=2, block_size=BS))
    eng.run_to_completion()
    assert tier_params(eng, "b") == {"restored_tokens": 0, "load_failed": False}
    assert "failed_loads" not in eng.totals()
    assert_scheduler_empty(eng.scheduler)


def test_on_a_hybrid_a_dropped_attention_store_drops_the_mamba_states_behind_it_too(hybrid_config, tmp_path,
                                                                                    monkeypatch):
    """The same on the hybrid: once a chunk's attention store is dropped,
    the chunk is incomplete on that tier, so every entry chained behind it,
    the Mamba states at later boundaries included, is dropped; the state at
    the dropped chunk's own boundary may still be written (it chains from
    the complete chunk before). On disk: attention chunks 0..a-1, states up
    to boundary a+1 at most, nothing below a hole; a repeat restores a
    chunks."""
    from offload.cli.cache import scan
    from offload.cli.chains import chunks
    from offload.store.fs import FsData

    h_bs = 128
    set_connector(hybrid_config, {"store": "fs", "path": str(tmp_path / "cache"), "max_pending_store_bytes": 1 << 20})
    kcc = hybrid_kv_cache_config(["model.layers.0.linear_attn", "model.layers.2.linear_attn"],
                                 ["model.layers.1.self_attn.attn", "model.layers.3.self_attn.attn"],
                                 block_size=h_bs, mamba_shapes=((3, 192), (1, 64, 64)),
                                 mamba_dtypes=(torch.bfloat16, torch.float32), num_kv_heads=4, head_size=64,
                                 num_blocks=64, mamba_cache_mode=hybrid_config.cache_config.mamba_cache_mode)
    scheduler = create_scheduler(hybrid_config, kcc)
    eng = Engine(scheduler, WorkerStep(hybrid_config, kcc, scheduler))
    worker = eng.worker.connector._worker
    release, real_put = threading.Event(), FsData.put

    def held_put(self, *args, **kwargs):
        assert release.wait(30), "write held for 30 s"
        return real_put(self, *args, **kwargs)

    monkeypatch.setattr(FsData, "put", held_put)
    try:
        n = 12 * h_bs + 40
        planner = scheduler.connector.planner
        n_chunks = planner.max_hit_chunks(n)
        tokens = prompt(13, n)
        scheduler.add_request(create_request("a", tokens, max_tokens=2, block_size=h_bs))
        eng.run_until(lambda: worker.recorders[0].total("kvoffload_stores_dropped", reason="backpressure"))
        release.set()
        eng.run_to_completion()
        eng.run_until(lambda: worker.stores.pending_bytes == 0)

        dirs = scan(tmp_path / "cache").dirs
        files = [f for d in dirs for f in d.files]
        kinds = [g.kind.value for g in planner.groups]
        pos = {k: sorted(f.header.token_start // planner.chunk_size for f in files if kinds[f.group] == k)
               for k in set(kinds)}
        a = len(pos["full_attention"])
        assert 0 < a < n_chunks and pos["full_attention"] == list(range(a)), pos
        assert pos["mamba"] == list(range(len(pos["mamba"]))) and len(pos["mamba"]) <= a + 1, pos
        drops = worker.recorders[0].by("kvoffload_stores_dropped", "reason")
        assert drops["parent_dropped"] == 2 * (n_chunks - a - 1), (drops, pos)
        assert len(files) + sum(drops.values()) == 2 * n_chunks, (drops, pos)
        problems = [(f.path, f.problem) for f in files if f.problem]
        problems += [(c.pos, c.orphan) for d in dirs for c in chunks(d).values() if c.orphan]
        assert not problems, problems

        assert scheduler.reset_prefix_cache()
        eng.worker.scramble()
        scheduler.add_request(create_request("b", tokens, max_tokens=2, block_size=h_bs))
        eng.run_to_completion()
        assert tier_params(eng, "b") == {"restored_tokens": a * h_bs, "load_failed": False}
        assert_scheduler_empty(scheduler)
    finally:
        eng.worker.connector.shutdown()


# ---- dropped stores reach the scheduler's indices -------------------------------------------------


def restore_from_host_memory(eng: Engine, req_id: str, tokens: list[int], stored: list[bytes], n_hit: int) -> None:
    """A repeat of `tokens` is offered a hit and restores `stored` byte for byte, all of it from host memory."""
    eng.scheduler.add_request(create_request(req_id, tokens, max_tokens=2, block_size=BS))
    eng.step()
    assert eng.status(req_id) == WAITING_FOR_KV, "no hit offered"
    dest = table(eng, req_id)[:n_hit // BS]
    eng.run_until(lambda: eng.status(req_id) != WAITING_FOR_KV)
    assert_same_bytes(eng.worker.blocks_bytes(dest), stored, "restored from host memory")
    eng.run_to_completion()
    host = f"kvoffload:{eng.scheduler.connector.cfg.tiers[0].tier_name}"
    assert eng.finished[req_id][host] == {"restored_tokens": n_hit, "load_failed": False}


def test_host_memory_evicts_an_entry_whose_write_to_the_files_was_dropped(make, tmp_path, monkeypatch):
    """In a stack, host memory keeps an entry whose only copy it holds while
    the write to the files may still land. Where that write was dropped (an
    I/O error here; backpressure and a full disk alike), the worker reports it
    with a step's output and the entry is evicted like any other: kept, such
    entries would fill host memory until a restart, every later store there
    counted `no_room`. Host memory here holds one prompt's entries and every
    file write fails; a second prompt must still be stored in host memory and
    restored from it, byte for byte."""
    from offload.store.fs import FsData

    probe = make("cpu")
    n = 4 * CHUNK + 88  # 4 chunks and a tail of 5 blocks: 9 entries, host memory's 1 MiB minimum and more
    n_entries, HIT = entries(probe, n), hit(probe, n)

    def failing_put(self, *args, **kwargs):
        raise OSError(errno.EIO, "injected write error")

    monkeypatch.setattr(FsData, "put", failing_put)
    eng = make("stack", tiers=[{"store": "cpu", "cpu_bytes": n_entries * CHUNK_BYTES},
                               {"store": "fs", "path": str(tmp_path / "cache")}])
    worker = eng.worker.connector._worker
    run(eng, "a", prompt(21, n))
    eng.run_until(lambda: worker.stores.pending_bytes == 0)
    eng.step()  # the step's output carries the last drops (any step of other requests would)
    dropped = worker.recorders[1].by("kvoffload_stores_dropped", "reason")
    assert sum(dropped.values()) == n_entries, dropped

    b_tokens = prompt(22, n)
    stored = store_prompt(eng, "b", b_tokens, tmp_path)
    restore_from_host_memory(eng, "c", b_tokens, stored, HIT)
    totals = eng.totals()
    assert "failed_loads" not in totals and not totals.get("stores_dropped:no_room"), totals
    assert_scheduler_empty(eng.scheduler)


def test_an_entry_whose_host_memory_store_failed_is_not_offered(make, tmp_path, monkeypatch):
    """The scheduler counts an entry in host memory when it plans the store.
    If the gather into its slot fails, the worker reports the drop and the
    entry is forgotten: a lookup is not offered a slot that does not hold it
    (that load would fail, a counted miss for every later request with the
    prefix, since the slot's entry stays). A repeat stores the prefix again,
    and the next repeat restores it from host memory."""
    from offload.connector.stores import StorePath

    eng = make("cpu")
    HIT = hit(eng)
    real_gather, broken = StorePath._gather, threading.Event()
    broken.set()

    def gather(self, *args, **kwargs):
        if broken.is_set():
            raise RuntimeError("injected gather error")
        return real_gather(self, *args, **kwargs)

    monkeypatch.setattr(StorePath, "_gather", gather)
    tokens = prompt(23)
    run(eng, "a", tokens)
    broken.clear()
    # The first entry's drop reached the scheduler in its step, so the entries chained behind it
    # were never planned into host memory (orphans there), nor tried.
    assert eng.worker.connector._worker.recorders[0].by("kvoffload_stores_dropped", "reason") == {"error": 1}
    assert eng.scheduler.reset_prefix_cache()
    eng.worker.scramble()
    stored = store_prompt(eng, "b", tokens, tmp_path)
    assert tier_params(eng, "b") == {"restored_tokens": 0, "load_failed": False}

    restore_from_host_memory(eng, "c", tokens, stored, HIT)
    assert "failed_loads" not in eng.totals(), eng.totals()
    assert_scheduler_empty(eng.scheduler)


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling policies")
def test_drain_runs_idle_priority_stores_at_normal_priority_then_yields_again(make, monkeypatch):
    """Store threads run at SCHED_IDLE so they never take a core from the model; a
    busy host can starve them indefinitely (measured in CI: a shutdown's 60 s ran
    out with an LMCache write still queued). Whoever drains waits on them, so the
    drain lifts them to normal priority until they land."""
    from offload.store.fs import FsData

    eng = make("fs")
    release, seen, real_put = threading.Event(), [], FsData.put

    def held_put(self, *args, **kwargs):
        seen.append(("queued", os.sched_getscheduler(0)))
        assert release.wait(30), "write held for 30 s"
        seen.append(("draining", os.sched_getscheduler(0)))
        return real_put(self, *args, **kwargs)

    monkeypatch.setattr(FsData, "put", held_put)
    a = create_request("a", prompt(11), max_tokens=2, block_size=BS)
    eng.scheduler.add_request(a)
    eng.run_to_completion()
    worker = eng.worker.connector._worker
    deadline = time.monotonic() + 10
    while not seen and time.monotonic() < deadline:
        time.sleep(0.01)
    before = list(seen)
    assert before and {p for _, p in before} == {os.SCHED_IDLE}, before

    def release_once_lifted() -> None:
        """Let the held writes go once the drain below has lifted every store thread (or after 30 s)."""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if {os.sched_getscheduler(t) for t in worker.stores.store_tids} == {os.SCHED_OTHER}:
                break
            time.sleep(0.01)
        release.set()

    threading.Thread(target=release_once_lifted, daemon=True).start()
    assert worker.drain(30) == 0
    assert {p for k, p in seen if k == "draining"} == {os.SCHED_OTHER}, seen
    tids = worker.stores.store_tids
    assert {os.sched_getscheduler(t) for t in tids} == {os.SCHED_IDLE}, "yields again after the drain"


# ---- a partial tail: vLLM's prefix-match unit on a hybrid ----------------------------------------

UNIT = 64  # divides the tiny hybrid's 128-token blocks: vLLM hits at every 64 tokens


@pytest.fixture
def tail_engine(models_dir, tmp_path):
    """The tiny hybrid under vLLM's Scheduler with `prefix_match_unit` set:
    hash blocks of UNIT tokens, prefills split at each prompt's UNIT-aligned tail."""
    engines: list[Engine] = []

    def _make(store: str = "cpu", **extra) -> Engine:
        cfg = create_vllm_config(str(models_dir / "qwen3-next-tiny"), block_size=128, max_num_batched_tokens=128,
                                 prefix_cache_retention_interval=128, prefix_match_unit=UNIT)
        set_connector(cfg, ({"store": "cpu", "cpu_bytes": 1 << 24} if store == "cpu"
                            else {"store": "fs", "path": str(tmp_path / "cache")}) | extra)
        kcc = hybrid_kv_cache_config(["model.layers.0.linear_attn", "model.layers.2.linear_attn"],
                                     ["model.layers.1.self_attn.attn", "model.layers.3.self_attn.attn"],
                                     block_size=128, mamba_shapes=((3, 192), (1, 64, 64)),
                                     mamba_dtypes=(torch.bfloat16, torch.float32), num_kv_heads=4, head_size=64,
                                     num_blocks=64, mamba_cache_mode=cfg.cache_config.mamba_cache_mode)
        scheduler = create_scheduler(cfg, kcc)
        engines.append(Engine(scheduler, WorkerStep(cfg, kcc, scheduler)))
        return engines[-1]

    yield _make
    for e in engines:
        e.worker.connector.shutdown()


@pytest.mark.parametrize("store", ["cpu", "fs", "fs with a key"])
def test_partial_tail_restores_attention_to_the_unit_and_the_state_vllm_materialised(tail_engine, tmp_path, store):
    """A 250-token prompt on 128-token blocks with a 64-token unit: vLLM
    stops its prefill at 192 (the prompt's unit-aligned tail) and hands the
    GDN state there over. The connector stores chunk 0 and the tail (the
    attention block up to 192, zero past it, and that state); a repeat, the
    next turn and a prompt sharing 200 tokens all restore 192 tokens: the
    exact bytes, in every group. With a key, every file's CRC and MAC are
    taken in the gather's pass, but the tail's after its masking."""
    extra = {}
    if store == "fs with a key":
        key = tmp_path / "key"
        key.write_bytes(os.urandom(48).hex().encode())
        key.chmod(0o600)
        store, extra = "fs", {"auth": {"key_file": str(key)}}
    eng = tail_engine(store, **extra)
    sched, worker = eng.scheduler, eng.worker
    assert sched.connector.planner.tail_unit == UNIT and sched.hash_block_size == UNIT
    # The attention group's token map is built when the KV cache is registered, before any step.
    assert worker.connector._worker.token_mapped_groups == [1]
    tokens = prompt(11, 250)
    tail = (250 - 1) // UNIT * UNIT
    assert tail == 192 and tail % 128
    worker.scramble()  # the tail block's slots past 192 hold stale bytes, which must not be stored
    a = create_request("a", tokens, max_tokens=2, block_size=UNIT)
    sched.add_request(a)
    state = chunk0 = None
    while "a" in sched.requests:
        eng.step()
        mamba_table, attn_table = table_all(eng, "a")
        if a.num_computed_tokens == tail:  # vLLM's split: a step ends at the tail
            state = worker.blocks_bytes([mamba_table[(tail - 1) // 128]], group=0)
            chunk0 = worker.blocks_bytes(attn_table[:1], group=1)
    assert state is not None and chunk0 is not None, "vLLM did not stop the prefill at the tail"
    if store == "fs":
        wait_for_files(tmp_path / "cache", 4)
    # chunk 0 (attention + state: 2 x 128 tokens) and the tail (attention + state: 2 x 64)
    wait_for_stored_tokens(eng, 2 * 128 + 2 * (tail - 128))
    assert eng.totals().get("stored_tokens") == 2 * 128 + 2 * (tail - 128)
    assert sched.reset_prefix_cache()

    expected_tail_block = worker.expected_block(tokens, group=1, block=1, upto=tail)
    for rid, toks in (("repeat", tokens), ("next-turn", tokens + prompt(12, 40)),
                      ("shared-200", tokens[:200] + prompt(13, 30))):
        worker.scramble()
        r = create_request(rid, toks, max_tokens=2, block_size=UNIT)
        sched.add_request(r)
        restored: dict[str, list[bytes]] = {}
        tables: list[tuple[list[int], ...]] = []

        # The load is done and vLLM has not scheduled the request's compute yet.
        def grab(rid=rid, tables=tables, restored=restored) -> None:
            if not tables and eng.status(rid) == WAITING_FOR_KV:
                tables.append(table_all(eng, rid))
            in_flight = worker.connector._worker.loads.in_flight
            if not restored and eng.status(rid) == WAITING_FOR_KV and rid not in in_flight:
                mamba_table, attn_table = tables[0]
                restored["tail"] = worker.blocks_bytes(attn_table[1:2], group=1)
                restored["state"] = worker.blocks_bytes([mamba_table[(tail - 1) // 128]], group=0)

        eng.step(between=grab)
        assert eng.status(rid) == WAITING_FOR_KV, rid
        deadline = time.monotonic() + 30
        while not restored:
            assert time.monotonic() < deadline, f"{rid}: load not done"
            eng.step(between=grab)
        mamba_table, attn_table = tables[0]
        assert_same_bytes(worker.blocks_bytes(attn_table[:1], group=1), chunk0, f"{rid}: chunk 0 attention")
        assert_same_bytes(restored["tail"], expected_tail_block,
                          f"{rid}: the tail's attention block (tokens 128-191, zero past them)")
        assert_same_bytes(restored["state"], state, f"{rid}: the GDN state at the tail")
        eng.run_until(lambda rid=rid: rid in eng.finished)
        assert tier_params(eng, rid) == {"restored_tokens": tail, "load_failed": False}, rid
        assert eng.scheduled[rid] == len(toks) - tail + 1, rid  # the rest of the prompt, one decode step
        assert sched.reset_prefix_cache()
    eng.run_to_completion()
    assert pinned(eng) == 0
    assert_scheduler_empty(sched)


@pytest.mark.parametrize("policy", ["by_use", "all", "tails"])
def test_both_halves_of_the_partial_tail_enter_cold_under_by_use(tail_engine, policy):
    """The 250-token prompt stores chunk 0 (attention, and the state at 128:
    its whole-chunk tail) and the partial tail at 192 (attention page and
    state). `by_use` admits both halves of the partial tail cold, `all` and
    `tails` hot; the whole-chunk tail is hot under each."""
    eng = tail_engine("cpu", state_policy=policy)
    sched = eng.scheduler
    idx = sched.connector._sched.indices[0]
    sched.add_request(create_request("a", prompt(11, 250), max_tokens=2, block_size=UNIT))
    eng.run_to_completion()
    wait_for_stored_tokens(eng, 2 * 128 + 2 * 64)
    cold = policy == "by_use"
    got = sorted((g, e.state.value if e.state else "-", e.cold) for (g, _), e in idx.entries.items())
    assert got == sorted([(1, "-", False), (1, "-", cold), (0, "tail", False), (0, "partial", cold)]), got
    assert pinned(eng) == 0


def test_a_request_started_by_vllms_own_sub_block_hit_stores_nothing_from_that_chunk_on(tail_engine):
    """vLLM's own prefix cache starts the next turn at A's tail (192), inside
    chunk 1, after copying the tail block by copy-on-write (which vLLM-CPU
    0.32 does incompletely for hybrids: the attention page shares its tensor
    with the GDN state views, and only their bytes are copied). So chunk 1
    of that request, and anything after it, is not stored: stored tokens stay
    those of A (chunk 0 and A's tail) while a restored request stores on."""
    eng = tail_engine("cpu")
    sched = eng.scheduler
    tokens = prompt(21, 250)
    a = create_request("a", tokens, max_tokens=2, block_size=UNIT)
    sched.add_request(a)
    eng.run_to_completion()
    stored_a = 2 * 128 + 2 * 64
    wait_for_stored_tokens(eng, stored_a)
    turn = create_request("turn", tokens + prompt(22, 300), max_tokens=2, block_size=UNIT)
    sched.add_request(turn)
    eng.step()
    assert eng.scheduled["turn"] == 256 - 192 == turn.num_computed_tokens - 192  # vLLM hit 192, then on to 256
    eng.run_to_completion()
    assert tier_params(eng, "turn")["restored_tokens"] == 0  # vLLM's own hit, not ours
    for _ in range(5):
        eng.step()
    assert eng.totals().get("stored_tokens") == stored_a
    # The same next turn after a restore of ours stores its chunks past the tail.
    assert sched.reset_prefix_cache()
    again = create_request("again", tokens + prompt(22, 300), max_tokens=2, block_size=UNIT)
    sched.add_request(again)
    eng.run_to_completion()
    assert tier_params(eng, "again")["restored_tokens"] == 192
    more = 3 * 2 * 128  # chunks 1-3 of the 550-token prompt, both groups (its own tail is 512: a chunk boundary)
    wait_for_stored_tokens(eng, stored_a + more)
    assert eng.totals().get("stored_tokens") == stored_a + more




def test_a_request_resumed_by_vllms_own_sub_block_hit_stores_nothing_from_that_chunk_on(tail_engine):
    """The same rule for a preempted request, which vLLM resumes through its
    own prefix cache as a *resumed* request (in scheduled_cached_reqs, not
    scheduled_new_reqs). The next turn computes chunk 0 and is preempted
    (vLLM's own path: off the running queue, `_preempt_request`); while it
    waits (held out of the waiting queue, as a full KV cache would keep it
    there), A is served and computes its tail (192). The next turn then
    resumes at 192, inside chunk 1: chunk 1 of it and anything after it are
    not stored, and the stored tokens stay chunk 0 and A's tail."""
    eng = tail_engine("cpu")
    sched = eng.scheduler
    tokens = prompt(31, 250)
    turn = create_request("turn", tokens + prompt(32, 300), max_tokens=2, block_size=UNIT)
    sched.add_request(turn)
    eng.step()
    assert turn.num_computed_tokens == 128
    sched.running.remove(turn)
    sched._preempt_request(turn, time.monotonic())
    sched.waiting.remove_request(turn)
    a = create_request("a", tokens, max_tokens=2, block_size=UNIT)
    sched.add_request(a)
    eng.run_until(lambda: "a" in eng.finished)
    sched.waiting.prepend_request(turn)
    so = eng.step()
    cached = so.scheduled_cached_reqs
    assert "turn" in cached.resumed_req_ids
    assert cached.num_computed_tokens[cached.req_ids.index("turn")] == 192  # vLLM's own hit, on A's tail
    eng.run_to_completion()
    # The request's report says so (a client cannot see it otherwise); A, computed cold, has no such flag.
    assert tier_params(eng, "turn") == {"restored_tokens": 0, "load_failed": False, "vllm_sub_block_hit": True}
    assert tier_params(eng, "a") == {"restored_tokens": 0, "load_failed": False}
    for _ in range(5):
        eng.step()
    stored = 2 * 128 + 2 * 64  # chunk 0 (by the next turn) and A's tail, both groups
    wait_for_stored_tokens(eng, stored)
    assert eng.totals().get("stored_tokens") == stored


def test_a_request_vllm_started_inside_a_block_stores_no_tail_in_a_later_chunk(tail_engine):
    """Its own tail too: the next turn (350 tokens) that vLLM's own cache starts at A's tail (192,
    chunk 1) has its own tail at 320, in chunk 2, computed over the incompletely copied block: not
    stored (it would also be a tail whose parent chunk 1 is missing, a chain hole for fsck)."""
    eng = tail_engine("cpu")
    sched = eng.scheduler
    tokens = prompt(41, 250)
    sched.add_request(create_request("a", tokens, max_tokens=2, block_size=UNIT))
    eng.run_to_completion()
    stored_a = 2 * 128 + 2 * 64  # chunk 0 and A's tail, both groups
    wait_for_stored_tokens(eng, stored_a)
    turn = tokens + prompt(42, 100)
    assert sched.connector.planner.tail_boundary(len(turn)) == 320
    sched.add_request(create_request("turn", turn, max_tokens=2, block_size=UNIT))
    eng.run_to_completion()
    assert tier_params(eng, "turn") == {"restored_tokens": 0, "load_failed": False, "vllm_sub_block_hit": True}
    for _ in range(5):
        eng.step()
    assert eng.totals().get("stored_tokens") == stored_a


@pytest.mark.parametrize("num_blocks", [7, 10])
def test_partial_tail_loads_wait_for_room_instead_of_stalling_vllm(models_dir, tmp_path, held_loads, num_blocks):
    """vLLM 0.32 admits an async load if its blocks leave room for the loads
    already admitted to finish, but counts one block short for a load that
    ends inside a Mamba block (the copy-on-write of the state block there,
    which it adds only once the load has landed). Three repeats of stored
    250-token prompts, each restoring its tail at 192 (inside the second
    128-token block), arrive together in a KV cache of 7 or 10 blocks: as vLLM
    admits them, two or three loads fill it, none can take its next block and
    nothing runs, for good (measured without the connector's check; the long
    load test found it on a server). The connector offers a hit only where
    the free blocks hold what it and every admitted load still need, so the
    others wait a step at a time and every repeat restores its tail."""
    release, _ = held_loads
    eng = tiny_hybrid_engine(str(models_dir / "qwen3-next-tiny"), num_blocks, UNIT)
    sched = eng.scheduler
    try:
        prompts = [prompt(40 + i, 250) for i in range(3)]
        release.set()  # the stores' own runs load nothing
        for i, p in enumerate(prompts):
            sched.add_request(create_request(f"s{i}", p, max_tokens=1, block_size=UNIT))
            eng.run_to_completion()
        assert sched.reset_prefix_cache()
        release.clear()
        for i, p in enumerate(prompts):
            sched.add_request(create_request(f"r{i}", p, max_tokens=1, block_size=UNIT))
        for _ in range(5):
            eng.step()
        assert sched.kv_holding_waiting, "no load admitted"
        release.set()
        eng.run_to_completion(timeout=30)
        assert [tier_params(eng, f"r{i}")["restored_tokens"] for i in range(3)] == [192] * 3
        totals = eng.totals()
        assert "failed_loads" not in totals
        assert totals.get("hits_deferred", 0) > 0, "the others waited for room, and the metric says so"
        assert totals["lookups"] == 6, "each request looked up once, however often it was deferred"
        assert_scheduler_empty(sched)
    finally:
        release.set()
        eng.worker.connector.shutdown()


def test_a_hit_no_longer_than_vllms_own_partial_block_is_not_deferred(models_dir, held_loads):
    """vLLM shows the connector its own hit cut to its block (`block_aligned_local`) and keeps
    its own hit inside the next block over ours unless ours goes past it. A's next turn: vLLM's
    own cache hits 192 of it (A's tail, inside the second 128-token block), the connector holds the
    same 192 and offers the 64 past the block. While a load of another request holds blocks (a
    long prompt restoring its first 192 tokens, held), those 64 do not fit by the room check. The
    next turn must start at once from vLLM's own hit, not wait: while it waited, a request queued
    behind it took the free blocks, evicting vLLM's cached copy of A, which the next turn then
    loaded back from our tier (measured before this rule: deferred, restored 192, vLLM's own hit
    lost). Real loads still wait (test_partial_tail_loads_wait_for_room_instead_of_stalling_vllm)."""
    release, _ = held_loads
    eng = tiny_hybrid_engine(str(models_dir / "qwen3-next-tiny"), 14, UNIT, max_model_len=2048)
    sched = eng.scheduler
    ours = sched.connector._sched
    try:
        release.set()  # the stores' own runs load nothing
        p, a = prompt(51, 250), prompt(52, 250)
        sched.add_request(create_request("p", p, max_tokens=1, block_size=UNIT))
        eng.run_to_completion()
        assert sched.reset_prefix_cache()  # p is in our tier only
        sched.add_request(create_request("a", a, max_tokens=1, block_size=UNIT))
        eng.run_to_completion()  # a: in vLLM's prefix cache and in our tier
        wait_for_stored_tokens(eng, 2 * (2 * 128 + 2 * 64))  # chunk 0 and the tail of p and of a, both groups
        release.clear()
        sched.add_request(create_request("load", p + prompt(53, 700), max_tokens=1, block_size=UNIT))
        eng.step()
        assert eng.status("load") == WAITING_FOR_KV, "the other request's load is in flight"
        turn = create_request("turn", a + prompt(54, 400), max_tokens=1, block_size=UNIT)
        _, own_hit, *_ = sched.kv_cache_manager.get_computed_blocks(turn)  # vLLM's own hit, as it will look it up
        tail = (len(a) - 1) // UNIT * UNIT
        assert own_hit == tail and tail % 128, (own_hit, tail)
        assert not ours.room.fits(turn, tail, ours._loads_waiting()), "the KV cache is tight: our 64 do not fit"
        sched.add_request(turn)
        sched.add_request(create_request("behind", prompt(55, 900), max_tokens=1, block_size=UNIT))
        so = eng.step()
        assert so.num_scheduled_tokens.get("turn") == 256 - tail, so.num_scheduled_tokens  # to the block's end
        assert turn.num_computed_tokens == 256
        for _ in range(12):
            eng.step()
        release.set()
        eng.run_to_completion(timeout=30)
        assert tier_params(eng, "turn") == {"restored_tokens": 0, "load_failed": False, "vllm_sub_block_hit": True}
        assert eng.scheduled["turn"] == len(turn.prompt_token_ids) - tail, "vLLM computed past its own hit only"
        assert tier_params(eng, "load")["restored_tokens"] == tail
        totals = eng.totals()
        assert "hits_deferred" not in totals and "failed_loads" not in totals, totals
        assert_scheduler_empty(sched)
    finally:
        release.set()
        eng.worker.connector.shutdown()


# ---- a new tier: one module and one registration line --------------------------------------------


def test_a_toy_tier_registered_by_one_line_runs_through_the_cli(make, tmp_path, capsys):
    """docs/tiers.md's recipe: tests/toy_tier.py and its line in TIERS (set by `make`) are all a
    tier needs. The connector stores and restores through it (the test above), check-config
    validates a config naming it and refuses a key it does not have, and stats and fsck read its
    directory, which they know of from its declaration."""
    from offload import cli

    eng = make("toy")
    assert type(eng.scheduler.connector.tiers[0]).__name__ == "ToyTier"
    store_prompt(eng, "a", prompt(1), tmp_path)

    cache = tmp_path / "cache"
    ktc = {"kv_connector": "OffloadConnector", "kv_connector_module_path": "offload.connector", "kv_role": "kv_both",
           "kv_connector_extra_config": {"tiers": [{"store": "cpu", "cpu_bytes": "4MiB"},
                                                   {"store": "toy", "path": str(cache)}]}}
    config = tmp_path / "toy.json"
    config.write_text(json.dumps(ktc))
    assert cli.main(["check-config", str(config)]) == 0
    assert "valid OffloadConnector config" in capsys.readouterr().out
    ktc["kv_connector_extra_config"]["tiers"][1]["fsync"] = True
    config.write_text(json.dumps(ktc))
    assert cli.main(["check-config", str(config)]) == 1
    assert "tiers[1].fsync: only for store 'fs'" in capsys.readouterr().out
    ktc["kv_connector_extra_config"]["tiers"][1]["store"] = "toys"
    config.write_text(json.dumps(ktc))
    assert cli.main(["check-config", str(config)]) == 1
    assert "must be one of 'fs', 'cpu', 'lmcache', 'toy'" in capsys.readouterr().out

    assert cli.main(["stats", str(cache), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert sum(g["files"] for d in report["fingerprints"] for g in d["groups"]) == entries(eng)
    ktc["kv_connector_extra_config"]["tiers"][1].pop("fsync")
    ktc["kv_connector_extra_config"]["tiers"][1]["store"] = "toy"
    config.write_text(json.dumps(ktc))
    assert cli.main(["stats", "--config", str(config)]) == 2  # no LMCache tier; it names the toy's files
    assert f"its file tiers: `kvoffload stats {cache}`" in capsys.readouterr().err
    assert cli.main(["fsck", str(cache)]) == 0
    assert f"{entries(eng)} chunk files" in capsys.readouterr().out
