"""The "lmcache" tier's data path against real LMCache 0.5.6 objects (no engine,
no mocks): framed payloads round-trip; a missing, damaged or mismatched object
is a ChunkMiss, never garbage; one storage engine per process and options."""

from __future__ import annotations

import pytest
import torch

from offload.config import ConfigError, parse_config
from offload.store.base import ChunkMiss, HostChunk, MissReason, Placement, TierContext
from offload.store.buffers import BufferPool
from offload.store.cachedir.owners import CacheDirs
from offload.store.format import HEADER_LEN
from offload.store.lmcache import LMCacheData, LMCacheOptions, LMCacheTier, open_objects, release_objects
from offload.store.lmcache_objects import object_name
from test_format_store import FP, header, key_of, payload

pytestmark = pytest.mark.filterwarnings("ignore:.*LoggingHandler.*:DeprecationWarning")
OPTS = LMCacheOptions(local_cpu_bytes=8 << 20)


@pytest.fixture
def data():
    dirs = CacheDirs()
    d = LMCacheData(open_objects(dirs, OPTS), OPTS, dirs=dirs)
    yield d
    d.close()


def pooled(p: torch.Tensor) -> HostChunk:
    c = HostChunk.pooled(BufferPool(), p.numel())
    c.payload.copy_(p)
    return c


def test_round_trip_and_skip_existing(data):
    h, p = header(key=key_of("rt")), payload(1)
    assert not data.holds(h, Placement())
    assert data.put(h, pooled(p), Placement())
    assert data.holds(h, Placement())
    assert not data.put(h, pooled(p), Placement()), "an entry stored already is skipped"
    got = data.get(h, Placement(), BufferPool())
    assert torch.equal(got.payload, p)
    got.release()
    # A bare payload (a host-memory slot view, no frame room) is framed first.
    h2 = header(key=key_of("slot"))
    assert data.put(h2, HostChunk(payload(2)), Placement())
    assert torch.equal(data.get(h2, Placement(), BufferPool()).payload, payload(2))


def test_missing_corrupt_and_mismatched_objects_are_misses(data):
    with pytest.raises(ChunkMiss) as e:
        data.get(header(key=key_of("never")), Placement(), BufferPool())
    assert e.value.reason is MissReason.MISSING
    # Damage one payload byte of a stored object, in LMCache's own memory.
    h, p = header(key=key_of("bad")), payload(3)
    data.put(h, pooled(p), Placement())
    name = object_name(FP, h.group, h.key)
    framed = torch.empty(HEADER_LEN + p.numel(), dtype=torch.uint8)
    assert data.objects.get_into(name, framed)
    framed[HEADER_LEN + 10] ^= 0xFF
    damaged = header(key=key_of("bad2"))
    data.objects.put(object_name(FP, damaged.group, damaged.key), framed)  # bad2's name, bad's frame+flip
    with pytest.raises(ChunkMiss) as e:
        data.get(damaged, Placement(), BufferPool())
    assert e.value.reason is MissReason.CORRUPT  # header names another key (and the CRC fails)
    # Right header, flipped payload: CRC.
    good = torch.empty_like(framed)
    data.objects.get_into(name, good)
    good[HEADER_LEN + 5] ^= 1
    h3 = header(key=key_of("crc"))
    raw = good.clone()
    from offload import copier
    from offload.store.format import ChunkHeader
    full = ChunkHeader(**{**h3.__dict__, "payload_crc": copier.crc32c(p)})
    raw[:HEADER_LEN] = torch.frombuffer(bytearray(full.pack()), dtype=torch.uint8)
    data.objects.put(object_name(FP, h3.group, h3.key), raw)
    with pytest.raises(ChunkMiss) as e:
        data.get(h3, Placement(), BufferPool())
    assert e.value.reason is MissReason.CORRUPT and "checksum" in str(e.value)
    # Another length under the same name (another layout): a miss.
    with pytest.raises(ChunkMiss) as e:
        data.get(header(key=key_of("rt"), num_pages=1), Placement(), BufferPool())
    assert e.value.reason in (MissReason.MISSING, MissReason.CORRUPT)


