"""The seam between the connector and a tier: an index the scheduler asks,
and the bytes the worker moves.

The scheduler half runs in the engine-core process and the worker half in each
worker process; they share nothing but the per-step metadata. So a tier is two
small objects: `TierIndex` (scheduler: what is stored, where a new entry goes,
pinning during a load) and `TierData` (worker: host-memory payloads in and out).
Both are built by a `TierSpec` (offload/store/__init__.py), one class per
`store` name, from its own options dataclass; stores know nothing of vLLM or
of the connector's config.

Bytes meet the KV cache only in the worker, once per entry: a store is one
gather into host memory (the host tier's slot, or a pooled buffer), and every
tier below is written from that host copy. A load reads one tier's bytes into
host memory once, scatters them, and may put the same bytes into a higher
tier (promotion).
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum
from typing import ClassVar, Generic, NamedTuple, Protocol, TypeVar

import torch

from offload.copier import Ghash, copy_crc, crc32c, ghash_available, memcpy
from offload.keys import ChunkKey, Fingerprint
from offload.planner import Admission, HybridOffloadPlanner, StateClass
from offload.store.buffers import BufferPool
from offload.store.cachedir.owners import CacheDirs
from offload.store.format import HEADER_LEN, ChunkHeader
from offload.store.tier_usage import TierUsage


class OptionError(ValueError):
    """A tier option that cannot work; the message starts with the option's
    name and value and says what would be valid (the connector prefixes the
    config key path and raises its ConfigError)."""


class MissReason(str, Enum):
    """Why an entry could not be restored; the value is the metric label
    (`kvoffload_failed_loads{reason}`)."""

    MISSING = "missing"  # gone from the tier (evicted, deleted) after the lookup
    CORRUPT = "corrupt"  # failed verification; files are quarantined
    # No key of this deployment vouches for the entry (no MAC, another
    # deployment's key, a bad MAC, or a valid MAC on another chunk's entry);
    # those claiming our key are quarantined, the others left alone.
    UNAUTHENTICATED = "unauthenticated"
    IO_ERROR = "io_error"  # a transient read error: the entry may be fine
    UNSAFE = "unsafe"  # a path resolving outside the cache directory
    ERROR = "error"  # an unexpected exception in the load
    ALLOCATION_MISMATCH = "allocation mismatch"  # vLLM's blocks differ from the planned restore


class ParentGone(OSError):
    """The entry a new one chains from is not in the tier (evicted while the
    new one waited to be written): stored, the new one would stand behind a
    hole a lookup could step over. The store is dropped instead."""


class ChunkMiss(Exception):
    """An entry that cannot be restored. Raised by `TierData.get`, never
    returned as garbage: the worker turns it into a failed load, which vLLM
    recomputes."""

    def __init__(self, reason: MissReason, detail: str) -> None:
        super().__init__(f"{reason.value}: {detail}")
        self.reason = reason


@dataclass(frozen=True)
class Placement:
    """Where one (chunk, group) entry lives in a tier: a slot for host
    memory; None for tiers addressed by key (files). `cold`: a new entry
    that enters the tier's eviction order at the cold end (a tier whose
    order the worker writes, files, needs to be told)."""

    slot: int | None = None
    cold: bool = False


def host_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy `src`'s bytes into `dst` (the same size): the tiers' copy between host buffers, on the
    copier where both are contiguous uint8 host tensors (torch's `copy_` costs twice the CPU, and
    starts an OpenMP team on every I/O thread that calls it), torch's otherwise."""
    if all(t.device.type == "cpu" and t.dtype == torch.uint8 and t.is_contiguous() for t in (dst, src)):
        memcpy(dst, src)
    else:
        dst.copy_(src)


class PayloadMac(Protocol):
    """A MAC begun on an entry (`auth.Mac`), to be fed its payload: by `update`, or through
    `ghash` (None where the copier does not hash for it) in the caller's own pass."""

    @property
    def ghash(self) -> Ghash | None: ...

    def update(self, data) -> None: ...

    def field(self) -> bytes: ...

    def verify(self, field: bytes) -> bool: ...


class Gathers(Protocol):
    """Pages a store gathers from (`copier.GroupPages`, or the connector's gated view of them)."""

    def gather_crc(self, block_ids: Sequence[int], out: torch.Tensor, ghash: Ghash | None = None) -> int | None: ...


class Signer(Protocol):
    """What a tier signs its entries with (`auth.Keyring`): `begin` starts an entry's MAC, for a
    copy of the payload to feed (`PayloadMac.ghash`) before the tier's writer signs with it."""

    def begin(self) -> PayloadMac: ...


