"""Partial tails on a real engine: the tiny hybrid served with vLLM's
`--prefix-match-unit`, restarted, restores to the same unit-aligned boundary
vLLM's own prefix cache hits in one process.

Four engine processes, same flags (`engine_args(True)` plus the unit), our
connector configured in each:
- own: one pass [A, A, next turn of A, a prompt sharing 200 tokens with A] on
  an empty directory. vLLM's own cache serves the repeats (asserted: nothing
  restored), so its cached tokens are what vLLM hits in-process.
- ref: [A, next turn, shared] with prefix caching skipped per request (nothing
  read from vLLM's cache or ours): the cold reference tokens.
- cold: A alone on directory D: stores chunk 0 and A's tail.
- restart: a new process on D, [A], [next turn], [shared] in passes of their
  own (vLLM's cache emptied in between): each restores exactly what vLLM's own
  cache hit, and greedy tokens equal the cold reference's.
The tail files are canonical: the same prompt writes byte-identical files in
two engines (D and the own run's directory). Much the same on llama-tiny (attention
only, default flags, a chunk of four blocks, three engines) checks the chain of
one-block tail entries an attention-only model stores behind its last whole
chunk, and a prompt sharing only part of it.
"""

from __future__ import annotations

import random

import pytest

from conftest import CHUNK, engine_args, random_prompt, shipped_config, side_by_side
from harness.engine import RunSpec, run_engine
from offload.store.cachedir.paths import LAYOUT_DIR
from offload.store.format import HEADER_LEN, ChunkHeader

pytestmark = pytest.mark.e2e

UNIT = CHUNK // 2  # divides the tiny hybrid's block (= its chunk): vLLM hits every UNIT tokens
rng = random.Random(22)
A = random_prompt(rng, 2 * CHUNK - 6)  # its tail, (len - 1) // UNIT * UNIT, lies inside chunk 1
NEXT_TURN = A + random_prompt(rng, 40)
SHARED = A[:200] + random_prompt(rng, 30)
TAIL = (len(A) - 1) // UNIT * UNIT


def _args() -> dict:
    return {**engine_args(True), "prefix_match_unit": UNIT}


def scenario(model: str, prompts: list[list[int]], args: dict, tmp_path, timeout_s: float = 900) -> dict:
    """The four engines of the module docstring; `prompts` are [A, next turn, shared]."""
    d, e, f = tmp_path / "d", tmp_path / "e", tmp_path / "f"
    for p in (d, e, f):
        p.mkdir()
    own, ref, cold = side_by_side(
        lambda: run_engine(RunSpec(model, prompts, shipped_config("fs.json", e), 12, args, order=[[0, 0, 1, 2]]),
                           timeout_s=timeout_s),
        lambda: run_engine(RunSpec(model, prompts, shipped_config("fs.json", f), 12, args, skip_prefix_cache=True),
                           timeout_s=timeout_s),
        lambda: run_engine(RunSpec(model, prompts[:1], shipped_config("fs.json", d), 12, args), timeout_s=timeout_s))
    a_files = {p.relative_to(d): p.read_bytes() for p in d.glob(f"{LAYOUT_DIR}/*/g*/*/*.kv")}
    restart = run_engine(RunSpec(model, prompts, shipped_config("fs.json", d), 12, args, order=[[0], [1], [2]]),
                         timeout_s=timeout_s)
    return {"own": own, "ref": ref, "cold": cold, "restart": restart, "a_files": a_files, "d": d, "e": e}


def _runs(models_dir, tmp_path):
    return scenario(str(models_dir / "qwen3-next-tiny"), [A, NEXT_TURN, SHARED], _args(), tmp_path)


def check_restores(runs: dict, chunk: int, a_len: int) -> list[tuple[int, int]]:
    """Restored after a restart == vLLM's own in-process hits, tokens == the
    cold reference; returns (vLLM's own, restored) per prompt."""
    own, ref, cold, restart = runs["own"], runs["ref"], runs["cold"], runs["restart"]
    for run in (own, ref, cold):
        assert run.restored_tokens == 0, "the references restore nothing"
    assert ref.cached_tokens == 0, "the cold reference computes every token"
    vllm_hits = [r.cached_tokens for r in own.results[1:]]  # A again, its next turn, the shared prefix
    assert vllm_hits[0] > (a_len - 1) // chunk * chunk, f"vLLM hits {vllm_hits} are not inside a block: no unit?"
    restored = [r.restored_tokens for r in restart.results]
    assert restored == vllm_hits, (restored, vllm_hits)
    assert [r.cached_tokens for r in restart.results] == restored  # all of it from the tier, after a restart
    assert not any(r.load_failed for r in restart.results)
    assert cold.results[0].output_ids == ref.results[0].output_ids
    assert [r.output_ids for r in restart.results] == [r.output_ids for r in ref.results]
    return list(zip(vllm_hits, restored))


@pytest.fixture(scope="module")
def runs(prefetched):
    return prefetched(_runs)


