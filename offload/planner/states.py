"""What a stored recurrent state is worth: its class, and how a policy admits it.

On a hybrid model most stored bytes are Mamba/GDN states, and most of them
are never read again: a prompt's state at an internal chunk boundary is read
only when another prompt branches exactly there, while the next turn of a
conversation and a repeat read only the prompt's tail. So each stored state
carries a class, decided by the scheduler half from what it knows of the
request (`HybridOffloadPlanner.state_class`), and the connector's
`state_policy` turns the class into an admission that every tier applies
(host memory and files by where the entry enters their eviction order, LMCache
by whether it is stored at all). Attention entries are always admitted hot:
they are what every later boundary of the chain needs.
"""

from __future__ import annotations

import enum


class StateClass(str, enum.Enum):
    """Why a state was stored; the value is the metric label."""

    TAIL = "tail"  # the prompt's last whole-chunk boundary
    # The prompt's partial tail (a boundary past its last whole chunk): under
    # `by_use` both its halves, attention page and state, enter cold. They
    # save at most a chunk's tokens for 53 MB on Qwen3-Next-80B, the least
    # worth per byte of anything stored; and a repeat or next turn that
    # misses it still restores up to the whole-chunk tail.
    PARTIAL = "partial"
    BRANCH = "branch"  # where the prompt's lookup found a stored prefix ending before the prompt does
    INTERNAL = "internal"  # any other chunk boundary inside the prompt


class StatePolicy(str, enum.Enum):
    """The connector's `state_policy`."""

    # Every state enters hot, like attention (the behaviour before classes existed).
    ALL = "all"
    # Every state is stored; internal ones and the partial tail enter at the cold
    # end of the eviction order (first to go unless a lookup reads them), the
    # whole-chunk tail and branch points hot.
    BY_USE = "by_use"
    # Internal states are not stored at all; the rest enter hot.
    TAILS = "tails"


DEFAULT_STATE_POLICY = StatePolicy.BY_USE


class Admission(enum.Enum):
    """How a tier takes a new entry."""

    HOT = "hot"  # at the recent end of its eviction order
    COLD = "cold"  # at the cold end: evicted first unless read
    SKIP = "skip"  # not stored


def admission(policy: StatePolicy, cls: StateClass | None) -> Admission:
    """The admission of an entry of class `cls` (None: neither a state nor a
    hybrid's partial tail) under `policy`."""
    if policy is StatePolicy.ALL or cls in (None, StateClass.TAIL, StateClass.BRANCH):
        return Admission.HOT
    if cls is StateClass.PARTIAL:
        return Admission.COLD if policy is StatePolicy.BY_USE else Admission.HOT
    return Admission.COLD if policy is StatePolicy.BY_USE else Admission.SKIP