@dataclass
class HostChunk:
    """One entry's payload in host memory.

    `buf`, when set, is a pooled buffer laid out as a file: `HEADER_LEN` bytes
    of room, then the payload, so a file tier writes it in one aligned write.
    A payload that is a view of a host-memory slot has no `buf`. `release()`
    gives a pooled buffer back; the chunk must not be used after it.
    """

    payload: torch.Tensor
    buf: torch.Tensor | None = None
    pool: BufferPool | None = None
    refs: int = 1  # holders; the buffer goes back to the pool when the last one releases
    # Left by `TierData.get_to_scatter`: the CRC-32C the payload must have, checked by the caller's
    # own pass over the bytes (`check`); `corrupt` is the tier's answer to a mismatch (the file goes
    # to quarantine) and gives the miss to report.
    crc_due: int | None = None
    corrupt: Callable[[], ChunkMiss] | None = field(default=None, repr=False, compare=False)
    # Or, with a key, the entry's MAC, begun (`auth.Mac`, whose `ghash` the caller's pass feeds
    # with the payload), and the tier's check that settles it (raises the ChunkMiss to report).
    mac_due: PayloadMac | None = field(default=None, repr=False, compare=False)
    settle_mac: Callable[[PayloadMac], None] | None = field(default=None, repr=False, compare=False)
    # The payload's CRC-32C where the copy that filled the buffer took it in its pass (a writer
    # then frames it without reading the bytes again); None: the writer computes it. `signed`: a
    # MAC that copy fed, and the signer it was begun for (`fed_mac` hands it to that signer's writer).
    crc: int | None = None
    signed: tuple[Signer, PayloadMac] | None = field(default=None, repr=False, compare=False)
    # Holders of one chunk release it on different threads (forward path, store threads).
    _refs_lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @classmethod
    def pooled(cls, pool: BufferPool, payload_len: int) -> HostChunk:
        buf = pool.get(HEADER_LEN + payload_len)
        return cls(buf[HEADER_LEN:HEADER_LEN + payload_len], buf, pool)

    def fill(self, src: torch.Tensor, signer: Signer | None = None) -> None:
        """Copy `src` (the payload's size) into the payload and keep its CRC-32C, taken in the
        copy's own pass: a writer then frames it without reading the bytes back from memory. With
        `signer`, that pass feeds the entry's MAC too, where the copier hashes for it."""
        mac = self.begin_mac(signer)
        self.crc = copy_crc(self.payload, src, ghash=None if mac is None else mac.ghash)

    @contextmanager
    def framing(self, pool: BufferPool, signer: Signer | None) -> Iterator[HostChunk]:
        """This chunk where it has its header's room in front (a pooled buffer), else a copy of it
        into a buffer of `pool` (`fill`: CRC and MAC in the copy's pass), released on exit."""
        if self.buf is not None:
            yield self
            return
        framed = HostChunk.pooled(pool, self.payload.numel())
        try:
            framed.fill(self.payload, signer)
            yield framed
        finally:
            framed.release()

    def gather(self, pages: Gathers, block_ids: Sequence[int], signer: Signer | None = None) -> None:
        """Gather `block_ids`' pages into the payload, keeping its CRC-32C and feeding `signer`'s
        MAC in the gather's own pass, as `fill` does for a copy (neither where the device copies)."""
        mac = self.begin_mac(signer)
        self.crc = pages.gather_crc(block_ids, self.payload, None if mac is None else mac.ghash)
        if self.crc is None:
            self.signed = None

    def begin_mac(self, signer: Signer | None) -> PayloadMac | None:
        """The MAC a copy into this chunk is to feed for `signer` (kept as `signed`), or None
        where there is no signer or the copier does not hash for it."""
        if signer is None or not ghash_available():
            return None
        mac = signer.begin()
        if mac.ghash is None:
            return None
        self.signed = (signer, mac)
        return mac

    def fed_mac(self, signer: object) -> PayloadMac | None:
        """The MAC a copy fed for `signer`, once (a writer signing with it reads the bytes no
        more); None for any other signer."""
        with self._refs_lock:
            if self.signed is None or self.signed[0] is not signer:
                return None
            mac, self.signed = self.signed[1], None
        return mac

    def check(self, crc: int | None = None, mac_fed: bool = False) -> None:
        """Settle what a tier left to the caller (`crc_due`, `mac_due`; nothing to do without
        them): `crc` is the payload's CRC-32C as the caller's pass computed it, or None to compute
        it here; `mac_fed`: that pass fed the payload to `mac_due.ghash`. Raises the tier's
        ChunkMiss on a mismatch."""
        due, self.crc_due = self.crc_due, None
        if due is not None and (crc32c(self.payload) if crc is None else crc) != due:
            assert self.corrupt is not None
            raise self.corrupt()
        mac, self.mac_due = self.mac_due, None
        if mac is not None:
            if not mac_fed:
                mac.update(self.payload.numpy())
            assert self.settle_mac is not None
            self.settle_mac(mac)

    def hold(self) -> HostChunk:
        with self._refs_lock:
            self.refs += 1
        return self

    def release(self) -> None:
        with self._refs_lock:
            self.refs -= 1
            last = self.refs == 0
        if last:
            if self.pool is not None and self.buf is not None:
                self.pool.put(self.buf)
            self.pool = None