def test_one_engine_per_cache_dirs_and_options():
    dirs = CacheDirs()
    a, b = open_objects(dirs, OPTS), open_objects(dirs, OPTS)
    assert a is b
    other = LMCacheOptions(local_cpu_bytes=4 << 20)
    c = open_objects(dirs, other)
    assert c is not a
    elsewhere = CacheDirs()
    d = open_objects(elsewhere, OPTS)
    assert d is not a, "another CacheDirs shares nothing"
    release_objects(elsewhere, OPTS)
    release_objects(dirs, other)
    release_objects(dirs, OPTS)
    assert OPTS in dirs.engines and dirs.engines.users(OPTS) == 1, "still used once"
    release_objects(dirs, OPTS)
    assert OPTS not in dirs.engines and other not in dirs.engines


def test_separate_worker_processes_keep_a_ledger_in_the_scheduler(ledger_ctx):
    """vLLM-CPU runs its worker in a process of its own: the scheduler's index
    models the worker's pool as an LRU of entry bytes (no engine opened)."""
    ctx, entry = ledger_ctx
    ix = LMCacheTier(LMCacheOptions(local_cpu_bytes=3 * entry), ctx).index(None)
    assert ix.objects is None and ix.ledger is not None
    k = [key_of(str(i)) for i in range(4)]
    assert not ix.contains(0, k[0]) and ix.pin(0, k[0]) is None
    assert ix.reserve(0, k[0], None) == Placement()
    assert ix.reserve(0, k[0], None) is None, "stored already"
    assert ix.contains(0, k[0]) and ix.pin(0, k[0]) == Placement()
    ix.reserve(0, k[1], None), ix.reserve(0, k[2], None)
    ix.pin(0, k[0])  # a read refreshes it: k[1] is now the oldest
    ix.reserve(0, k[3], None)
    assert [ix.contains(0, x) for x in k] == [True, False, True, True]
    assert ix.usage().evictions[0] == 1
    ix.forget(0, k[2])
    assert not ix.contains(0, k[2])
    ix.close()


@pytest.fixture
def ledger_ctx():
    from offload.planner import GroupSpec, HybridOffloadPlanner
    from offload.planner.spec import GroupKind

    planner = HybridOffloadPlanner([GroupSpec(GroupKind.FULL_ATTENTION, 128, 262_144, 2)], 256)  # 2 pages a chunk
    return TierContext(planner, FP, FP, separate_workers=True, dirs=CacheDirs()), HEADER_LEN + 2 * 262_144


@pytest.mark.parametrize("cfg,fragment", [
    ({"store": "lmcache"}, "local_cpu_bytes: required"),
    ({"store": "lmcache", "local_cpu_bytes": 1 << 26, "path": "/x"}, "path: not a key of store 'lmcache'"),
    ({"store": "lmcache", "local_cpu_bytes": 1 << 26, "cpu_bytes": 1 << 26}, "cpu_bytes: not a key"),
    ({"store": "fs", "path": "/x", "remote_url": "redis://a:1"}, "remote_url: only for store 'lmcache'"),
    ({"store": "cpu", "cpu_bytes": 1 << 26, "local_cpu_bytes": 1 << 26}, "local_cpu_bytes: only for store"),
    ({"store": "lmcache", "local_cpu_bytes": 1 << 26, "remote_url": "localhost:6379"}, "remote_url='localhost:6379'"),
    ({"store": "lmcache", "local_cpu_bytes": 5}, "local_cpu_bytes=5"),
    ({"store": "lmcache", "local_cpu_bytes": 1 << 26, "remote_timeout_s": 0}, "remote_timeout_s=0"),
])
def test_lmcache_keys_name_key_value_and_fix(cfg, fragment):
    with pytest.raises(ConfigError) as e:
        parse_config(cfg)
    assert f"kv_connector_extra_config.{fragment}" in str(e.value), str(e.value)


def test_lmcache_options_from_config():
    cfg = parse_config({"store": "lmcache", "local_cpu_bytes": 1 << 26, "remote_url": "redis://127.0.0.1:6379",
                        "remote_timeout_s": 1.5})
    assert cfg.tiers[0].options() == LMCacheOptions(1 << 26, "redis://127.0.0.1:6379", 1.5)
