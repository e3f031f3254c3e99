"""The "lmcache" tier: our per-(chunk, group) entries as objects in LMCache's
storage engine (offload/store/lmcache_objects.py).

Our planner decides the entries and their keys exactly as for files; an
object holds exactly what a chunk file holds (the `HEADER_LEN`-byte header
with the payload's CRC32C and, with a deployment key (`auth`), its MAC; then
the payload: `FileStore.write_framed`'s bytes), and a load checks header, CRC
and MAC like a file read (offload/store/auth.py). Objects have no quarantine:
one that fails is a miss and stays where it is. An object that is missing,
evicted, of another length or damaged is a `ChunkMiss`, never garbage: vLLM
recomputes. LMCache's own settings come from the tier's keys: the local CPU
pool size (`local_cpu_bytes`) and, optionally, a remote (`remote_url`, e.g.
`redis://host:6379`) shared by engines on other machines.

One storage engine per options and `CacheDirs` (`open_objects`; the tiers
of one connector, or of every connector handed the same `CacheDirs`, share
it: offload/store/cachedir/owners.py). Where the scheduler's connector and the
worker's share a process (vLLM's uniproc executor) and a `CacheDirs`, the
scheduler's index asks that engine. Where they do not (vLLM-CPU
always runs its worker in a process of its own, and so does every TP>1
deployment), the worker's local pool is out of the scheduler's sight, so the
scheduler keeps a ledger instead (`LMCacheIndex`): the entries it had stored,
as an LRU of the pool's size in entry bytes, the way LMCache's LocalCPUBackend
evicts. The ledger is a model: an entry LMCache evicted early (allocator
overhead, a failed store) makes a load a `MISSING` miss, after which the
request's entries are dropped from the ledger. With `remote_url` the remote
is asked too, so engines on other machines find each other's entries.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import replace

import torch

from offload.keys import ChunkKey
from offload.planner import Admission, StateClass, own_lru_admits
from offload.store.arena import CpuLayout
from offload.store.auth import Keyring, Unauthenticated, check_entry, frame, open_keyring
from offload.store.base import (
    Backed,
    ChunkMiss,
    HostChunk,
    MissReason,
    OptionError,
    Placement,
    TierContext,
    TierData,
    TierIndex,
    TierSpec,
    TierUsage,
)
from offload.store.buffers import BufferPool
from offload.store.cachedir.owners import CacheDirs
from offload.store.format import HEADER_LEN, ChunkHeader, FormatError
from offload.store.lmcache_objects import LMCacheObjects, object_name
from offload.store.options import LMCacheOptions

logger = logging.getLogger(__name__)


# ---- one storage engine per options, shared through a CacheDirs ------------------------

def open_objects(dirs: CacheDirs, options: LMCacheOptions) -> LMCacheObjects:
    """The storage engine for `options` held in `dirs`, started on first use;
    every caller gives it back with `release_objects`, and the last one stops it."""
    return dirs.engines.acquire(options, lambda: LMCacheObjects.open(options.local_cpu_bytes, options.remote_url,
                                                                     timeout_s=options.timeout_s))


def release_objects(dirs: CacheDirs, options: LMCacheOptions) -> None:
    objs = dirs.engines.release(options)
    if objs is not None:
        close_objects(objs)


def close_objects(objs: LMCacheObjects) -> None:
    """Stop an engine (remote write-behind finishes, bounded) and log what it answered."""
    objs.close(flush_timeout_s=max(30.0, objs.timeout_s))
    st = objs.stats
    # One line per engine: what the storage engine answered (tests and operators read it).
    logger.info("kvoffload: LMCache storage engine stats: puts=%d put_failures=%d remote_put_failures=%d "
                "remote_put_retries=%d local_hits=%d remote_hits=%d misses=%d errors=%d", st.puts, st.put_failures,
                st.remote_put_failures, st.remote_put_retries, st.local_hits, st.remote_hits, st.misses, st.errors)


def _name(header_or_fp, group: int, key: ChunkKey) -> str:
    return object_name(bytes(header_or_fp), group, bytes(key))


class LMCacheIndex(TierIndex):
    """Scheduler side. Shared process: the storage engine is the index. Separate
    worker processes: a ledger of what this scheduler had stored (an LRU in
    entry bytes, capacity `local_cpu_bytes`), plus the remote when there is one.
    Nothing is pinned: an object evicted before its load is a miss."""

    def __init__(self, objects: LMCacheObjects | None, options: LMCacheOptions, ctx: TierContext,
                 release: LMCacheOptions | None) -> None:
        self.objects = objects  # None: no remote and a separate worker: the ledger only
        self.options = options
        self.fp = ctx.index_fingerprint
        self._release = release
        self._dirs = ctx.dirs
        self.ledger: OrderedDict[tuple[int, bytes], int] | None = None
        self._skipped = 0
        if ctx.separate_workers:
            self.ledger = OrderedDict()
            self._entry_bytes = [HEADER_LEN + b for b in _max_entry_bytes(ctx)]
            self._used = 0
            self._evictions = [0] * len(self._entry_bytes)
            self._lock = threading.Lock()

    def contains(self, group: int, key: ChunkKey) -> bool:
        if self.ledger is not None:
            with self._lock:
                if (group, bytes(key)) in self.ledger:
                    return True
        return self.objects is not None and self.objects.contains(_name(self.fp, group, key))

    def reserve(self, group: int, key: ChunkKey, parent: ChunkKey | None,
                admission: Admission = Admission.HOT, state: StateClass | None = None) -> Placement | None:
        if not own_lru_admits(admission):
            # LMCache orders its own pool and remote: a state that would enter
            # our tiers cold is not given to it at all.
            self._skipped += 1
            return None
        if self.ledger is not None:
            k = (group, bytes(key))
            with self._lock:
                if k in self.ledger:
                    self.ledger.move_to_end(k)
                    return None  # stored already (in this engine's pool, as far as the ledger knows)
                n = self._entry_bytes[group]
                while self.ledger and self._used + n > self.options.local_cpu_bytes:
                    (g, _), m = self.ledger.popitem(last=False)
                    self._used -= m
                    self._evictions[g] += 1
                self.ledger[k] = n
                self._used += n
        return Placement()  # the worker skips an entry it already holds, off the scheduling path

    def pin(self, group: int, key: ChunkKey) -> Placement | None:
        if self.ledger is not None:
            with self._lock:
                k = (group, bytes(key))
                if k in self.ledger:
                    self.ledger.move_to_end(k)  # a read refreshes LMCache's LRU too
                    return Placement()
        return Placement() if self.objects is not None and self.objects.contains(_name(self.fp, group, key)) \
            else None

    def forget(self, group: int, key: ChunkKey) -> None:
        if self.ledger is not None:
            with self._lock:
                n = self.ledger.pop((group, bytes(key)), None)
                if n is not None:
                    self._used -= n

    def usage(self) -> TierUsage | None:
        if self.ledger is None:
            # Objects are named by hashes: per-group figures are not known here.
            return TierUsage(entries=(), bytes=(), capacity_bytes=self.options.local_cpu_bytes,
                             skipped=self._skipped)
        with self._lock:
            entries = [0] * len(self._entry_bytes)
            nbytes = [0] * len(self._entry_bytes)
            for (g, _), n in self.ledger.items():
                entries[g] += 1
                nbytes[g] += n
            return TierUsage(tuple(entries), tuple(nbytes), tuple(self._evictions),
                             capacity_bytes=self.options.local_cpu_bytes, skipped=self._skipped)

    def close(self) -> None:
        if self._release is not None:
            release_objects(self._dirs, self._release)
            self._release = None


def _max_entry_bytes(ctx: TierContext) -> list[int]:
    """Each group's largest payload (as the host tier sizes its slots)."""
    layout = CpuLayout.plan(ctx.planner, 1 << 62)
    return [layout.slot_bytes(g) for g in range(len(ctx.planner.groups))]