class WarmCandidate(NamedTuple):
    """An entry a tier holds, as warm start ranks it: `parent` is the first 8 bytes of the key it
    chains from (None: a chain's first entry, or a state), `t` its place in the tier's eviction
    order (the worth model's rank: larger is kept longer)."""

    group: int
    key: bytes
    parent: bytes | None
    size: int
    t: float


class TierIndex(ABC):
    """Scheduler-side view of a tier. Must be cheap: it runs on the scheduling path."""

    @abstractmethod
    def contains(self, group: int, key: ChunkKey) -> bool:
        """Is the entry stored and restorable?"""

    @abstractmethod
    def reserve(self, group: int, key: ChunkKey, parent: ChunkKey | None,
                admission: Admission = Admission.HOT, state: StateClass | None = None) -> Placement | None:
        """Where to store a new entry; None when it is already stored, there
        is no room, or the tier does not take it (the store is skipped).
        `admission` says where it enters the tier's eviction order (or that
        it is not stored); `state` is a recurrent state's class (None for
        other entries), for the tier's figures."""

    def reserve_promotion(self, group: int, key: ChunkKey, parent: ChunkKey | None) -> Placement | None:
        """`reserve`, hot, for bytes a load in flight will copy up from a slower
        tier. An index whose `contains` would count the entry before those
        bytes land (host memory) keeps it out of `contains` and `pin` until
        `promotion_done`: a lookup meanwhile would plan a load of a slot
        still empty."""
        return self.reserve(group, key, parent)

    def promotion_done(self, group: int, key: ChunkKey, landed: bool) -> None:
        """The load that reserved this promotion finished; `landed` is False
        where it failed, so the bytes may not be there."""
        return None

    @abstractmethod
    def pin(self, group: int, key: ChunkKey) -> Placement | None:
        """Hold an entry for a load until `unpin`; None if it is gone."""

    def unpin(self, group: int, key: ChunkKey) -> None:
        return None

    def forget(self, group: int, key: ChunkKey) -> None:
        """A load that read this entry failed: stop counting on it (an index
        that models the tier rather than asking it drops it)."""
        return None

    def store_dropped(self, group: int, key: ChunkKey) -> None:
        """A store or promotion of this entry into this tier will not land,
        though `reserve` counted it: the tier does not hold it."""
        self.forget(group, key)

    def copy_below_dropped(self, group: int, key: ChunkKey) -> None:
        """The write of this entry to a tier below will not land, so where
        this tier holds it, that is its only copy for good: an index that
        keeps only copies from eviction lets this one go like any other
        (kept, it would hold its room until a restart)."""
        return None

    def reserve_warm(self, group: int, key: ChunkKey, parent: ChunkKey | None) -> Placement | None:
        """A slot for an entry warm start copies up, taken only from free room (it never
        evicts); offered at once (the worker's load waits for the bytes or reads them itself),
        never evicted before `promotion_done`. None: no room, or the tier takes no warm entries."""
        return None

    def warm_candidates(self) -> list[WarmCandidate] | None:
        """What this tier holds that warm start may copy up, in no order; None while not known
        yet (or never, for a tier warm start cannot read)."""
        return None

    def usage(self) -> TierUsage | None:
        """Current usage, cheap to call every step; None while unknown."""
        return None

    def close(self) -> None:
        """Stop whatever the index runs in the background (directory scans)."""
        return None


