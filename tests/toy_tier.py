"""A toy tier, as docs/tiers.md's recipe adds one: this module and one registration line,

    TIERS["toy"] = "toy_tier:ToyOptions"

(a test sets it with `monkeypatch.setitem(offload.store.TIERS, "toy", "toy_tier:ToyOptions")`).
Its files go through the one chunk writer and reader (`FileStore`); its index is the set of
entries it was given, as host memory's models what it stores, so it never asks the directory.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, ClassVar, Literal

import torch
from pydantic import Field, Strict
from pydantic.dataclasses import dataclass

from offload.keys import ChunkKey
from offload.planner import Admission, StateClass
from offload.store.base import Backed, HostChunk, Placement, TierData, TierIndex, TierSpec
from offload.store.buffers import BufferPool
from offload.store.files import FileStore
from offload.store.format import ChunkHeader
from offload.store.options import OPTIONS_CONFIG, StoreOptions


@dataclass(frozen=True, config=OPTIONS_CONFIG)
class ToyOptions(StoreOptions):
    """Options of the toy tier (`"store": "toy"`)."""

    tier: ClassVar[str] = "toy_tier:ToyTier"
    help: ClassVar[str] = "a toy: files, indexed by what it was given"
    holds_files: ClassVar[bool] = True

    path: Annotated[str, Strict(), Field(pattern=r"^/", description="absolute directory of its files")]
    store: Literal["toy"] = dataclasses.field(default="toy", kw_only=True)


class ToyIndex(TierIndex):
    def __init__(self) -> None:
        self.held: set[tuple[int, bytes]] = set()

    def contains(self, group: int, key: ChunkKey) -> bool:
        return (group, bytes(key)) in self.held

    def reserve(self, group: int, key: ChunkKey, parent: ChunkKey | None,
                admission: Admission = Admission.HOT, state: StateClass | None = None) -> Placement | None:
        if admission is Admission.SKIP or self.contains(group, key):
            return None
        self.held.add((group, bytes(key)))
        return Placement()

    def pin(self, group: int, key: ChunkKey) -> Placement | None:
        return Placement() if self.contains(group, key) else None

    def forget(self, group: int, key: ChunkKey) -> None:
        self.held.discard((group, bytes(key)))


class ToyData(TierData):
    def __init__(self, store: FileStore) -> None:
        self.store = store

    def record_layout(self, description: dict) -> None:
        self.store.write_layout(description)

    def holds(self, header: ChunkHeader, placement: Placement) -> bool:
        return self.store.file_path(header.group, header.key).exists()

    def put(self, header: ChunkHeader, chunk: HostChunk, placement: Placement) -> bool:
        return self.store.write(header, chunk.payload)

    def get(self, header: ChunkHeader, placement: Placement, pool: BufferPool) -> HostChunk:
        chunk = HostChunk.pooled(pool, header.payload_len)
        try:
            self.store.read_into(header, chunk.payload)
        except BaseException:
            chunk.release()
            raise
        return chunk

    def close(self) -> None:
        self.store.close()


class ToyTier(TierSpec[ToyOptions]):
    store = "toy"
    hit_source = "DISK"

    def index(self, backed: Backed | None) -> ToyIndex:
        return ToyIndex()

    def data(self, device: torch.device) -> ToyData:
        return ToyData(FileStore.open(self.options.path, self.ctx.fingerprint, dirs=self.ctx.dirs))
