"""Opaque byte objects in LMCache's storage engine (the data path of the "lmcache" tier).

Our planner decides the per-(chunk, group) payloads and their names exactly as for
files; this module only moves those bytes in and out of LMCache 0.5.6's storage
engine, driven standalone on CPU: a `StorageManager` built from an
`LMCacheEngineConfig` (LMCache's own settings: local CPU size, optional remote URL)
holding a `LocalCPUBackend` (an LRU pool of `MemoryObj`s) and, with a remote URL,
a `RemoteBackend` (write-behind, read-through). No vLLM connector, no GPU
connector, no LMCache cache engine. See docs/lmcache.md.

Guarantees: `put` copies the payload's bytes exactly (a uint8 `MemoryObj` of
shape [1, 1, n, 1] in `MemoryFormat.KV_2LTD` from the local pool: 1 byte per
"token", so nothing is converted; the remote keeps length, shape and dtype in its
metadata record); `contains` and `get_into` answer False on a miss,
on an evicted object, on a stored object of another length, and on any remote
error or outage (LMCache logs and swallows those; we swallow whatever escapes):
they never raise for a backend failure. Checking what came back (header, CRC) is
the caller's job, as for files.

Key mapping, scheme 1 (`KEY_SCHEME`): an object name (any string; the tier uses
`object_name(fingerprint, group, key)`) becomes
`CacheEngineKey(model_name="kvoffload-k1", world_size=1, worker_id=0,
chunk_hash=int(sha256(name)), dtype=torch.uint8)`, whose string form (the Redis key
prefix) is `kvoffload-k1@1@0@<sha256 hex, leading zeros dropped>@uint8`. The TP rank and the layout are in the
fingerprint, hence in the name, so world_size/worker_id stay fixed. A change of
this mapping bumps `KEY_SCHEME`, which changes model_name, so objects written
under another scheme are simply never found.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import math
import os
import threading
import time
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import torch

# Before LMCache's first import: no usage telemetry from a library we drive
# standalone, and LMCache's per-operation warnings (each eviction, each failed remote
# call: we count those in `stats`) off unless asked for.
os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")

KEY_SCHEME = 1
MODEL_NAME = f"kvoffload-k{KEY_SCHEME}"
LMCACHE_VERSION = "0.5.6"
# LMCache's chunk_size only sizes KV-shaped allocations, which we never make.
_CHUNK_SIZE = 256


def _shape(n: int) -> torch.Size:
    """A payload of n bytes as LMCache's KV_2LTD [kv, layers, tokens, hidden] = [1, 1, n, 1]:
    4-D, as LMCache's remote metadata and token counting expect."""
    return torch.Size([1, 1, n, 1])


def object_name(fingerprint: bytes, group: int, key: bytes) -> str:
    """The name of one (chunk, group) payload: `<fingerprint hex>/<group>/<chunk key hex>`."""
    return f"{fingerprint.hex()}/{group}/{key.hex()}"


def lmcache_key(name: str):
    """LMCache's key for an object name (scheme `KEY_SCHEME`, see the module docstring)."""
    from lmcache.utils import CacheEngineKey

    chunk_hash = int.from_bytes(hashlib.sha256(name.encode()).digest(), "big")
    return CacheEngineKey(MODEL_NAME, 1, 0, chunk_hash, torch.uint8)


def redis_key(name: str) -> str:
    """The Redis key prefix LMCache 0.5.6's RedisConnector stores `name` under: it keeps
    `<prefix>kv_bytes` (the object's bytes) and `<prefix>metadata` (`remote_metadata`)."""
    return lmcache_key(name).to_string()


REDIS_SUFFIXES = ("kv_bytes", "metadata")


@functools.lru_cache(maxsize=256)
def remote_metadata(n: int) -> bytes:
    """The metadata record LMCache's remote connector writes beside an n-byte object of ours
    (its `RemoteMetadata`: length, memory format, dtype, 4-D shape), for readers that check it."""
    from lmcache.v1.memory_management import MemoryFormat
    from lmcache.v1.protocol import RemoteMetadata, init_remote_metadata_info

    init_remote_metadata_info(1)  # what every connector of ours sets: one KV group (uint8 bytes)
    return RemoteMetadata(n, [_shape(n)], [torch.uint8], MemoryFormat.KV_2LTD).serialize()


