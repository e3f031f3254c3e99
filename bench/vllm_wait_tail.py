"""What-if: vLLM's tiering whose partial-tail search waits for its pending lookup (bench only).

vLLM 0.32's `OffloadingConnectorScheduler._lookup`
(vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py) finds the whole blocks a
request can load, then searches for a partial tail (a boundary inside the next block). A file
tier's (`fs`) lookup is asynchronous: the first time a key is asked for after a restart the answer
is "pending". The tail search waits for a pending answer only where no whole block hit:

    if pending and complete_hit == 0:
        return None          # ask again at the next step
    return complete_hit      # the tail is dropped

so the first request after a restart loads its whole blocks and computes its tail, though the
tail's files are there. This module changes that one condition to `if pending:` (the tail search
waits for its pending lookup, whole-block hit or not) and nothing else, inside the process that
loads it: `CPUHostTieringWaitTailSpec` is bench/vllm_offloading_cpu.py's
`CPUHostTieringOffloadingSpec` that applies the patch when vLLM builds it, so only an engine whose
kv-transfer-config names this spec (bench/vllm_offloading_cpu.py's `wait_tail_kv_config`, the
`vllm-wait-tail` contender of bench/peer_race.py) runs the what-if. The product (offload/) never loads it.

The patch recompiles `_lookup` from vLLM's own source with that one line replaced, in the
scheduler module's namespace; it refuses to apply (RuntimeError) where the source does not hold
the condition exactly once (another vLLM version).
"""

from __future__ import annotations

import inspect
import textwrap
from typing import Any

from bench.vllm_offloading_cpu import CPUHostTieringOffloadingSpec

ORIGINAL = "if pending and complete_hit == 0:"
WAIT_TAIL = "if pending:"


def patch_wait_tail() -> bool:
    """Patch vLLM's `OffloadingConnectorScheduler._lookup` in this process (idempotent); True
    where this call applied it."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading import scheduler as mod

    cls = mod.OffloadingConnectorScheduler
    if getattr(cls._lookup, "kvoffload_wait_tail", False):
        return False
    src = textwrap.dedent(inspect.getsource(cls._lookup))
    if src.count(ORIGINAL) != 1:
        raise RuntimeError(f"vLLM's OffloadingConnectorScheduler._lookup holds {src.count(ORIGINAL)} times "
                           f"{ORIGINAL!r}, not once: this what-if was written for vLLM 0.32's")
    ns: dict[str, Any] = {}
    exec(compile(src.replace(ORIGINAL, WAIT_TAIL), mod.__file__ or "<scheduler>", "exec"), mod.__dict__, ns)
    fn = ns["_lookup"]
    fn.__qualname__ = cls._lookup.__qualname__
    fn.kvoffload_wait_tail = True
    cls._lookup = fn
    return True


class CPUHostTieringWaitTailSpec(CPUHostTieringOffloadingSpec):
    """`CPUHostTieringOffloadingSpec` with the tail search waiting for its pending lookup."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        patch_wait_tail()
        super().__init__(*args, **kwargs)