class TierData(ABC):
    """Worker-side bytes of a tier, always through host memory."""

    # Set by the writer that queues puts for this tier: the write still taking
    # an entry (group, key) to it, if any. A parent still queued is on its
    # way, not a hole (see `ParentGone`).
    queued: Callable[[int, bytes], Future[None] | None] = staticmethod(lambda group, key: None)

    def record_layout(self, description: dict) -> None:
        """Persist what the fingerprint stands for, where the tier outlives the process."""
        return None

    def gather_target(self, header: ChunkHeader, placement: Placement) -> torch.Tensor | None:
        """Host memory the KV cache pages of a new entry can be gathered
        straight into (a host-memory slot), or None: the worker gathers into a
        pooled buffer and calls `put`. After a gather into the target the
        worker calls `gathered`."""
        return None

    def gathered(self, header: ChunkHeader, placement: Placement) -> None:
        """The gather into `gather_target` completed."""
        return None

    @abstractmethod
    def holds(self, header: ChunkHeader, placement: Placement) -> bool:
        """Whether the entry is stored already (cheap: a stat, a slot check)."""

    @abstractmethod
    def put(self, header: ChunkHeader, chunk: HostChunk, placement: Placement) -> bool:
        """Store the payload; False if the entry existed already. Runs off the
        forward path. Raises OSError when the tier cannot take it."""

    @abstractmethod
    def get(self, header: ChunkHeader, placement: Placement, pool: BufferPool) -> HostChunk:
        """The verified payload in host memory (a pooled buffer from `pool`,
        or a view of the tier's own memory); the caller releases it. Raises
        ChunkMiss when the entry cannot be restored."""

    def header_of(self, group: int, key: ChunkKey) -> ChunkHeader | None:
        """The header an entry's bytes carry, read from the tier (warm start knows an entry by its
        key only); None where the tier cannot say. Checked again by `get` with the payload."""
        return None

    def signer(self) -> Signer | None:
        """What this tier signs its entries with (a deployment key), so that a copy of the payload
        made for it can feed the MAC in its own pass (`HostChunk.fill`); None: it signs nothing."""
        return None

    def get_to_scatter(self, header: ChunkHeader, placement: Placement, pool: BufferPool) -> HostChunk:
        """As `get`, for a caller that copies the payload into pages it can give up (a load
        into blocks that vLLM frees, uncached, when the load fails): the tier may leave the
        payload's CRC or its MAC's hash to that copy's pass (`HostChunk.crc_due`, `mac_due`),
        which must settle it with `HostChunk.check` before the load counts or the bytes go
        anywhere else."""
        return self.get(header, placement, pool)

    def close(self) -> None:
        return None


# (group, key) -> does a tier below hold this entry? (eviction in a stack)
Backed = Callable[[int, ChunkKey], bool]
OptionsT = TypeVar("OptionsT")  # a tier's own options type


@dataclass(frozen=True)
class TierContext:
    """What every tier is built from besides its options."""

    planner: HybridOffloadPlanner
    fingerprint: Fingerprint  # this worker rank's (its files, its layout)
    index_fingerprint: Fingerprint  # rank 0's: what the scheduler looks up for every rank
    world_size: int = 1  # tensor-parallel ranks
    # The workers run in processes other than the scheduler's (TP>1, or a
    # multiprocess executor): in-process state is not shared between the halves.
    separate_workers: bool = False
    # The owners of the cache directories (and LMCache engines) these tiers
    # open, shared by reference count (offload/store/cachedir/owners.py). Tiers
    # built with the same object share them; a fresh one shares nothing.
    # The caller builds it (`CacheDirs()`, or `CacheDirs.attached`).
    dirs: CacheDirs = field(kw_only=True, compare=False, repr=False)


class TierSpec(ABC, Generic[OptionsT]):
    """One kind of tier (in the manner of vLLM's `kv_offload/mediums.py`):
    its `store` name, its options, and the two halves it builds."""

    store: ClassVar[str]
    # vLLM's CacheHitSource name for hits served from this tier ("HOST", "DISK"):
    # a class default that an instance may override by its options (LMCache with a remote).
    hit_source: str

    def __init__(self, options: OptionsT, ctx: TierContext) -> None:
        self.options = options
        self.ctx = ctx

    def check(self) -> None:
        """Start-up checks in the scheduler process; raises OptionError."""
        return None

    def describe(self) -> str:
        """One line for the start-up log."""
        return repr(self.options)

    @abstractmethod
    def index(self, backed: Backed | None) -> TierIndex:
        """The scheduler's index. `backed`, in a stack with tiers below this
        one, says whether they hold an entry (an entry only this tier holds is
        never evicted)."""

    @abstractmethod
    def data(self, device: torch.device) -> TierData:
        """The worker's bytes, for a KV cache on `device`."""
