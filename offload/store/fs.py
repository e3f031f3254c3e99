"""The file tier: `FsIndex` (scheduler: the directory is the index), `FsData`
(worker: framed chunks in and out of files) and `FsTier`, its `TierSpec`.

Every file is read and written through `FileStore` (offload/store/files.py),
one canonical file per (chunk, group), shared over NFS. Contract of `FsData.put`:
an entry whose parent is gone (evicted before or while it was written) is not
left behind; it raises `ParentGone`, a parent still in the worker's store queue
(`queued`) counting as on its way.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import wait

import torch

from offload.keys import ChunkKey
from offload.planner import Admission, StateClass, enters_cold, time_rank
from offload.store.auth import Keyring, open_keyring
from offload.store.base import (
    Backed,
    HostChunk,
    ParentGone,
    Placement,
    TierData,
    TierIndex,
    TierSpec,
    TierUsage,
    WarmCandidate,
)
from offload.store.buffers import BufferPool, probe_o_direct
from offload.store.cachedir.housekeeper import Housekeeper
from offload.store.dir_checks import check_directory, unauthenticated_risks
from offload.store.files import FileStore
from offload.store.format import ChunkHeader
from offload.store.options import FsOptions

logger = logging.getLogger(__name__)

# A child waits this long for its parent's write before it checks the parent is there.
_PARENT_WAIT_S = 60.0


class FsIndex(TierIndex):
    """Scheduler-side view of the file tier: the directory is the index.

    `reserve` never stats: the worker skips a file that exists when it
    writes, off the scheduling path. Files are not evicted by this process,
    so nothing is pinned; a file that vanishes before its load is a miss.
    """

    def __init__(self, store: FileStore, num_groups: int = 0) -> None:
        self.store = store
        self.housekeeper: Housekeeper | None = None
        if num_groups:
            self.housekeeper = (store.ref.dir.housekeeper(store.root, num_groups) if store.ref is not None
                                else Housekeeper(store.root, num_groups, store.account)).start()

    def contains(self, group: int, key: ChunkKey) -> bool:
        return self.store.contains(group, key)

    def usage(self) -> TierUsage | None:
        return self.housekeeper.latest() if self.housekeeper is not None else None

    def warm_candidates(self) -> list[WarmCandidate] | None:
        """From the directory's ledger index (this process's housekeeper loads it), ranked by the
        worth model's eviction order: entries stored cold and not loaded from the files since come
        after every other (the ledger does not see a read from host memory, so a cold entry that
        host memory served is still cold here: warmed last, where room is left)."""
        if self.housekeeper is not None:  # gathered on its thread, off the scheduling path
            found = self.housekeeper.chunk_entries()
        elif self.store.account is not None:
            found = self.store.account.chunk_entries(self.store.root.name)
        else:
            found = None
        if found is None:
            return None
        return [WarmCandidate(c.group, bytes.fromhex(c.key), None if parent is None else parent.to_bytes(8, "big"),
                              size, time_rank(t, cold))
                for c, size, t, parent, cold in found if len(c.key) == 64]

    def close(self) -> None:
        if self.housekeeper is not None:
            self.housekeeper.stop()
        self.store.close()

    def reserve(self, group: int, key: ChunkKey, parent: ChunkKey | None,
                admission: Admission = Admission.HOT, state: StateClass | None = None) -> Placement | None:
        if admission is Admission.SKIP:
            return None
        return Placement(cold=enters_cold(admission))

    def pin(self, group: int, key: ChunkKey) -> Placement | None:
        """A planned load will read the file: its recency moves on now, as the read's own would
        (`FileStore` touches what it loaded), so no evictor, this process's or another
        instance's, takes it between the lookup and the read."""
        try:
            os.utime(self.store.file_path(group, key))
        except OSError:
            pass  # not there (yet: a write still queued serves the load) or a read-only mount: the read decides
        return Placement()


