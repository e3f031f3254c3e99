"""The tier stack: tiers fastest first (host memory → files → LMCache), each
built by its `TierSpec` from a `store` name and that store's options. The
one place the stack is wired, for the connector, the tests and the benches.

The scheduler's indices are built bottom-up, so that each tier can ask the
ones below whether an entry has another copy (a tier never evicts an only
copy); the worker's data is one `TierData` per tier, in the same order.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from offload.store import tier_spec
from offload.store.base import Backed, OptionError, TierContext, TierData, TierIndex, TierSpec


class StackOptionError(OptionError):
    """A tier's `OptionError`, with the tier's `position` in the stack
    (fastest first), so that the caller can say which tier it was."""

    def __init__(self, position: int, error: OptionError) -> None:
        super().__init__(str(error))
        self.position = position


class TierStack:
    """The specs of a stack's tiers, fastest first, and the two halves they build."""

    def __init__(self, specs: list[TierSpec]) -> None:
        self.specs = specs

    def check(self) -> None:
        """Every tier's start-up checks, fastest first; raises StackOptionError."""
        for i, spec in enumerate(self.specs):
            try:
                spec.check()
            except OptionError as e:
                raise StackOptionError(i, e) from None

    def indices(self) -> list[TierIndex]:
        """The scheduler's indices, fastest first, built bottom-up (module doc);
        raises StackOptionError."""
        out: list[TierIndex] = []
        for i in reversed(range(len(self.specs))):
            below = list(out)
            backed: Backed | None = None if not below else (
                lambda g, k, below=below: any(ix.contains(g, k) for ix in below))
            try:
                out.insert(0, self.specs[i].index(backed))
            except OptionError as e:
                raise StackOptionError(i, e) from None
        return out

    def data(self, device: torch.device) -> list[TierData]:
        """The worker's bytes of every tier, fastest first, for a KV cache on `device`."""
        return [spec.data(device) for spec in self.specs]


def build_stack(tiers: Iterable[tuple[str, object]], ctx: TierContext) -> TierStack:
    """The stack of `tiers`, (store name, that store's options) fastest first,
    every tier built with `ctx`."""
    return TierStack([tier_spec(store, options, ctx) for store, options in tiers])
