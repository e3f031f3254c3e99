"""Warm start: after a restart, or on a new instance of a shared cache directory,
copy the most recently used entries of the files into host memory in the
background, before a request asks for them.

Scheduler half (`WarmPlanner`): once the file tier's housekeeper has loaded
the ledger index and gathered the candidates from it (on its own thread, at
start-up: a pass over every entry the scheduling path must not make), choose entries most recent first,
prefix-closed (an attention entry only with the one it chains from, a
recurrent state only with its chunk's attention entry and that one's chain;
files stored cold and not read from the files since come last: the worth
model's eviction order), within `warm_start_share` of host memory and only in its free room
(it never evicts); reserve each there and hand the list to the worker with
the next step. Each is offered at once: a load planned from its slot before
the bytes land waits for them or reads them itself. The worker's report
settles each entry (`promotion_done`): kept, or dropped where a read failed.
vLLM calls the scheduler half only while it schedules, so warming starts with
the engine's first step (its first request).

Worker half (`WarmReader`): one thread reads each entry from
its tier (header first: warm start knows an entry by its key only), verifies it
like any load (CRC or MAC) and copies it into its slot, in the planned order,
pausing while a request's load is in flight (normal priority: a load may wait
for its read). A load that needs an entry still queued takes it over (reads
it once and fills the slot from the same bytes); one that needs an entry
being read waits for it, then reads host memory; where warm start failed it
reads the file.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

from vllm.logger import init_logger

from offload.connector.cpus import run_on
from offload.connector.metadata import TierSlot, WarmEntry
from offload.connector.registration import KVCache
from offload.keys import ChunkKey
from offload.metrics import Recorder
from offload.planner import GroupKind
from offload.store.base import ChunkMiss, HostChunk, MissReason, Placement, TierIndex, WarmCandidate
from offload.store.format import ChunkHeader

logger = init_logger(__name__)

Node = tuple[int, bytes]  # (group, key)


def choose(cands: Sequence[WarmCandidate], chained: Sequence[bool], anchor: int | None,
           budget: int) -> list[WarmCandidate]:
    """The entries to warm: most recent first, each with what it needs (prefix closure), while
    their bytes fit `budget`. Returned in an order where every entry comes after the entries it
    needs."""
    by_prefix = {(c.group, c.key[:8]): c for c in cands if chained[c.group]}
    by_key = {(c.group, c.key): c for c in cands}
    chosen: dict[Node, WarmCandidate] = {}
    total = 0
    for c in sorted(cands, key=lambda c: -c.t):
        if (c.group, c.key) in chosen:
            continue
        need = [c]
        node: WarmCandidate | None = c
        if not chained[c.group] and anchor is not None:  # a state: its chunk's attention entry first
            node = by_key.get((anchor, c.key))
            if node is None:
                continue
            need.append(node)
        ok = True
        while node is not None and node.parent is not None:
            parent = by_prefix.get((node.group, node.parent))
            if parent is None or len(need) > len(cands):  # its chain is not there (or loops)
                ok = False
                break
            if (parent.group, parent.key) in chosen:
                break
            need.append(parent)
            node = parent
        if not ok:
            continue
        need = [n for n in need if (n.group, n.key) not in chosen]
        more = sum(n.size for n in need)
        if total + more > budget:
            continue
        total += more
        for n in reversed(need):
            chosen[(n.group, n.key)] = n
    return list(chosen.values())


class WarmPlanner:
    """Scheduler half (module doc): the plan, made once, and its settlement."""

    def __init__(self, indices: list[TierIndex], kinds: Sequence[GroupKind], source: int, share: float,
                 world_size: int, recorder: Recorder) -> None:
        self.indices = indices
        self.chained = [k is not GroupKind.MAMBA for k in kinds]
        full = [g for g, k in enumerate(kinds) if k is GroupKind.FULL_ATTENTION]
        self.anchor = full[0] if full else None
        self.source = source
        self.share = share
        self.world_size = world_size
        # Ranks' reports so far of an entry every rank has not reported yet: (reports, all landed).
        self._heard: dict[Node, tuple[int, bool]] = {}
        self.recorder = recorder
        self.planned = False
        self._pending: list[WarmEntry] = []
        indices[source].warm_candidates()  # asks for them now: the tier gathers them in the background
        recorder.declare("kvoffload_warm_hits")

    def poll(self) -> None:
        """Make the plan once the source's candidates are known (then never again): called before
        each lookup and each step, so that a lookup after the plan finds its entries."""
        if self.planned:
            return
        cands = self.indices[self.source].warm_candidates()
        if cands is None:
            return
        self.planned = True
        top = self.indices[0].usage()
        capacity = top.capacity_bytes if top is not None and top.capacity_bytes else 0
        chosen = choose(cands, self.chained, self.anchor, int(capacity * self.share))
        full = {(c.group, c.key[:8]): c.key for c in chosen if self.chained[c.group]}
        for c in chosen:
            parent = full.get((c.group, c.parent)) if self.chained[c.group] and c.parent is not None else None
            placement = self.indices[0].reserve_warm(c.group, ChunkKey(c.key),
                                                     None if parent is None else ChunkKey(parent))
            if placement is not None:  # else taken meanwhile, or no free room: its children fail the same way
                self._pending.append(WarmEntry(c.group, c.key, self.source, TierSlot(0, placement.slot)))
        logger.info("kvoffload: warm start: %d of %d entries in the files planned into host memory",
                    len(self._pending), len(cands))

    def take(self) -> tuple[WarmEntry, ...]:
        """The planned entries not yet handed to the worker (for the step's metadata)."""
        self.poll()
        out, self._pending = tuple(self._pending), []
        return out

    def settle(self, warmed: Sequence[tuple[int, bytes, bool]]) -> None:
        """The workers' reports: an entry every rank put in place is offered from now on; one that
        any rank could not is dropped."""
        for g, key, ok in warmed:
            n, all_ok = self._heard.pop((g, key), (0, True))
            n, all_ok = n + 1, all_ok and ok
            if n < self.world_size:
                self._heard[(g, key)] = (n, all_ok)
            else:
                self.indices[0].promotion_done(g, ChunkKey(key), landed=all_ok)


class _Warm:
    __slots__ = ("done", "entry", "ok", "reported", "status", "users")

    def __init__(self, entry: WarmEntry) -> None:
        self.entry = entry
        self.status = "queued"  # -> "reading" (the warm thread) or "taken" (a load) -> "done"
        self.ok = False
        self.done = threading.Event()
        # Loads reading its slot: until they end it is not reported, so the scheduler keeps the
        # slot held (pending) and cannot give it to another entry under them.
        self.users = 0
        self.reported = False


class WarmReader:
    """Worker half (module doc)."""

    def __init__(self, kv: KVCache, loads_busy: Callable[[], bool], recorder: Recorder,
                 cpus: frozenset[int] | None = None) -> None:
        self.kv = kv
        self._cpus = cpus  # where its thread runs (offload/connector/cpus.py)
        self.loads_busy = loads_busy
        self.rec = recorder
        self._lock = threading.Lock()
        self._entries: dict[Node, _Warm] = {}
        self._queue: deque[_Warm] = deque()
        self._unreported: list[_Warm] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.planned = self.settled = 0
        self._t0: float | None = None
        self.seconds = 0.0
        for name in ("kvoffload_warm_entries", "kvoffload_warm_bytes"):
            recorder.declare(name)
        for reason in (*(m.value for m in MissReason), "no_room"):
            recorder.declare("kvoffload_warm_failures", reason=reason)

    # ---- the plan ----------------------------------------------------------------------

    def start(self, entries: Sequence[WarmEntry]) -> None:
        if not entries or self._stop.is_set():
            return
        with self._lock:
            for e in entries:
                w = _Warm(e)
                self._entries[(e.group, bytes(e.key))] = w
                self._queue.append(w)
            self.planned += len(entries)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvoffload-warm", daemon=True)
            self._thread.start()

    @property
    def done(self) -> bool:
        return self.planned > 0 and self.settled == self.planned

    def take_report(self) -> tuple[tuple[int, bytes, bool], ...]:
        """The entries settled since the last call, but those a load still reads (next time)."""
        with self._lock:
            ready = [w for w in self._unreported if not w.users]
            self._unreported = [w for w in self._unreported if w.users]
            for w in ready:
                w.reported = True
        return tuple((w.entry.group, bytes(w.entry.key), w.ok) for w in ready)

    def report(self) -> None:
        """Gauges into the metrics, once per step."""
        self.rec.set("kvoffload_warm_planned_entries", self.planned)
        self.rec.set("kvoffload_warm_done", 1 if self.done else 0)
        self.rec.set("kvoffload_warm_seconds", round(self.seconds, 3) if self.done else 0)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    # ---- the thread --------------------------------------------------------------------

    def _run(self) -> None:
        run_on(self._cpus)
        while not self._stop.is_set():
            while self.loads_busy() and not self._stop.is_set():
                self._stop.wait(0.002)  # a request's load goes first
            with self._lock:
                w = None
                while self._queue and w is None:
                    w = self._queue.popleft()
                    if w.status != "queued":  # a load took it over
                        w = None
                if w is None:
                    return
                w.status = "reading"
            if self._t0 is None:
                self._t0 = time.perf_counter()
            self._settle(w, self._copy(w.entry))

    def _copy(self, e: WarmEntry) -> str | None:
        """Read, verify and copy one entry up; None, or the reason it failed."""
        src = self.kv.tiers[e.source]
        header = src.header_of(e.group, ChunkKey(e.key))
        if header is None:
            return MissReason.MISSING.value
        try:
            chunk = src.get(header, Placement(None), self.kv.buffers)
        except ChunkMiss as m:
            return m.reason.value
        except Exception:
            logger.exception("kvoffload: warm start read of %s failed", e.key.hex()[:16])
            return MissReason.ERROR.value
        try:
            chunk.check()
            self.kv.tiers[0].put(header, chunk, Placement(e.slot.slot))
        except ChunkMiss as m:
            return m.reason.value
        except Exception as ex:  # a slot too small for what the file holds, or a copy error
            logger.warning("kvoffload: warm start of %s dropped: %s", e.key.hex()[:16], ex)
            return "no_room"
        finally:
            chunk.release()
        self.rec.inc("kvoffload_warm_bytes", header.payload_len)
        return None

    def _settle(self, w: _Warm, failed: str | None) -> None:
        w.ok = failed is None
        if failed is None:
            self.rec.inc("kvoffload_warm_entries")
        else:
            self.rec.inc("kvoffload_warm_failures", reason=failed)
        with self._lock:
            w.status = "done"
            self._unreported.append(w)
            self.settled += 1
            if self.settled == self.planned and self._t0 is not None:
                self.seconds = time.perf_counter() - self._t0
                logger.info("kvoffload: warm start done: %d of %d entries in %.2f s",
                            sum(1 for x in self._entries.values() if x.ok), self.planned, self.seconds)
        w.done.set()

    # ---- a load that needs a warm entry --------------------------------------------------

    def serve(self, tier: int, header: ChunkHeader) -> tuple[HostChunk | None, TierSlot | None, int]:
        """For a load planned to read `header` from `tier`: (its bytes in host memory, where warm start
        put them and has not reported them yet: the load calls `unserve` once it scattered them; or
        None), (warm start's slot, where the load takes the entry over and fills it from the bytes it
        reads: it calls `filled`; or None), and the tier to read from (the file tier where the
        planned host-memory slot is not filled yet and the load takes over, or warm start failed)."""
        w = self._entries.get((header.group, bytes(header.key)))
        if w is None or tier not in (0, w.entry.source) or (tier == 0 and w.entry.slot.tier != 0):
            return None, None, tier
        with self._lock:
            if w.status == "queued":
                w.status = "taken"
                return None, w.entry.slot, w.entry.source
            if w.reported:  # the scheduler knows: read as it planned, the file where warm start failed
                return None, None, tier if tier != 0 or w.ok else w.entry.source
            w.users += 1
        w.done.wait()  # the warm thread's read, or another load's that took it over
        top = self.kv.tiers[0]
        placement = Placement(w.entry.slot.slot)
        if w.ok and top.holds(header, placement):
            if tier == 0:  # the scheduler's pin holds the slot
                self.unserve(header)
                return None, None, 0
            return top.get(header, placement, self.kv.buffers), None, tier
        self.unserve(header)
        return None, None, w.entry.source

    def unserve(self, header: ChunkHeader) -> None:
        w = self._entries.get((header.group, bytes(header.key)))
        if w is not None:
            with self._lock:
                w.users -= 1

    def filled(self, header: ChunkHeader, failed: str | None) -> None:
        """A load that took an entry over put it into its slot (None), or could not (the reason)."""
        w = self._entries.get((header.group, bytes(header.key)))
        if w is not None and w.status == "taken":
            if failed is None:
                self.rec.inc("kvoffload_warm_bytes", header.payload_len)
            self._settle(w, failed)