class FsData(TierData):
    """Worker-side file I/O from host memory: `put` checksums and writes a
    file (O_DIRECT where the filesystem allows it) and renames it into place;
    `get` reads into a pooled buffer and verifies it. Both run on the
    worker's I/O threads."""

    def __init__(self, store: FileStore, direct: bool | None = None, direct_reads: bool = True) -> None:
        self.store = store
        # None: probe on the first write. False: buffered writes only.
        self.direct = direct
        self.direct_writes = 0
        self.buffered_writes = 0
        # O_DIRECT reads (the `direct_reads` option); no probe: the first read
        # the filesystem refuses falls back, and the rest are buffered.
        self.direct_reads = direct_reads
        self.direct_read_count = 0
        self.buffered_read_count = 0
        # Buffers to frame host-memory slots in, reused: fresh memory costs a store its page faults
        # (2.6x the CPU of the framing copy itself).
        self.frames = BufferPool()

    def record_layout(self, description: dict) -> None:
        self.store.write_layout(description)
        # At start-up, not among the first stores (see FileStore.make_dirs).
        self.store.make_dirs(len(description.get("groups", ())))

    def close(self) -> None:
        self.store.close()

    def header_of(self, group: int, key: ChunkKey) -> ChunkHeader | None:
        return self.store.read_header(group, key)

    def holds(self, header: ChunkHeader, placement: Placement) -> bool:
        return os.path.exists(self.store.file_path(header.group, header.key))  # an error: not held (write_framed)

    def signer(self) -> Keyring | None:
        return self.store.keyring

    def put(self, header: ChunkHeader, chunk: HostChunk, placement: Placement) -> bool:
        # A host-memory slot is framed first: a copy off the forward path that CRCs and MACs.
        with chunk.framing(self.frames, self.store.keyring) as framed:
            return self._put(header, framed, placement)

    def _put(self, header: ChunkHeader, chunk: HostChunk, placement: Placement) -> bool:
        if self.direct is None:
            final = self.store.file_path(header.group, header.key)
            self.store.prepare_dir(final)
            self.direct = probe_o_direct(final.parent)
            logger.info("kvoffload: O_DIRECT writes %s in %s", "on" if self.direct else "off (refused)",
                        self.store.root)
        # The budget evicts leaves: a parent evicted while this entry waited in the store queue must not
        # get a child. Checked before the write (a parent still queued is on its way) and again once the
        # file is in place, after the parent's write ended (it may have failed, or been evicted meanwhile).
        parent = header.parent_key
        pending = None if parent is None else self.queued(header.group, parent)
        if parent is not None and pending is None and not self._holds(header.group, parent):
            raise ParentGone(f"{parent.hex()[:16]}: evicted before its child was written")
        written, used = self.store.write_framed(header, chunk, self.direct, placement.cold)
        if written and parent is not None:
            if pending is not None and pending.running():
                wait([pending], timeout=_PARENT_WAIT_S)
            # A parent's write not started yet is queued behind this one (waiting could take every
            # store thread): it lands later, or is dropped as a hole the worker then knows of.
            if (pending is None or pending.done()) and not self._holds(header.group, parent):
                self.store.remove(self.store.file_path(header.group, header.key))
                raise ParentGone(f"{parent.hex()[:16]}: gone while its child was written")
        if written:
            if used:
                self.direct_writes += 1
            else:
                self.buffered_writes += 1
        return written

    def _holds(self, group: int, key: bytes) -> bool:
        return os.path.exists(self.store.file_path(group, ChunkKey(key)))

    def get(self, header: ChunkHeader, placement: Placement, pool: BufferPool) -> HostChunk:
        return self._get(header, pool, crc_later=False)

    def get_to_scatter(self, header: ChunkHeader, placement: Placement, pool: BufferPool) -> HostChunk:
        # An O_DIRECT read lands in memory the CPU has not touched: the CRC is left to the scatter's
        # pass over the same bytes (one pass instead of two). A buffered read CRCs as it copies.
        return self._get(header, pool, crc_later=True)

    def _get(self, header: ChunkHeader, pool: BufferPool, crc_later: bool) -> HostChunk:
        chunk = HostChunk.pooled(pool, header.payload_len)
        try:
            if self.direct_reads:
                if self.store.read_framed(header, chunk, crc_later):
                    self.direct_read_count += 1
                else:
                    self.direct_reads = False
                    self.buffered_read_count += 1
                    logger.info("kvoffload: O_DIRECT reads refused in %s; buffered reads from now on",
                                self.store.root)
            else:
                self.store.read_into(header, chunk.payload)
                self.buffered_read_count += 1
        except BaseException:
            chunk.release()
            raise
        return chunk


class FsTier(TierSpec[FsOptions]):
    """Files under `path`, one per (chunk, group), shared across instances."""

    store = "fs"
    hit_source = "DISK"

    def check(self) -> None:
        check_directory(self.options.path, self.options.dir_mode)
        if self.options.auth is not None:
            open_keyring(self.options.auth)  # fails start-up here, naming the option
            return
        risks = unauthenticated_risks(self.options.path)
        if risks:
            logger.warning("kvoffload: %s has no deployment key (option 'auth'), so entries are checked by CRC "
                           "only and anyone who can write there can plant KV that requests restore: %s; set "
                           "'auth' (docs/reliability.md, threat model)", self.options.path, "; ".join(risks))

    def describe(self) -> str:
        budget = f", max_bytes={self.options.max_bytes}" if self.options.max_bytes else ""
        auth = f", MAC with {self.options.auth.describe()}" if self.options.auth else ", CRC only (no key)"
        return f"{self.options.path}{budget}{auth}"

    def index(self, backed: Backed | None) -> FsIndex:
        # Rank 0's files stand for the request on every rank; a rank missing
        # its file fails the load, which is a recompute, never a wrong hit.
        store = FileStore.open(self.options.path, self.ctx.index_fingerprint, options=self.options, dirs=self.ctx.dirs)
        return FsIndex(store, num_groups=len(self.ctx.planner.groups))

    def data(self, device: torch.device) -> FsData:
        return FsData(FileStore.open(self.options.path, self.ctx.fingerprint, options=self.options, dirs=self.ctx.dirs),
                      direct_reads=self.options.direct_reads)