class LMCacheData(TierData):
    """Worker side: framed payloads (header + CRC, as a chunk file) in and out
    of the storage engine, on the worker's I/O threads."""

    def __init__(self, objects: LMCacheObjects, options: LMCacheOptions, keyring: Keyring | None = None,
                 dirs: CacheDirs | None = None) -> None:
        """`objects` held in `dirs` (released there on close), or this data's
        own engine without `dirs` (stopped on close)."""
        self.objects = objects
        self.options = options
        self.keyring = keyring
        self._dirs = dirs
        self._closed = False
        self.frames = BufferPool()  # reused, as FsData's

    def holds(self, header: ChunkHeader, placement: Placement) -> bool:
        return self.objects.contains(_name(header.fingerprint, header.group, header.key))

    def signer(self) -> Keyring | None:
        return self.keyring

    def put(self, header: ChunkHeader, chunk: HostChunk, placement: Placement) -> bool:
        n = chunk.payload.numel()
        if n != header.payload_len:
            raise ValueError(f"payload has {n} bytes, header says {header.payload_len}")
        name = _name(header.fingerprint, header.group, header.key)
        if self.objects.contains(name):
            return False
        # A host-memory slot is framed first: a copy off the forward path that CRCs and MACs.
        with chunk.framing(self.frames, self.keyring) as framed:
            assert framed.buf is not None
            raw = frame(header, framed.payload, self.keyring, framed.crc, framed.fed_mac(self.keyring))
            framed.buf[:HEADER_LEN].copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
            if not self.objects.put(name, framed.buf[:HEADER_LEN + n]):
                raise OSError(f"LMCache local pool took no object of {HEADER_LEN + n} bytes (full, or an engine error)")
        return True

    def get(self, header: ChunkHeader, placement: Placement, pool: BufferPool) -> HostChunk:
        n = header.payload_len
        name = _name(header.fingerprint, header.group, header.key)
        chunk = HostChunk.pooled(pool, n)
        try:
            assert chunk.buf is not None
            framed = chunk.buf[:HEADER_LEN + n]
            if not self.objects.get_into(name, framed):
                # Gone (evicted, remote down or without it) or another length.
                raise ChunkMiss(MissReason.MISSING, f"LMCache object {name}")
            try:
                check_entry(bytes(framed[:HEADER_LEN].numpy()), None, header, chunk.payload, self.keyring)
            except FormatError as e:
                raise ChunkMiss(MissReason.CORRUPT, f"LMCache object {name}: {e}") from None
            except Unauthenticated as e:
                raise ChunkMiss(MissReason.UNAUTHENTICATED, f"LMCache object {name}: {e}") from None
        except BaseException:
            chunk.release()
            raise
        return chunk

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self._dirs is not None:
                release_objects(self._dirs, self.options)
            else:
                close_objects(self.objects)