@pytest.mark.prefetch.with_args(_runs)
def test_restart_restores_what_vllms_own_cache_hits_at_the_unit(runs):
    assert TAIL % CHUNK and len(A) > TAIL
    check_restores(runs, CHUNK, len(A))


@pytest.mark.prefetch.with_args(_runs)
def test_tail_files_are_byte_identical_across_engines(runs):
    """The files of A that the cold engine wrote (chunk 0 and A's tail, in
    both groups; the tail headed [chunk start, tail)) were written by the own
    run's engine too, with the same bytes."""
    files = runs["a_files"]
    other = {p.relative_to(runs["e"]): p.read_bytes() for p in runs["e"].glob(f"{LAYOUT_DIR}/*/g*/*/*.kv")}
    heads = sorted((h.group, h.token_start, h.token_end) for h in
                   (ChunkHeader.unpack(data[:HEADER_LEN]) for data in files.values()))
    start = TAIL // CHUNK * CHUNK
    assert heads == [(0, 0, CHUNK), (0, start, TAIL), (1, 0, CHUNK), (1, start, TAIL)], heads
    for name, data in files.items():
        assert other.get(name) == data, f"{name}: differs between two engines that stored the same prompt"


@pytest.mark.prefetch.with_args(_runs)
def test_fsck_takes_tails_for_leaves_not_corruption(runs):
    """`kvoffload fsck`'s scan verifies every file (payload CRCs too) and
    finds no problem and no hole: a tail is a leaf of its chunk's chain."""
    from offload.cli.cache import scan
    from offload.cli.chains import chunks

    cache = scan(runs["d"], verify_payloads=True)
    [fp] = cache.dirs
    assert fp.files and [f.problem for f in fp.files if f.problem] == []
    linked = chunks(fp)
    tails = [c for c in linked.values() if any(f.header.token_end % CHUNK for f in c.files)]
    assert len(tails) == 1 and tails[0].complete and tails[0].orphan is None and not tails[0].children
    assert all(c.orphan is None for c in linked.values())
    # `kvoffload stats` counts the chain to the tail's last token, not the tail as a whole chunk.
    from offload.cli.stats import longest_chain_tokens

    assert longest_chain_tokens(linked) == max(c.end for c in linked.values())
    # A's chain alone (chunk 0, then its tail) ends at the tail's last token, not a chunk later.
    assert longest_chain_tokens({k: c for k, c in linked.items() if c.end <= TAIL}) == TAIL


# ---- attention only: the tail behind the last whole chunk, one block per entry --------------------------
# llama-tiny with its default flags (no unit to set: vLLM's own cache hits an
# attention-only model at every block) and a chunk of four blocks
# (`hybrid_chunk_size`), so that the region behind A's whole chunk holds
# several blocks. With B the block vLLM picks here (from the plan), A has 7B +
# 10 tokens: chunk 0 whole, then its tail [4B, 7B) as entries ending at 5B, 6B
# and 7B. Its next turn (+2 tokens) ends in the same block, so it stores no
# entry A did not. The shared prompt has A's first 6.5B tokens, then B/4
# others: vLLM's own cache hits 6B (the last block boundary of the shared
# prefix, also its own last block before its last token), which A's entries
# ending at 5B and 6B reach (one tail entry per prompt reached only the chunk,
# 4B); its own entries are A's, so the own run's directory holds A's entries
# only, and is the one the restart reads: three engines, not four.


