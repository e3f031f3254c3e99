"""`kvoffload` commands on real engines and on the files a real engine wrote.

Engine starts in this module: 2 (warmup --verify, shared by every test as
the module's cold cache) + 1 (a restart after gc), and the session's OpenAI
server for warmup --url (tests/conftest.py `fs_server`, started while
warmup --verify runs). stats, fsck and gc run on copies of the cache warmup
filled; what they should find is derived independently, from the prompts'
chunk keys (offload.keys) and the files on disk.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from pathlib import Path

import pytest

from conftest import CHUNK, engine_args, fs_kv_config, layouts, random_prompt, shipped_config
from harness.cli import run_cli
from harness.client import wait_until
from harness.engine import RunSpec, run_engine
from offload.cli.prompts import load, token_ids
from offload.keys import chunk_keys, request_root, tail_key
from offload.store.cachedir.paths import LAYOUT_DIR
from offload.store.format import HEADER_LEN, ChunkHeader

pytestmark = [pytest.mark.e2e, pytest.mark.long]  # `make test` stays within 12 minutes (docs/development.md)

GDN, ATTN = 0, 1  # Qwen3-Next groups: GDN state, full attention
rng = random.Random(4004)
_S = random_prompt(rng, 2 * CHUNK)
TOKEN_PROMPTS = [_S + random_prompt(rng, 300), _S + random_prompt(rng, 150),  # share chunks 0-1
                 random_prompt(rng, 900), random_prompt(rng, 700)]  # P2, P3: several chunks each
TEXT = "".join(rng.choice("abcdefghij klmnopqrstuvwxyz") for _ in range(800))


def cli_run(*argv: str) -> tuple[int, str]:
    """`kvoffload ARGV` in a process of its own (harness/cli.py): its standard output alone, and the
    end of its standard error where it failed. Never in-process: this process's engine lanes
    (tests/conftest.py) print to the same stdout, and a vLLM warning inside `--json` output breaks
    its parse."""
    r = run_cli(*argv)
    return r.returncode, r.stdout + (r.stderr[-4000:] if r.returncode else "")


@pytest.fixture(scope="module")
def warm(models_dir, tmp_path_factory, fs_server):
    """`kvoffload warmup --verify` on the tiny hybrid model: the module's cold cache."""
    fs_server.prestart()  # for warmup --url: its start overlaps these engine runs
    d = tmp_path_factory.mktemp("warm")
    model = str(models_dir / "qwen3-next-tiny")
    cfg = d / "kv.json"
    # The shipped stack (host memory over files, so run 2 warm-starts: its figures are in the report).
    # Every state hot: gc's order here is the LRU chains' alone. Under the default policy internal
    # states are stored cold and gc takes them first (tests/test_cli.py, tests/test_ledger.py).
    kv = shipped_config("hybrid-tiered.json", d / "cache")
    kv["kv_connector_extra_config"]["state_policy"] = "all"
    cfg.write_text(json.dumps(kv))
    prompts = d / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in TOKEN_PROMPTS)
                       + json.dumps({"prompt": TEXT}) + "\n")
    rc, out = cli_run("warmup", "--config", str(cfg), "--prompts", str(prompts), "--model", model, "--verify",
                      "--json")
    snapshot = tmp_path_factory.mktemp("snapshot")
    shutil.copytree(d / "cache", snapshot, dirs_exist_ok=True)
    return {"rc": rc, "out": out, "model": model, "snapshot": snapshot, "ids": token_ids(load(prompts), model),
            "unit": json.loads(out)["prefix_match_unit"] if rc == 0 else None}


def copy_cache(warm, tmp_path) -> Path:
    dst = tmp_path / "cache"
    shutil.copytree(warm["snapshot"], dst)
    return dst


def fp_dir(cache: Path) -> tuple[Path, dict]:
    [(name, lay)] = list(layouts(cache).items())
    return cache / LAYOUT_DIR / name, lay


def files_of(cache: Path, prompt: list[int], group: int) -> list[Path]:
    """The (chunk, group) file paths of every full chunk of `prompt`, from its keys."""
    root, lay = fp_dir(cache)
    keys = chunk_keys(request_root(bytes.fromhex(lay["base_fingerprint"])), prompt, CHUNK)
    return [root / f"g{group}" / k.hex()[:2] / f"{k.hex()}.kv" for k in keys]


