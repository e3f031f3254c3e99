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

    TAIL = "tail"  # the prompt's last whole-chunk boundary, or its partial tail
    BRANCH = "branch"  # where the prompt's lookup found a stored prefix ending before the prompt does
    INTERNAL = "internal"  # any other chunk boundary inside the prompt


class StatePolicy(str, enum.Enum):
    """The connector's `state_policy`."""

    # Every state enters hot, like attention (the behaviour before classes existed).
    ALL = "all"
    # Every state is stored; internal ones enter at the cold end of the eviction
    # order (first to go unless a lookup reads them), tails and branch points hot.
    BY_USE = "by_use"
    # Internal states are not stored at all.
    TAILS = "tails"


DEFAULT_STATE_POLICY = StatePolicy.BY_USE


class Admission(enum.Enum):
    """How a tier takes a new entry."""

    HOT = "hot"  # at the recent end of its eviction order
    COLD = "cold"  # at the cold end: evicted first unless read
    SKIP = "skip"  # not stored


def admission(policy: StatePolicy, cls: StateClass | None) -> Admission:
    """The admission of an entry of class `cls` (None: not a state) under `policy`."""
    if cls is None or cls is not StateClass.INTERNAL or policy is StatePolicy.ALL:
        return Admission.HOT
    return Admission.COLD if policy is StatePolicy.BY_USE else Admission.SKIP
