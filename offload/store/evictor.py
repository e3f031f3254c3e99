"""Eviction order that keeps presence prefix-closed: the oldest *leaf* first.

The lookup binary-searches a request's chain of files, assuming that if
chunk k is stored so is every chunk before it. So a node (a file, or a
chunk in `kvoffload gc`) is evicted only when no stored node chains from it
(its children name it); until then it is *parked*, and it goes back into
the queue when its last child goes. Nodes without links (Mamba states) are
plain LRU.

`LeafQueue` is the order alone, shared by the connector's byte budget
(`offload.store.cachedir.budget`) and `kvoffload gc`; what a node is, how recent it
is and how it is deleted belong to the caller.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

N = TypeVar("N")  # a node: what is evicted
L = TypeVar("L", bound=Hashable)  # a link: how a node's children name it


class LeafQueue(Generic[N, L]):
    """A min-queue of nodes by recency whose `pop` yields only leaves.

    Contract: `push(recency, node)` may be called again for a node whose
    recency changed (the old entry goes stale: `pop` skips an entry whose
    recency is not the node's current one). `link(l)` / `unlink(l)` count the
    stored children naming link `l`; `unlink` of the last child returns the
    node parked under `l`, which the caller pushes again with its current
    recency.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[Any, N]] = []
        self._children: dict[L, int] = {}
        self._parked: dict[L, N] = {}

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, recency: Any, node: N) -> None:
        heapq.heappush(self._heap, (recency, node))

    def link(self, link: L) -> None:
        self._children[link] = self._children.get(link, 0) + 1

    def unlink(self, link: L) -> N | None:
        n = self._children.get(link, 0) - 1
        if n > 0:
            self._children[link] = n
            return None
        self._children.pop(link, None)
        return self._parked.pop(link, None)  # a leaf now: back in the queue

    def has_children(self, link: L) -> bool:
        return self._children.get(link, 0) > 0

    def rebuild(self, items: list[tuple[Any, N]]) -> None:
        """Replace the queue with `items` ((recency, node) each) and unpark every node."""
        self._heap = items
        heapq.heapify(self._heap)
        self._parked.clear()

    def clear(self) -> None:
        self._heap = []
        self._children = {}
        self._parked = {}

    def pop(self, current: Callable[[N], Any], link_of: Callable[[N], L | None]) -> N | None:
        """The oldest leaf, or None when the queue is empty. `current(node)`
        is the node's recency now (None: gone), `link_of(node)` the link its
        children name it by (None: it has none)."""
        while self._heap:
            recency, node = heapq.heappop(self._heap)
            if current(node) != recency:
                continue  # superseded: a newer entry is queued, or the node is gone
            link = link_of(node)
            if link is not None and self._children.get(link, 0) > 0:
                self._parked[link] = node  # not a leaf: back in the queue when its last child goes
                continue
            return node
        return None
