"""Sleep mode on the worker side: copies touch the KV cache only while vLLM
has it registered.

vLLM's sleep mode (0.33+) calls `unregister_kv_caches` and then unmaps the KV
cache's memory, and maps it again before `restore_kv_caches`. Every gather and
scatter holds the gate; closing it waits for the copies in progress and makes
later ones raise `KVCacheReleased`, which the worker turns into a miss and a
recompute (loads) or a dropped store.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, cast

from offload.copier import GroupPages, LayerPages

if TYPE_CHECKING:
    import torch

__all__ = ["GatedPages", "KVCacheReleased", "KVGate"]


class KVCacheReleased(RuntimeError):
    """A copy into or out of the KV cache while vLLM has it released (sleep mode)."""


class KVGate:
    """Open while the KV cache is registered; `hold` around every copy."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._active = 0
        self.open = True

    @contextmanager
    def hold(self) -> Iterator[None]:
        """Raises KVCacheReleased where the gate is closed; else the copy may run until the block exits."""
        with self._cond:
            if not self.open:
                raise KVCacheReleased("the KV cache is released (vLLM sleeps): nothing is copied into or out of it")
            self._active += 1
        try:
            yield
        finally:
            with self._cond:
                self._active -= 1
                self._cond.notify_all()

    def close(self) -> None:
        """Refuse new copies, then wait for the ones in progress."""
        with self._cond:
            self.open = False
            self._cond.wait_for(lambda: self._active == 0)

    def reopen(self) -> None:
        with self._cond:
            self.open = True


class GatedPages:
    """A group's GroupPages behind the gate; after `drop` only its tensors
    are kept, and `retake` builds the page table afresh from their addresses."""

    def __init__(self, pages: GroupPages, gate: KVGate) -> None:
        self._pages: GroupPages | None = pages
        self._gate = gate
        self._page_bytes = pages.page_bytes
        # Pages registered from tensors (LayerPages.from_tensor) hold them.
        self._tensors = [cast("torch.Tensor", lp.tensor) for lp in pages.layers]
        self._num_blocks, self._device = pages.num_blocks, pages.device

    @property
    def page_bytes(self) -> int:
        return self._page_bytes

    def gather(self, *args: Any, **kwargs: Any) -> Any:
        with self._gate.hold():  # open: the pages are there
            return cast(GroupPages, self._pages).gather(*args, **kwargs)

    def gather_crc(self, *args: Any, **kwargs: Any) -> int | None:
        with self._gate.hold():
            return cast(GroupPages, self._pages).gather_crc(*args, **kwargs)

    def scatter(self, *args: Any, **kwargs: Any) -> int | None:
        with self._gate.hold():
            return cast(GroupPages, self._pages).scatter(*args, **kwargs)

    def drop(self) -> None:
        self._pages = None

    def retake(self) -> None:
        pages = GroupPages([LayerPages.from_tensor(t, self._num_blocks) for t in self._tensors],
                           self._num_blocks, self._device)
        if pages.page_bytes != self._page_bytes:
            raise RuntimeError(f"restore_kv_caches: the KV cache now holds {pages.page_bytes} bytes per block, "
                               f"it held {self._page_bytes}")
        self._pages = pages

    def __getattr__(self, name: str) -> Any:
        if self._pages is None:
            raise KVCacheReleased(f"the KV cache is released (vLLM sleeps): no {name}")
        return getattr(self._pages, name)
