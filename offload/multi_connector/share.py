"""One gather per entry and step for a MultiConnector's OffloadConnector children."""

from __future__ import annotations

from offload.connector import SharedGathers
from offload.store.base import HostChunk

__all__ = ["GatherShare"]


class GatherShare(SharedGathers):
    """Host copies gathered in the current step, by (group, key), shared by
    the OffloadConnector children of one MultiConnector in one worker: the
    first child to store an entry gathers it from the KV cache, the next ones
    copy its host bytes (a memcpy, never a second device transfer). The
    MultiConnector clears it after each step's `wait_for_save`."""

    def __init__(self) -> None:
        self._chunks: dict[tuple[int, bytes], HostChunk] = {}

    def get(self, group: int, key: bytes) -> HostChunk | None:
        return self._chunks.get((group, key))

    def offer(self, group: int, key: bytes, chunk: HostChunk) -> None:
        if (group, key) not in self._chunks:
            self._chunks[(group, key)] = chunk.hold()

    def clear(self) -> None:
        """Release every copy: call after every child's `wait_for_save` of the step."""
        chunks, self._chunks = self._chunks, {}
        for c in chunks.values():
            c.release()
