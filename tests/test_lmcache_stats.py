"""`kvoffload stats --config/--lmcache-url`: an LMCache tier's Redis remote, reported
against what the tier put there.

A real redis-server (started here, as tests/test_lmcache_objects.py does); objects put
through the tier's own data path (`LMCacheData.put` on a real LMCache storage engine
with that remote, then closed, which waits for the write-behind); damage done with
redis-py on the server itself, and each damaged object checked to be a miss for the
tier's own `get` too, so "bad" in the report means what a load would find.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import redis

from harness.cli import run_cli
from offload import cli
from offload.planner import GroupKind
from offload.store.base import ChunkMiss, HostChunk, Placement
from offload.store.buffers import BufferPool
from offload.store.cachedir.owners import CacheDirs
from offload.store.cachedir.paths import LAYOUT_DIR
from offload.store.format import HEADER_LEN, ChunkHeader
from offload.store.lmcache import LMCacheData, LMCacheOptions, open_objects
from offload.store.lmcache_objects import object_name, redis_key
from serving import free_port
from test_format_store import FP, FP2, key_of, payload
from test_lmcache_objects import RedisServer

pytestmark = pytest.mark.filterwarnings("ignore:.*LoggingHandler.*:DeprecationWarning")
REPO = Path(__file__).resolve().parents[1]

# What the tier stores, per fingerprint: (group, kind, num_pages, page_bytes) and the chunks.
MAMBA, ATTN = (0, GroupKind.MAMBA, 1, 1000), (1, GroupKind.FULL_ATTENTION, 3, 4096)
A_CHUNK, B_CHUNK = 256, 128


def chain(fp: bytes, tag: str, n: int, chunk: int, groups, mamba_only_last: bool = False) -> list[ChunkHeader]:
    """n chained chunks of `fp`; with `mamba_only_last`, one more chunk with only its Mamba state."""
    out, parent = [], bytes(8)
    for i in range(n + mamba_only_last):
        key = key_of(f"{tag}/{i}")
        for g, kind, pages, page in groups if i < n else [MAMBA]:
            out.append(ChunkHeader(fp, key, g, kind, i * chunk, (i + 1) * chunk, pages, page, parent=parent))
        parent = key[:8]
    return out


A = chain(FP, "a", 3, A_CHUNK, [MAMBA, ATTN], mamba_only_last=True)  # 4 chunks, 3 complete, 7 objects
B = chain(FP2, "b", 2, B_CHUNK, [(0, GroupKind.FULL_ATTENTION, 2, 512)])  # attention only: 2 objects


def put_through_tier(url: str, headers: list[ChunkHeader]) -> None:
    """The lmcache tier's worker path: frame (header + CRC) and store; close flushes to Redis."""
    opts = LMCacheOptions(local_cpu_bytes=16 << 20, remote_url=url, timeout_s=1.0)
    data = LMCacheData(open_objects(CacheDirs(), opts), opts)
    try:
        for i, h in enumerate(headers):
            chunk = HostChunk.pooled(BufferPool(), h.payload_len)
            chunk.payload.copy_(payload(i, h.payload_len))
            assert data.put(h, chunk, Placement())
    finally:
        data.close()
    assert data.objects.stats.remote_put_failures == 0, data.objects.stats


def get_through_tier(url: str, h: ChunkHeader) -> bool:
    """A fresh engine (empty local pool): the tier's own load, from the remote."""
    opts = LMCacheOptions(local_cpu_bytes=8 << 20, remote_url=url, timeout_s=1.0)
    data = LMCacheData(open_objects(CacheDirs(), opts), opts)
    try:
        data.get(h, Placement(), BufferPool()).release()
        return True
    except ChunkMiss:
        return False
    finally:
        data.close()