class LMCacheTier(TierSpec[LMCacheOptions]):
    """LMCache's storage engine: a local CPU pool and, optionally, a remote."""

    store = "lmcache"
    hit_source = "HOST"

    def __init__(self, options: LMCacheOptions, ctx: TierContext) -> None:
        super().__init__(options, ctx)
        if options.remote_url:
            self.hit_source = "EXTERNAL_UNSPECIFIED"

    def check(self) -> None:
        try:
            import lmcache  # noqa: F401
        except ImportError as e:
            raise OptionError(f"store='lmcache': LMCache is not importable ({e}); install lmcache==0.5.6 "
                              "(make setup)") from None
        if self.options.auth is not None:
            open_keyring(self.options.auth)  # fails start-up here, naming the option
        elif self.options.remote_url:
            logger.warning("kvoffload: the LMCache remote %s has no deployment key (option 'auth'), so objects are "
                           "checked by CRC only and anyone who can write to it can plant KV that requests restore; "
                           "set 'auth' (docs/reliability.md, threat model)", self.options.remote_url)

    def describe(self) -> str:
        remote = f", remote {self.options.remote_url}" if self.options.remote_url else ", no remote"
        auth = f", MAC with {self.options.auth.describe()}" if self.options.auth else ", CRC only (no key)"
        return f"LMCache local CPU pool {self.options.local_cpu_bytes} bytes{remote}{auth}"

    def index(self, backed: Backed | None) -> LMCacheIndex:
        if not self.ctx.separate_workers:
            return LMCacheIndex(open_objects(self.ctx.dirs, self.options), self.options, self.ctx, self.options)
        if not self.options.remote_url:
            return LMCacheIndex(None, self.options, self.ctx, None)
        # The remote only: a minimal local pool (LMCache requires one), never written.
        remote = replace(self.options, local_cpu_bytes=1 << 20)
        return LMCacheIndex(open_objects(self.ctx.dirs, remote), self.options, self.ctx, remote)

    def data(self, device: torch.device) -> LMCacheData:
        keyring = open_keyring(self.options.auth)
        return LMCacheData(open_objects(self.ctx.dirs, self.options), self.options, keyring, self.ctx.dirs)