def tail_file(cache: Path, prompt: list[int], group: int, unit: int | None) -> Path | None:
    """The file of `prompt`'s partial tail (a hybrid: one entry per group, at the last
    unit-aligned boundary before its last token), or None where that boundary is a chunk's."""
    if unit is None or (t := (len(prompt) - 1) // unit * unit) % CHUNK == 0:
        return None
    root, lay = fp_dir(cache)
    c = t // CHUNK
    base = request_root(bytes.fromhex(lay["base_fingerprint"]))
    parent = chunk_keys(base, prompt, CHUNK)[c - 1] if c else base
    k = tail_key(parent, prompt[c * CHUNK:t])
    return root / f"g{group}" / k.hex()[:2] / f"{k.hex()}.kv"


def restorable(cache: Path, prompt: list[int]) -> int:
    """Tokens a lookup can restore from the files present: the longest n with
    attention chunks 0..n-1 and the GDN state at n, at most len - 1."""
    attn, gdn = files_of(cache, prompt, ATTN), files_of(cache, prompt, GDN)
    best = 0
    for n in range(1, (len(prompt) - 1) // CHUNK + 1):
        if not attn[n - 1].exists():
            break
        if gdn[n - 1].exists():
            best = n * CHUNK
    return best


def dir_bytes(cache: Path) -> int:
    """What a byte budget counts: everything but the ledger (gc appends its own records there)."""
    return sum(p.stat().st_size for p in cache.rglob("*") if p.is_file() and "ledger-v1" not in p.parts)


# ---- warmup --verify -------------------------------------------------------------------


def test_warmup_verify_restores_every_chunk_aligned_prefix_after_a_restart(warm):
    out = warm["out"]
    assert warm["rc"] == 0, out
    rep = json.loads(out)
    assert rep["verify"] == {"ok": True, "problems": []}, rep["verify"]
    assert rep["cross_restart_hit_rate"] >= rep["expected_hit_rate"] > 0.5, out
    [after] = [r for r in rep["runs"] if r["label"] == "2 after restart"]
    assert after["failed_loads"] == 0, f"no load failures: {after}"
    assert after["identical"] == [5, 5], after
    # Run 2's engine started on the files run 1 left: warm start copied them into host memory, every
    # planned entry verified and settled, and later prompts' loads read warmed entries.
    w = after["warm_start"]
    assert w is not None, f"run 2 reports no warm start: {after}"
    assert w["planned_entries"] > 0 and w["entries"] == w["planned_entries"] and w["failures"] == 0, w
    assert w["done"] == 1 and w["seconds"] > 0 and w["bytes"] > 0 and w["hits"] > 0, w
    assert after["restored_by_tier"]["cpu"] > 0, after
    [first] = [r for r in rep["runs"] if r["label"] == "1"]
    assert "warm_start" not in first, "run 1 started on an empty directory: only run 2 reports warm start"
    for ids in warm["ids"]:  # every prompt was stored whole, text included
        assert all(f.exists() for f in files_of(warm["snapshot"], ids, ATTN)), "attention chunks stored"


# ---- stats -----------------------------------------------------------------------------


def test_stats_counts_match_the_files_and_the_prompts_keys(warm):
    cache = warm["snapshot"]
    rc, out = cli_run("stats", str(cache), "--json")
    assert rc == 0
    rep = json.loads(out)
    [d] = rep["fingerprints"]
    kv = sorted(cache.rglob("*.kv"))
    assert d["files"] == len(kv) and d["bytes"] == sum(f.stat().st_size for f in kv)
    assert d["model"].endswith("qwen3-next-tiny") and d["chunk_size"] == CHUNK
    groups = {g["group"]: g for g in d["groups"]}
    assert groups[GDN]["kind"] == "mamba" and groups[ATTN]["kind"] == "full_attention"
    attn_keys = {f for ids in warm["ids"] for f in files_of(cache, ids, ATTN)}
    attn_keys |= {f for ids in warm["ids"] if (f := tail_file(cache, ids, ATTN, warm["unit"]))}
    assert groups[ATTN]["files"] == len(attn_keys)  # shared chunks are stored once
    assert set((fp_dir(cache)[0] / f"g{ATTN}").rglob("*.kv")) == attn_keys
    assert d["chunks"] == len({f.stem for f in kv})
    assert d["longest_chain_tokens"] == max(len(p) // CHUNK for p in warm["ids"]) * CHUNK
    assert d["quarantined_files"] == 0 and d["tmp_files"] == 0
    rc, table = cli_run("stats", str(cache))
    assert rc == 0 and d["fingerprint"][:16] in table and "full_attention" in table


# ---- fsck ------------------------------------------------------------------------------


def test_fsck_finds_each_fault_and_repair_fixes_it(warm, tmp_path):
    cache = copy_cache(warm, tmp_path)
    rc, out = cli_run("fsck", str(cache))
    assert rc == 0 and "clean" in out, out

    shared0 = files_of(cache, TOKEN_PROMPTS[0], ATTN)[0]  # chunk 0 of the shared prefix: has descendants
    raw = bytearray(shared0.read_bytes())
    raw[-1] ^= 0xFF  # payload byte
    shared0.write_bytes(raw)
    p3_state = files_of(cache, TOKEN_PROMPTS[3], GDN)[0]
    with open(p3_state, "r+b") as f:
        f.truncate(p3_state.stat().st_size - 100)
    p2_attn = files_of(cache, TOKEN_PROMPTS[2], ATTN)[2]  # last chunk: no descendants
    raw = bytearray(p2_attn.read_bytes())
    raw[90] ^= 0x01  # header byte (token_end)
    p2_attn.write_bytes(raw)
    old_tmp = p2_attn.with_name(p2_attn.name + ".tmp.4242.0badc0de")
    old_tmp.write_bytes(b"x" * 100)
    os.utime(old_tmp, (time.time() - 7200, time.time() - 7200))
    fresh_tmp = p2_attn.with_name(p2_attn.name + f".tmp.{os.getpid()}.00c0ffee")  # its writer (this process) lives
    fresh_tmp.write_bytes(b"y")
    root, _ = fp_dir(cache)
    stray_chunk = files_of(cache, TOKEN_PROMPTS[3], ATTN)[1]
    foreign = root.parent / ("ab" * 32) / "g1" / stray_chunk.parent.name
    foreign.mkdir(parents=True)
    shutil.copy(stray_chunk, foreign)  # a fingerprint directory without layout.json
    (root / "notes.txt").write_text("hello")

    rc, out = cli_run("fsck", str(cache))
    assert rc == 1, out
    lines = out.splitlines()

    def listed(kind: str, path: Path) -> bool:
        return any(ln.startswith(kind) and str(path) in ln for ln in lines)

    assert listed("corrupt", shared0) and "payload checksum" in out
    assert listed("corrupt", p3_state) and "truncated" in out
    assert listed("corrupt", p2_attn) and "header checksum" in out
    assert listed("orphaned-tmp", old_tmp) and not any(str(fresh_tmp) in ln for ln in lines)
    assert listed("unknown-layout", root / "notes.txt")
    assert listed("unknown-layout", foreign / stray_chunk.name) and "unknown layout: no layout.json" in out
    # Everything that chains from the corrupt shared chunk 0 sits below a hole.
    for p in TOKEN_PROMPTS[:2]:
        for f in files_of(cache, p, ATTN)[1:]:
            assert listed("chain-hole", f), f
    assert "1 temporary files in flight" in out
    assert shared0.exists() and old_tmp.exists(), "fsck without --repair changes nothing"

    rc, out = cli_run("fsck", str(cache), "--repair")
    assert rc == 3, out
    assert not shared0.exists() and not p3_state.exists() and not old_tmp.exists() and fresh_tmp.exists()
    q = sorted(p.name for p in (root / "quarantine").iterdir())
    assert any(n.startswith(shared0.name) for n in q) and any(n.startswith(p3_state.name) for n in q)
    assert any(n.startswith("notes.txt") for n in q)
    assert not any(f.exists() for p in TOKEN_PROMPTS[:2] for f in files_of(cache, p, ATTN)[1:])
    rc, out = cli_run("fsck", str(cache))
    assert rc == 0, out


# ---- gc, then a restart ------------------------------------------------------------------


def test_gc_evicts_lru_chains_deepest_first_and_a_restart_restores_what_is_left(warm, tmp_path):
    cache = copy_cache(warm, tmp_path)
    ids = warm["ids"]
    now = time.time()
    for f in cache.rglob("*.kv"):
        os.utime(f, (now - 10, now - 10))
    p2 = [f for g in (ATTN, GDN) for f in files_of(cache, TOKEN_PROMPTS[2], g) if f.exists()]
    p3 = [f for g in (ATTN, GDN) for f in files_of(cache, TOKEN_PROMPTS[3], g) if f.exists()]
    for f in p2:
        os.utime(f, (now - 5000, now - 5000))  # least recently used
    for f in p3:
        os.utime(f, (now - 1000, now - 1000))  # next
    total = dir_bytes(cache)

    # 1. Room for everything but P2: exactly P2's chunks go.
    rc, out = cli_run("gc", str(cache), "--max-bytes", str(total - sum(f.stat().st_size for f in p2)))
    assert rc == 0, out
    assert not any(f.exists() for f in p2)
    assert all(f.exists() for f in p3)
    # 2. One byte less: one more chunk, P3's deepest (its descendant goes before chunk 0).
    limit = dir_bytes(cache) - 1
    rc, out = cli_run("gc", str(cache), "--max-bytes", str(limit))
    assert rc == 0 and dir_bytes(cache) <= limit, out
    p3_attn, p3_gdn = files_of(cache, TOKEN_PROMPTS[3], ATTN), files_of(cache, TOKEN_PROMPTS[3], GDN)
    assert all(f.exists() for f in p3_attn[:-1]) and p3_gdn[-2].exists() and not p3_attn[-1].exists()
    assert not p3_gdn[-1].exists()
    assert "1 least recently used chunks" in out
    # 3. Everything left is prefix-closed along every prompt's chain.
    for p in ids:
        present = [f.exists() for f in files_of(cache, p, ATTN)]
        assert present == sorted(present, reverse=True), "no hole in a chain"
    rc, out = cli_run("fsck", str(cache))
    assert rc == 0, out

    expect = [restorable(cache, p) for p in ids]
    p3_left = (len(ids[3]) - 1) // CHUNK * CHUNK - CHUNK  # all but its deepest chunk
    assert expect[2] == 0 and expect[3] == p3_left and expect[0] == (len(ids[0]) - 1) // CHUNK * CHUNK
    run = run_engine(RunSpec(warm["model"], ids, fs_kv_config(cache), max_tokens=4,
                             engine_args=engine_args(True)), env={"PYTHONHASHSEED": "5"})
    for i, (r, e) in enumerate(zip(run.results, expect)):
        assert not r.load_failed, f"prompt {i}: a hit gc left unrestorable"
        assert r.cached_tokens >= e, (i, r, e)
    assert run.results[3].restored_tokens == p3_left and run.results[2].restored_tokens == 0
    assert run.results[0].restored_tokens == expect[0]


def test_gc_without_parent_links_evicts_later_positions_first_and_leaves_no_hole(warm, tmp_path):
    """Files written before the header carried the parent link: gc cannot tell
    chains apart, so a chunk goes only after every chunk at a later position."""
    cache = copy_cache(warm, tmp_path)
    for f in cache.rglob("*.kv"):
        raw = f.read_bytes()
        h = ChunkHeader.unpack(raw[:HEADER_LEN])
        assert h.token_start == 0 or h.parent != bytes(8), "the engine wrote parent links"
        f.write_bytes(ChunkHeader(**{**h.__dict__, "parent": bytes(8)}).pack() + raw[HEADER_LEN:])
    rc, out = cli_run("fsck", str(cache))
    assert rc == 0, out
    now = time.time()
    for f in cache.rglob("*.kv"):
        os.utime(f, (now - 10, now - 10))
    for g in (ATTN, GDN):  # P2's chunk 0 is the least recently used file of all
        os.utime(files_of(cache, TOKEN_PROMPTS[2], g)[0], (now - 9000, now - 9000))
    ids = warm["ids"]
    total = dir_bytes(cache)
    for frac in (0.8, 0.5, 0.3):
        rc, out = cli_run("gc", str(cache), "--max-bytes", str(int(total * frac)))
        assert rc == 0, out
        for p in ids:
            present = [f.exists() for f in files_of(cache, p, ATTN)]
            assert present == sorted(present, reverse=True), f"hole at {frac}: {present}"
        if not files_of(cache, TOKEN_PROMPTS[2], ATTN)[0].exists():
            later = [f for p in ids for f in files_of(cache, p, ATTN)[1:] if f.exists()]
            assert not later, "a chunk went while chunks at later positions stayed"
        rc, out = cli_run("fsck", str(cache))
        assert rc == 0, out
    assert not files_of(cache, TOKEN_PROMPTS[2], ATTN)[2].exists()


# ---- warmup --url ----------------------------------------------------------------------


def test_warmup_url_replays_text_and_token_prompts_through_a_running_server(fs_server, tmp_path):
    """On the session's server (fs tier, --enable-prompt-tokens-details): these prompts are its own."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": TEXT}) + "\n"
                       + json.dumps({"prompt_token_ids": TOKEN_PROMPTS[3]}) + "\n")
    url = fs_server.url()
    rc, out = cli_run("warmup", "--prompts", str(prompts), "--url", url, "--json")
    assert rc == 0, out
    first = json.loads(out)
    rc, out = cli_run("warmup", "--prompts", str(prompts), "--url", url, "--json")
    assert rc == 0, out
    second = json.loads(out)
    assert first["prompts"] == 2
    assert first["prompt_tokens"] > len(TOKEN_PROMPTS[3])  # the server tokenized the text prompt
    cached1, cached2 = first["cached_tokens"], second["cached_tokens"]
    # The second pass finds both prompts' chunk-aligned prefixes (vLLM's cache or the tier).
    assert cached2 > cached1 and cached2 >= (len(TOKEN_PROMPTS[3]) - 1) // CHUNK * CHUNK, (first, second)
    assert "fs" in first["restored_by_tier"], first
    # The server's worker stored the prompts' chunks (it keeps running: its stores may still be in flight).
    wait_until(lambda: all(f.exists() for f in files_of(fs_server.cache, TOKEN_PROMPTS[3], ATTN)), 60,
               "the server storing the prompt's chunks", interval_s=0.5)