def stats(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        rc = cli.main(["stats", *argv])
    except SystemExit as e:
        rc = int(e.code)
    out = capsys.readouterr()
    return rc, out.out, out.err


def json_stats(*argv: str) -> tuple[int, str, str]:
    """`stats` whose output is parsed as JSON: in a process of its own (harness/cli.py), its stdout
    alone (in-process, what this process's engine lanes print would be in it)."""
    r = run_cli("stats", *argv)
    return r.returncode, r.stdout, r.stderr


def expected_groups(headers: list[ChunkHeader]) -> list[dict]:
    groups: dict[int, dict] = {}
    for h in headers:
        g = groups.setdefault(h.group, {"group": h.group, "kind": h.kind.value, "objects": 0, "bytes": 0,
                                        "bad_objects": 0})
        g["objects"] += 1
        g["bytes"] += HEADER_LEN + h.payload_len
    return [groups[g] for g in sorted(groups)]


@pytest.fixture
def redis_server(tmp_path):
    srv = RedisServer(tmp_path)
    srv.start()
    yield srv
    if srv.proc is not None:
        srv.signal(signal.SIGCONT)
        srv.kill()


def config_for(tmp_path: Path, url: str) -> tuple[str, Path]:
    """configs/lmcache-remote.json with its remote and file path pointed here (nothing else changed)."""
    cfg = json.loads((REPO / "configs" / "lmcache-remote.json").read_text())
    lm, fs = cfg["kv_connector_extra_config"]["tiers"]
    lm["remote_url"], fs["path"] = url, str(tmp_path / "files")
    p = tmp_path / "kv.json"
    p.write_text(json.dumps(cfg))
    return str(p), tmp_path / "files"


def test_stats_reports_what_the_tier_put(redis_server, tmp_path, capsys):
    put_through_tier(redis_server.url, A + B)
    cfg, files = config_for(tmp_path, redis_server.url)
    # The file tier of the same stack holds A's layout.json: it names the model.
    lay = files / LAYOUT_DIR / FP.hex()
    lay.mkdir(parents=True)
    (lay / "layout.json").write_text(json.dumps({"model": "/models/tiny", "chunk_size": A_CHUNK, "tp_size": 1,
                                                 "dtype": "torch.bfloat16", "groups": []}))
    redis.Redis.from_url(redis_server.url).set("someone-else", b"x")  # a shared Redis: not ours, counted apart

    rc, out, err = json_stats("--config", cfg, "--json")
    assert rc == 0, err
    rep = json.loads(out)
    assert rep["remote"] == redis_server.url
    by_fp = {d["fingerprint"]: d for d in rep["fingerprints"]}
    assert set(by_fp) == {FP.hex(), FP2.hex()}
    a, b = by_fp[FP.hex()], by_fp[FP2.hex()]
    assert a["groups"] == expected_groups(A) and b["groups"] == expected_groups(B)
    assert (a["objects"], a["bytes"]) == (len(A), sum(HEADER_LEN + h.payload_len for h in A))
    assert (a["chunks"], a["complete_chunks"], a["longest_chain_tokens"]) == (4, 3, 3 * A_CHUNK)
    assert (b["chunks"], b["complete_chunks"], b["longest_chain_tokens"]) == (2, 2, 2 * B_CHUNK)
    assert a["model"] == "/models/tiny" and a["layout_problem"] is None
    assert b["model"] is None and b["chunk_size"] == B_CHUNK and "no layout.json" in b["layout_problem"]
    assert a["bad_objects"] == b["bad_objects"] == 0 and a["problems"] == []
    assert rep["total_objects"] == len(A) + len(B)
    assert rep["total_bytes"] == sum(HEADER_LEN + h.payload_len for h in A + B)
    assert rep["unreadable_objects"] == [] and rep["metadata_only_records"] == 0
    assert rep["other_keys"] == 1 and rep["other_key_schemes"] == {}
    assert rep["server"]["redis_version"] and a["max_idle_s"] is not None

    # The table: the same figures, and the same remote by URL alone.
    rc, out, err = stats(capsys, "--lmcache-url", redis_server.url)
    assert rc == 0, err
    assert f"LMCache remote {redis_server.url} " in out and f"{len(A) + len(B)} objects" in out
    assert f"{FP.hex()[:16]}…" in out and f"{FP2.hex()[:16]}…" in out
    rows = [ln.split() for ln in out.splitlines() if ln.startswith("  g") and ln.split()[0][1:].isdigit()]
    assert rows[0][:3] == ["g0", "mamba", "4"] and rows[1][:3] == ["g1", "full_attention", "3"], out
    assert "chunks 4 (3 complete), longest chain 768 tokens" in out


def test_stats_finds_what_a_load_would_refuse(redis_server, capsys):
    put_through_tier(redis_server.url, A)
    r = redis.Redis.from_url(redis_server.url)
    k = [redis_key(object_name(FP, h.group, h.key)) for h in A]
    r.setrange(k[0] + "kv_bytes", 20, b"\xff")  # header byte: its CRC fails, its fingerprint unknown
    r.set(k[1] + "kv_bytes", r.get(k[1] + "kv_bytes")[:-10])  # truncated
    r.delete(k[2] + "metadata")  # LMCache cannot see it
    r.delete(k[3] + "kv_bytes")  # bytes gone (as when Redis evicts them): the metadata record remains
    r.set(k[4] + "kv_bytes", r.get(k[5] + "kv_bytes"))  # another object's bytes under this key
    r.set(k[4] + "metadata", r.get(k[5] + "metadata"))
    r.set(k[5] + "metadata", r.get(k[6] + "metadata"))  # a metadata record of another length
    r.set("kvoffload-k2@1@0@abc@uint8kv_bytes", b"later scheme")
    rc, out, err = json_stats("--lmcache-url", redis_server.url, "--json")
    assert rc == 0, err
    rep = json.loads(out)
    [a] = rep["fingerprints"]
    [u] = rep["unreadable_objects"]
    assert u["key"] == k[0] + "kv_bytes" and "header" in u["problem"] and u["bytes"] == HEADER_LEN + A[0].payload_len
    problems = {p["key"]: p["problem"] for p in a["problems"]}
    assert set(problems) == {k[i] + "kv_bytes" for i in (1, 2, 4, 5)}, problems
    assert "truncated" in problems[k[1] + "kv_bytes"]
    assert "metadata record does not describe" in problems[k[5] + "kv_bytes"]
    assert "no LMCache metadata record" in problems[k[2] + "kv_bytes"]
    assert "another object" in problems[k[4] + "kv_bytes"]
    assert rep["metadata_only_records"] == 1
    assert a["objects"] == len(A) - 2 and a["bad_objects"] == 4  # k0 has no fingerprint, k3 no bytes
    assert sum(g["bad_objects"] for g in a["groups"]) == 4
    assert rep["other_key_schemes"] == {"kvoffload-k2": 1} and rep["other_keys"] == 0
    # Only good objects make chunks: chunk 3's Mamba state (no attention: not complete).
    assert (a["chunks"], a["complete_chunks"]) == (1, 0)

    rc, out, _ = stats(capsys, "--lmcache-url", redis_server.url)
    assert "unreadable objects 1 (header does not verify), metadata-only records 1" in out
    assert out.count("  bad g") == 4 and "note: 1 keys under kvoffload-k2@" in out

    # The tier's own loads agree (after the reports: LMCache deletes a metadata-only record on a get).
    for h in A[:6]:
        assert not get_through_tier(redis_server.url, h), f"the tier loaded damaged object {A.index(h)}"
    assert get_through_tier(redis_server.url, A[6]), "an undamaged object still loads"


def test_unreachable_or_hung_remote_exits_2_naming_the_url(redis_server, tmp_path):
    """The console entry point itself: exit status 2, one line naming the URL, no traceback."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    down = f"redis://127.0.0.1:{free_port()}"
    p = run_cli("stats", "--lmcache-url", down, env=env, timeout_s=120)
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr and p.stdout == ""
    assert f"cannot read the LMCache remote {down}" in p.stderr and "--lmcache-url" in p.stderr, p.stderr
    # A hung server (SIGSTOP): bounded by --timeout, then the same kind of error.
    redis_server.signal(signal.SIGSTOP)
    t0 = time.monotonic()
    p = run_cli("stats", "--lmcache-url", redis_server.url, "--timeout", "1", env=env, timeout_s=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert f"{redis_server.url} within 1 s (--timeout)" in p.stderr, p.stderr
    print(f"hung server: exit 2 after {time.monotonic() - t0:.1f} s, import included")


def test_config_without_a_readable_remote_is_a_usage_error(capsys, tmp_path):
    for name, fragment in (("fs.json", 'no tier with "store": "lmcache"; its file tiers: `kvoffload stats'),
                           ("lmcache-fs.json", "has no remote_url")):
        rc, _, err = stats(capsys, "--config", str(REPO / "configs" / name))
        assert rc == 2 and fragment in err, err
    cfg = str(REPO / "configs" / "lmcache-remote.json")
    rc, _, err = stats(capsys, "--config", cfg, "--lmcache-url", "redis://elsewhere:6379")
    assert rc == 2 and "not a remote_url of --config" in err and "redis://127.0.0.1:6379" in err, err
    rc, _, err = stats(capsys, str(tmp_path), "--config", cfg)
    assert rc == 2 and "not both" in err
    rc, _, err = stats(capsys)
    assert rc == 2 and "--lmcache-url" in err
    rc, _, err = stats(capsys, "--lmcache-url", "lm://127.0.0.1:65000")
    assert rc == 2 and "Redis remotes" in err
    rc, _, err = stats(capsys, "--lmcache-url", "redis://:s3cret@127.0.0.1:9")
    assert rc == 2 and "redis://:***@127.0.0.1:9" in err and "s3cret" not in err, err