def remote_url_with_timeouts(url: str, timeout_s: float) -> str:
    """Bound every Redis socket operation: redis-py waits forever by default.

    For `redis://`/`rediss://` URLs, adds `socket_timeout` and
    `socket_connect_timeout` (redis-py reads both from the URL's query) unless
    the URL sets them. Other URLs are returned unchanged.
    """
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss"):
        return url
    query = dict(parse_qsl(parts.query))
    query.setdefault("socket_timeout", f"{timeout_s:g}")
    query.setdefault("socket_connect_timeout", f"{timeout_s:g}")
    return urlunsplit(parts._replace(query=urlencode(query)))


@dataclass
class ObjectStats:
    puts: int = 0
    put_failures: int = 0  # no room in the local pool (nothing evictable), or an error
    remote_put_failures: int = 0  # write-behind to the remote failed for good (every attempt, or evicted first)
    remote_put_retries: int = 0  # failed remote writes tried again from the local copy
    local_hits: int = 0
    remote_hits: int = 0
    misses: int = 0
    errors: int = 0  # exceptions that escaped LMCache (answered as misses)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + n)


# A remote write is tried this many times in all before it counts as failed.
REMOTE_PUT_ATTEMPTS = 3


class LMCacheObjects:
    """Byte payloads under our names in LMCache's storage engine. Thread-safe."""

    def __init__(self, manager, local_cpu_bytes: int, remote_url: str | None, timeout_s: float) -> None:
        self._sm = manager
        self.local_cpu_bytes = local_cpu_bytes
        self.remote_url = remote_url
        self.timeout_s = timeout_s
        self.stats = ObjectStats()
        self._local = manager.storage_backends["LocalCPUBackend"]
        self._remotes = [b for n, b in manager.storage_backends.items() if n != "LocalCPUBackend"]
        self._pending: set[Future] = set()
        self._retry: dict[tuple[str, int], int] = {}  # (name, remote index) -> attempts made
        self._lock = threading.Lock()
        self._closed = False

    @classmethod
    def open(cls, local_cpu_bytes: int, remote_url: str | None = None, *, timeout_s: float = 2.0,
             extra_config: dict | None = None) -> LMCacheObjects:
        """Start a storage engine: a local CPU pool of `local_cpu_bytes` and, with
        `remote_url` (e.g. `redis://127.0.0.1:6379`), LMCache's remote backend.

        `timeout_s` bounds a remote get (LMCache's `blocking_timeout_secs`, whole
        seconds, at least 1) and, for Redis, every socket operation.
        `extra_config` is passed through as LMCache's `extra_config`.
        Raises if LMCache cannot be imported or configured: that is a setup error.
        """
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.event_manager import EventManager
        from lmcache.v1.metadata import LMCacheMetadata
        from lmcache.v1.storage_backend.storage_manager import StorageManager

        if local_cpu_bytes <= 0:
            raise ValueError("LMCache's remote backend buffers through the local CPU pool: local_cpu_bytes must be > 0")
        url = remote_url_with_timeouts(remote_url, timeout_s) if remote_url else None
        config = LMCacheEngineConfig.from_defaults(
            chunk_size=_CHUNK_SIZE,
            local_cpu=True,
            max_local_cpu_size=local_cpu_bytes / 2**30,  # LMCache counts GiB
            local_disk=None,
            max_local_disk_size=0,
            remote_url=url,
            remote_serde="naive",
            blocking_timeout_secs=max(1, math.ceil(timeout_s)),
            extra_config=extra_config,
        )
        metadata = LMCacheMetadata(
            model_name=MODEL_NAME, world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
            kv_dtype=torch.uint8, kv_shape=(1, 1, _CHUNK_SIZE, 1, 1), role="worker",
        )
        # LMCache's PrometheusLogger sets PROMETHEUS_MULTIPROC_DIR=/tmp/lmcache_prometheus in this
        # process's environment: every process it then starts (an API server, vLLM's workers)
        # would share that host-wide directory, and a server's /metrics would sum the counters
        # of every other engine on the host. Its own metrics do not need it (prometheus_client
        # chose its value class when vLLM imported it), so the environment is put back.
        before = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        try:
            manager = StorageManager(config, metadata, EventManager())
        finally:
            if before is None:
                os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
            else:
                os.environ["PROMETHEUS_MULTIPROC_DIR"] = before
        if remote_url and len(manager.storage_backends) < 2:
            manager.close()
            raise RuntimeError(f"LMCache did not create a remote backend for {remote_url!r}")
        return cls(manager, local_cpu_bytes, remote_url, timeout_s)

    # ---- writes --------------------------------------------------------------------

    def put(self, name: str, payload: torch.Tensor) -> bool:
        """Store a copy of `payload` (uint8, CPU) under `name`: synchronously in the
        local pool (evicting least-recently-used objects to make room), then
        write-behind to the remote, if any. False if the local pool has no room
        (all of it in use) or the engine failed; never raises for a backend failure.
        An object already in the local pool is left as it is (True).
        """
        if payload.dtype != torch.uint8 or payload.device.type != "cpu":
            raise TypeError(f"payload must be a CPU uint8 tensor, got {payload.dtype} on {payload.device}")
        flat = payload.reshape(-1)
        n = flat.numel()
        if n == 0:
            raise ValueError("empty payload")
        if self._closed:
            return False
        try:
            from lmcache.v1.memory_management import MemoryFormat

            key = lmcache_key(name)
            if self._local.contains(key):
                return True
            obj = self._local.allocate(_shape(n), torch.uint8, fmt=MemoryFormat.KV_2LTD,
                                       eviction=True, busy_loop=False)
            if obj is None:
                self.stats.add("put_failures")
                return False
            try:
                obj.tensor.view(-1).copy_(flat)
                self._local.submit_put_task(key, obj)
                for i, remote in enumerate(self._remotes):
                    fut = remote.submit_put_task(key, obj)
                    if fut is not None:
                        self._track(fut, name, i, 1)
            finally:
                obj.ref_count_down()
            self.stats.add("puts")
        except Exception:
            self.stats.add("put_failures")
            self.stats.add("errors")
            return False
        self._retry_failed()
        return True

    def _track(self, fut: Future, name: str, remote: int, attempt: int) -> None:
        with self._lock:
            self._pending.add(fut)

        def done(f: Future) -> None:
            failed = f.cancelled() or f.exception() is not None
            with self._lock:
                self._pending.discard(f)
                retry = failed and attempt < REMOTE_PUT_ATTEMPTS and not self._closed
                if retry:
                    self._retry[(name, remote)] = attempt
            if failed and not retry:
                self.stats.add("remote_put_failures")

        fut.add_done_callback(done)

    def _retry_failed(self) -> None:
        """Submit again the remote writes that failed, from the local pool's copy: a remote
        write fails on a transient fault too (a socket timeout on a busy host, a connection
        that a server restart broke), and a lost write-behind is a lost hit for every other
        instance. Called from `put` and `flush`, so no thread of its own waits to retry."""
        with self._lock:
            if not self._retry:
                return
            todo, self._retry = self._retry, {}
        for (name, i), attempt in todo.items():
            key = lmcache_key(name)
            try:
                obj = self._local.get_blocking(key)
            except Exception:
                obj = None
            if obj is None:  # evicted from the local pool meanwhile: nothing left to write
                self.stats.add("remote_put_failures")
                continue
            try:
                fut = self._remotes[i].submit_put_task(key, obj)
                self.stats.add("remote_put_retries")
                if fut is not None:
                    self._track(fut, name, i, attempt + 1)
            except Exception:
                self.stats.add("remote_put_failures")
                self.stats.add("errors")
            finally:
                obj.ref_count_down()

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait for the remote writes submitted so far, failed ones tried again (up to
        REMOTE_PUT_ATTEMPTS in all); True if all finished in time (finished includes
        failed for good: see `stats.remote_put_failures`)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            self._retry_failed()
            with self._lock:
                pending, retry = list(self._pending), bool(self._retry)
            if not pending and not retry:
                return True
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            if pending:
                _, not_done = wait_futures(pending, timeout=left)
                if not_done:
                    return False
            else:  # a completed write's callback has not run yet
                time.sleep(0.001)

    # ---- reads ---------------------------------------------------------------------

    def contains(self, name: str) -> bool:
        """Is `name` in the local pool or on the remote? False on a remote error."""
        if self._closed:
            return False
        try:
            key = lmcache_key(name)
            if self._local.contains(key):
                return True
            return any(remote.contains(key) for remote in self._remotes)
        except Exception:
            self.stats.add("errors")
            return False

    def get_into(self, name: str, out: torch.Tensor) -> bool:
        """Copy the object `name` into `out` (contiguous CPU uint8 of exactly the
        stored length). False, with `out` unspecified, on a miss, on a stored object
        of another length, or on a remote error; never raises for a backend failure.
        A remote hit is also kept in the local pool (LMCache's read-through).
        """
        if out.dtype != torch.uint8 or out.device.type != "cpu" or not out.is_contiguous():
            raise TypeError("out must be a contiguous CPU uint8 tensor")
        if self._closed:
            return False
        obj = None
        try:
            key = lmcache_key(name)
            obj = self._local.get_blocking(key)
            source = "local_hits"
            if obj is None and out.numel() <= self.local_cpu_bytes:
                # (A remote object larger than the whole local pool must not be asked
                # for: LMCache 0.5.6's connectors allocate its buffer with busy_loop=True,
                # which spins on the event loop forever when nothing can be evicted.)
                for remote in self._remotes:
                    obj = remote.get_blocking(key)
                    if obj is not None:
                        source = "remote_hits"
                        self._local.submit_put_task(key, obj)
                        break
            if obj is None:
                self.stats.add("misses")
                return False
            src = obj.tensor
            if src is None or src.dtype != torch.uint8 or src.numel() != out.numel():
                self.stats.add("misses")
                return False
            out.view(-1).copy_(src.reshape(-1))
            self.stats.add(source)
            return True
        except Exception:
            self.stats.add("errors")
            self.stats.add("misses")
            return False
        finally:
            if obj is not None:
                try:
                    obj.ref_count_down()
                except Exception:
                    pass

    def local_usage(self) -> tuple[int, int]:
        """(objects, bytes in use) of the local pool."""
        with self._local.cpu_lock:
            objs = list(self._local.hot_cache.values())
        return len(objs), sum(o.get_size() for o in objs)

    # ---- lifetime ------------------------------------------------------------------

    def close(self, flush_timeout_s: float | None = None) -> None:
        """Wait up to `flush_timeout_s` (default `timeout_s`) for remote writes, then
        stop the engine. Idempotent."""
        if self._closed:
            return
        self.flush(self.timeout_s if flush_timeout_s is None else flush_timeout_s)
        self._closed = True
        self._close_remotes()
        self._sm.close()

    def _close_remotes(self) -> None:
        """Close the remote backends ourselves, then leave them out of LMCache's close.

        LMCache 0.5.6's `RedisConnector.close()` is a coroutine on the storage
        manager's event loop that calls `AsyncPQExecutor.shutdown(wait=True)`, which
        blocks that same loop on a future only the loop can complete, and
        `RemoteBackend.close()` waits for it without a timeout: `StorageManager.close()`
        never returns once a redis:// backend exists (and its non-daemon loop thread
        then keeps the process alive). So: the executor's async shutdown and the
        redis client's `aclose()`, bounded by `timeout_s`, best effort.
        """
        for name in [n for n in self._sm.storage_backends if n != "LocalCPUBackend"]:
            backend = self._sm.storage_backends.pop(name)
            conn = getattr(backend, "connection", None)
            inner = getattr(conn, "_connector", conn)  # InstrumentedConnector wraps the real one
            executor = getattr(inner, "pq_executor", None)
            client = getattr(inner, "connection", None)

            async def shut(executor=executor, client=client) -> None:
                if executor is not None and hasattr(executor, "shutdown_async"):
                    await executor.shutdown_async(wait=False)
                if client is not None and hasattr(client, "aclose"):
                    await client.aclose()

            try:
                asyncio.run_coroutine_threadsafe(shut(), self._sm.loop).result(self.timeout_s)
            except Exception:
                pass
        self._remotes = []

    def __enter__(self) -> LMCacheObjects:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
