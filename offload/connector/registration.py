"""The worker's view of vLLM's KV cache, made at registration.

Contract: `KVCache.register` turns the tensors vLLM registers into one
`GroupPages` per KV cache group (behind the sleep-mode gate, `kv_gate.py`),
checks each group's bytes per block against the planner's spec, and builds
the tiers' worker data for the cache's device (each told the layout once).
From then on `pages`, `tiers` and `buffers` are what the load and store
paths copy with, and `header` frames an entry of this cache.

Partial-tail masks live here, not with the store path that applies them: a
token map is a property of the registered tensors (which token owns each
byte of a page, probed once per tensor shape from the layer's own cache
write), so it is built here at start-up, when the tensors are known and no
request waits; the store path only asks `mask_tail` to zero a partial
tail's stale slots before a write.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future

import torch
from vllm.logger import init_logger

from offload.connector.kv_gate import GatedPages, KVGate
from offload.connector.metadata import FileRef
from offload.copier import GroupPages, LayerPages
from offload.keys import ChunkKey, Fingerprint
from offload.planner import ChunkIndex, GroupIndex, GroupKind, HybridOffloadPlanner
from offload.store.base import TierData
from offload.store.buffers import BufferPool
from offload.store.format import ChunkHeader, file_bytes
from offload.tailmask import TokenMap

logger = init_logger(__name__)

# Which token owns each element of a page: (group, tensor, block dim) -> its TokenMap.
TokenMapper = Callable[[int, torch.Tensor, int], TokenMap]


def _describe(name: str, t: torch.Tensor, num_blocks: int) -> str:
    """A tensor's page layout independent of how many blocks it has: dtype,
    the dims before the block dim (segments), and the dims after it with
    their strides (one segment's bytes)."""
    d = list(t.shape).index(num_blocks)
    return f"{name}:{t.dtype}:pre{tuple(t.shape[:d])}:post{tuple(t.shape[d + 1:])}/{tuple(t.stride()[d + 1:])}"


class KVCache:
    """The registered KV cache, the tiers' worker data and the host buffers, shared by the load and store paths."""

    def __init__(self, planner: HybridOffloadPlanner, fingerprint: Fingerprint,
                 make_data: Callable[[torch.device], list[TierData]], layer_names: list[list[str]],
                 token_map: TokenMapper | None = None) -> None:
        self.planner = planner
        self.fingerprint = fingerprint
        self.layer_names = layer_names
        self._make_data = make_data
        self.tiers: list[TierData] = []
        self.pages: list[GatedPages] = []  # per group, behind the sleep-mode gate
        self.buffers = BufferPool()
        self._gate = KVGate()
        # Partial tails: per attention group, which token owns each byte of a
        # page (built at registration; None where it cannot be known).
        self._token_map = token_map
        self._token_maps: dict[int, list[TokenMap] | None] = {}
        self._tensors: dict[int, list[torch.Tensor]] = {}
        self._num_blocks = 0  # the KV cache's, set at registration

    def register(self, kv_caches: dict[str, torch.Tensor], num_blocks: int, layout: dict,
                 queued: Callable[[int], Callable[[int, bytes], Future[None] | None]]) -> None:
        """Page tables of every group, then the tiers for the cache's device;
        tier `i` asks `queued(i)` for the writes still on their way to it."""
        self._num_blocks = num_blocks
        tensors: dict[str, list[str]] = {}
        device = torch.device("cpu")
        for g, names in enumerate(self.layer_names):
            layers: list[LayerPages] = []
            for name in names:
                t = kv_caches[name]
                for part in t if isinstance(t, (list, tuple)) else [t]:
                    layers.append(LayerPages.from_tensor(part, num_blocks))
                    self._tensors.setdefault(g, []).append(part)
                    tensors.setdefault(f"g{g}", []).append(_describe(name, part, num_blocks))
            first = kv_caches[names[0]]
            device = (first[0] if isinstance(first, (list, tuple)) else first).device
            pages = GroupPages(layers, num_blocks, device)
            expected = self.planner.groups[g].page_bytes
            if pages.page_bytes != expected:
                raise RuntimeError(
                    f"KV cache group {g}: registered tensors hold {pages.page_bytes} bytes per block, "
                    f"the KV cache spec says {expected}; this backend's layout is not supported"
                )
            self.pages.append(GatedPages(pages, self._gate))
        # Pinned where the copy kernel reads or writes host memory from CUDA.
        self.buffers = BufferPool(pinned=device.type == "cuda")
        self.tiers = self._make_data(device)
        for i, tier in enumerate(self.tiers):
            tier.record_layout({**layout, "tensors": tensors})
            tier.queued = queued(i)
        # Map partial tails' attention pages now, at start-up: the first tail store would
        # otherwise probe them inside the step that returns its prompt's first token (tens of
        # ms on 1152-token blocks, paid by the first request after every restart).
        unit = self.planner.tail_unit
        for g, spec in enumerate(self.planner.groups):
            if unit and spec.kind is GroupKind.FULL_ATTENTION and spec.block_size % unit == 0 \
                    and unit < spec.block_size:
                self._maps(g)

    @property
    def token_mapped_groups(self) -> list[int]:
        """Attention groups whose partial-tail token maps are built."""
        return sorted(g for g, m in self._token_maps.items() if m is not None)

    def file_bytes(self) -> list[int]:
        """Each group's whole-chunk file size (header and payload): the load buffers most used."""
        out = []
        for g, spec in enumerate(self.planner.groups):
            pages = len(self.planner.stored(GroupIndex(g), ChunkIndex(0)).blocks) or 1  # Mamba: one state page
            out.append(file_bytes(pages * spec.page_bytes))
        return out

    def header(self, ref: FileRef) -> ChunkHeader:
        """The chunk header of entry `ref` of this KV cache."""
        return ChunkHeader(
            fingerprint=self.fingerprint, key=ChunkKey(ref.key), group=ref.group, kind=ref.kind,
            token_start=ref.token_start, token_end=ref.token_end, num_pages=ref.num_pages,
            page_bytes=self.pages[ref.group].page_bytes, parent=ref.parent, parent_key=ref.parent_key,
        )

    # ---- sleep mode -----------------------------------------------------------------

    def release(self) -> bool:
        """Wait for the copies in progress, refuse later ones (KVCacheReleased)
        and drop the page tables with their raw addresses. False where it is released already."""
        if not self._gate.open:
            return False
        self._gate.close()
        for p in self.pages:
            p.drop()
        return True

    def retake(self) -> bool:
        """Page tables from the same tensors' current addresses, then copies
        are allowed. False where it was not released."""
        if self._gate.open:
            return False
        for p in self.pages:
            p.retake()
        self._gate.reopen()
        return True

    # ---- partial tails --------------------------------------------------------------

    def _maps(self, group: int) -> list[TokenMap] | None:
        """Token maps of a group's layers (one per registered tensor), or None."""
        if group not in self._token_maps:
            maps: list[TokenMap] | None = None
            if self._token_map is not None:
                try:
                    by_shape: dict[tuple, TokenMap] = {}
                    maps = []
                    for t in self._tensors[group]:
                        shape = (tuple(t.shape), t.dtype)
                        if shape not in by_shape:
                            by_shape[shape] = self._token_map(group, t, list(t.shape).index(self._num_blocks))
                        maps.append(by_shape[shape])
                except Exception as e:
                    logger.warning("kvoffload: partial tails of KV cache group %d cannot be stored: %s", group, e)
                    maps = None
            self._token_maps[group] = maps
        return self._token_maps[group]

    def mask_tail(self, ref: FileRef, payload: torch.Tensor) -> bool:
        """A partial tail's attention entry: zero the last block's slots from
        its boundary on (stale or later KV), so the entry is a function of
        its prefix alone; True where it did. Raises where that cannot be done
        (the store is dropped)."""
        spec = self.planner.groups[ref.group]
        valid = ref.token_end % spec.block_size
        if spec.kind is not GroupKind.FULL_ATTENTION or valid == 0:
            return False
        maps = self._maps(ref.group)
        if maps is None:
            raise RuntimeError(f"no token map for KV cache group {ref.group}: partial tail not stored")
        offset = 0
        for lp, tm in zip(self.pages[ref.group].layers, maps):
            last = offset + (ref.num_pages - 1) * lp.page_bytes
            tm.zero_from(payload[last:last + lp.page_bytes], valid)
            offset += ref.num_pages * lp.page_bytes
        return True