def _llama_prompts(block: int) -> list[list[int]]:
    rng = random.Random(23)
    a = random_prompt(rng, 7 * block + 10)
    return [a, a + random_prompt(rng, 2), a[:6 * block + block // 2] + random_prompt(rng, block // 4)]


def _llama_runs(models_dir, tmp_path):
    from dataclasses import replace

    from offload.plan.run import plan_for_model
    from offload.planner import HybridOffloadPlanner

    llama, args = str(models_dir / "llama-tiny"), engine_args(False)
    plan = plan_for_model(llama)
    block = HybridOffloadPlanner.block_lcm(plan.specs)
    planner = replace(plan, hybrid_chunk_size=4 * block).planner()  # the planner the connector builds then
    prompts = _llama_prompts(block)

    def config(d):
        kv = shipped_config("fs.json", d)
        kv["kv_connector_extra_config"]["hybrid_chunk_size"] = planner.chunk_size
        return kv

    e, f = tmp_path / "e", tmp_path / "f"
    e.mkdir()
    f.mkdir()
    own, ref = side_by_side(
        lambda: run_engine(RunSpec(llama, prompts, config(e), 12, args, order=[[0, 0, 1, 2]]),
                           env={"PYTHONHASHSEED": "1"}),
        lambda: run_engine(RunSpec(llama, prompts, config(f), 12, args, skip_prefix_cache=True)))
    files = {name: {p.relative_to(d): p.read_bytes() for p in d.glob(f"{LAYOUT_DIR}/*/g*/*/*.kv")}
             for name, d in (("e", e), ("f", f))}
    restart = run_engine(RunSpec(llama, prompts, config(e), 12, args, order=[[0], [1], [2]]),
                         env={"PYTHONHASHSEED": "2"})
    # The own run's first pass of A is cold (nothing cached, nothing restored): A's cold run.
    return {"own": own, "ref": ref, "cold": own, "restart": restart, "files": files, "e": e, "planner": planner,
            "prompts": prompts}


@pytest.mark.prefetch.with_args(_llama_runs)
def test_attention_only_restart_restores_every_block_vllms_own_cache_hits(prefetched):
    """After a restart (new process, new PYTHONHASHSEED), restored == vLLM's
    own in-process hit for A repeated, its next turn and a prompt sharing a
    prefix that ends inside A's tail region; greedy tokens == the cold
    reference's. The files are A's chunk and its one-block tail entries,
    byte-identical in the two engines that stored them, and fsck takes the
    entries for a chain behind the chunk: complete, no hole."""
    runs = prefetched(_llama_runs)
    planner, prompts = runs["planner"], runs["prompts"]
    c, u, a_len = planner.chunk_size, planner.tail_unit, len(prompts[0])
    tail = planner.tail_boundary(a_len)
    ends = list(planner.tail_entries(tail // c, tail // c * c, tail))  # A's tail entries, by boundary
    assert planner.chained_tails and len(ends) == 3 and tail // c == planner.max_hit_chunks(a_len)
    assert [planner.tail_boundary(len(p)) for p in prompts] == [tail, tail, ends[-2]]  # see above
    rows = check_restores(runs, c, a_len)
    assert rows[0][1] == planner.repeat_hit(a_len) == tail
    # The shared prefix: restored past A's chunk, to vLLM's own hit inside A's tail.
    assert rows[2] == (ends[-2], ends[-2]) and ends[-2] > planner.max_hit_chunks(a_len) * c
    e, f = runs["files"]["e"], runs["files"]["f"]
    heads = sorted((h.group, h.token_start, h.token_end) for h in
                   (ChunkHeader.unpack(data[:HEADER_LEN]) for data in e.values()))
    assert heads == [(0, k * c, (k + 1) * c) for k in range(planner.max_hit_chunks(a_len))] + \
        [(0, b - u, b) for b in ends], heads
    assert e == f, "two engines that stored the same prompts wrote different files"
    # fsck: every file verifies; A's tail entries chain from its chunk, one after the other; no hole.
    from offload.cli.cache import scan
    from offload.cli.chains import chunks

    [fp] = scan(runs["e"], verify_payloads=True).dirs
    assert fp.files and [x.problem for x in fp.files if x.problem] == []
    linked = chunks(fp)
    assert all(k.complete and k.orphan is None for k in linked.values())
    tails = sorted((k for k in linked.values() if k.start % c or k.end % c), key=lambda k: k.start)
    assert [(k.start, k.end) for k in tails] == [(b - u, b) for b in ends]
    assert [[ch.key for ch in k.children] for k in tails] == [[t.key] for t in tails[1:]] + [[]]
    [whole] = [k for k in linked.values() if k.end == tails[0].start]
    assert tails[0] in whole.children
    from offload.cli.stats import longest_chain_tokens

    assert longest_chain_tokens(linked) == ends[-1]


# ---- vLLM's own hit vs ours on the Qwen3-Next-80B geometry (long) ---------------------------------------


@pytest.mark.long
def test_qwen3_next_80b_geometry_restores_what_vllms_own_cache_hits(models_dir, tmp_path):
    """A 3000-token prompt repeated, its next turn (+120 tokens) and a prompt
    sharing its first 2000 tokens, with the flags and unit `kvoffload plan`
    prints for this geometry here (blocks of 640 or 1152 tokens by CPU kind).
    Prints the table: vLLM's own in-process hit vs ours after a restart."""
    from offload.plan.run import plan_for_model

    model = models_dir / "qwen3-next-80b-geometry"
    plan = plan_for_model(model, max_model_len=4096)
    assert plan.prefix_match_unit is not None, plan.prefix_match
    c = plan.hybrid_chunk_size
    rng = random.Random(3000)
    a = random_prompt(rng, 3000)
    prompts = [a, a + random_prompt(rng, 120), a[:2000] + random_prompt(rng, 300)]
    args = {**plan.engine_kwargs, "prefix_match_unit": plan.prefix_match_unit, "max_model_len": 4096,
            "enforce_eager": True}
    rows = check_restores(scenario(str(model), prompts, args, tmp_path, timeout_s=5400), c, len(a))
    print(f"\nQwen3-Next-80B geometry, {c}-token blocks, --prefix-match-unit {plan.prefix_match_unit}:")
    for name, (theirs, ours) in zip(("3000 repeated", "next turn (+120)", "shared 2000"), rows):
        print(f"  {name:<18} vLLM's own cache {theirs:>5}  ours after a restart {ours:>5}")
