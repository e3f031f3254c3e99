"""What a stored entry is worth: the one worth model every tier, `kvoffload gc` and the replay ask.

On a hybrid model most stored bytes are Mamba/GDN states, and most of them
are never read again: a prompt's state at an internal chunk boundary is read
only when another prompt branches exactly there, while the next turn of a
conversation and a repeat read only the prompt's tail. So each stored state
carries a class (`state_class`, from what the scheduler half knows of the
request), and the connector's `state_policy` turns the class into an
admission (`admission`). Attention entries are always admitted hot: they are
what every later boundary of the chain needs; only the attention half of a
hybrid's partial tail goes with its state (`attention_class`).

This module alone decides worth (`tests/test_architecture.py` checks that no
other module holds a cold constant or a class rule):

- the classes and their admission under each policy;
- what cold is: admitted cold and not read since (`is_cold`, `cold_after`);
- where cold ranks in every eviction order: below every entry that is not,
  oldest cold first (`tick_rank`, `time_rank`), and what a cold admission may
  displace (`may_displace`);
- what a hit refreshes: everything a load reads becomes hot at the recent end,
  whatever it was admitted as (`refreshes`, `cold_after`);
- what a tier that keeps its own LRU does instead (`own_lru_admits`).

Pure: no I/O, no vLLM.
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


class EvictionReason(str, enum.Enum):
    """Why a state left a tier; the value is the metric label."""

    COLD = "cold"  # admitted cold and never read
    LRU = "lru"  # the least recent of the entries that are not cold


# ---- the class and its admission ----------------------------------------------------------------

def state_class(boundary: int, tail: int, partial: int, branch_at: int = 0, hot_at: int | None = None) -> StateClass:
    """The class of a prompt's recurrent state at `boundary`, given the
    prompt's tail (the last whole-chunk boundary a hit of it reaches), its
    partial-tail boundary (0: none) and where its lookup found a stored or
    cached prefix ending (`branch_at`, 0: none). A repeat and the next turn
    read only the tail; an internal state is read only where another prompt
    branches there. `hot_at`: the whole-chunk boundary classed TAIL instead
    of the tail (`pre_tail`), the tail then internal."""
    if boundary == (tail if hot_at is None else hot_at):
        return StateClass.TAIL
    if boundary == partial:
        return StateClass.PARTIAL
    return StateClass.BRANCH if boundary == branch_at else StateClass.INTERNAL


def pre_tail(tail: int, prompt_tokens: int, chunk: int, within: int) -> int | None:
    """The pre-tail rule, a what-if (`bench.trace_replay`'s `pre_tail`): where
    the tail lies within `within` tokens of the prompt's end, the boundary one
    chunk before it is the prompt's one hot state (a sibling that differs in
    its last tokens branches before the tail); None where the rule keeps the tail."""
    if within and tail > chunk and prompt_tokens - tail <= within:
        return tail - chunk
    return None


def attention_class(partial_tail: bool, hybrid: bool) -> StateClass | None:
    """The class an attention entry is admitted by: on a hybrid the partial
    tail's attention page goes with its state (a hit needs both halves);
    every other attention entry, None: always hot."""
    return StateClass.PARTIAL if partial_tail and hybrid else None


def admission(policy: StatePolicy, cls: StateClass | None) -> Admission:
    """The admission of an entry of class `cls` (None: neither a state nor a
    hybrid's partial tail) under `policy`."""
    if policy is StatePolicy.ALL or cls in (None, StateClass.TAIL, StateClass.BRANCH):
        return Admission.HOT
    if cls is StateClass.PARTIAL:
        return Admission.COLD if policy is StatePolicy.BY_USE else Admission.HOT
    return Admission.COLD if policy is StatePolicy.BY_USE else Admission.SKIP


def cold_classes(policy: StatePolicy | None = None) -> tuple[StateClass, ...]:
    """The classes `policy` admits cold (None: those any policy does), in
    `StateClass` order: where a `cold` eviction can happen at all."""
    policies = tuple(StatePolicy) if policy is None else (policy,)
    return tuple(c for c in StateClass if any(admission(p, c) is Admission.COLD for p in policies))


# ---- cold, and what a hit refreshes -------------------------------------------------------------

def enters_cold(admission: Admission) -> bool:
    """Whether a new entry admitted so enters its tier's eviction order at the cold end."""
    return admission is Admission.COLD


def marked_admission(cold_mark: bool) -> Admission:
    """The admission a stored entry's cold mark (the file ledger's) stands for."""
    return Admission.COLD if cold_mark else Admission.HOT


def is_cold(admitted_cold: bool, read_since: bool) -> bool:
    """Cold: admitted cold and not read since. (`kvoffload gc` asks this of
    a file from its ledger mark and its mtime; the tiers keep the answer on
    each entry through `cold_after`.)"""
    return admitted_cold and not read_since


def refreshes(stored_again: Admission | None = None) -> bool:
    """Whether a use of an entry held moves it to the recent end, hot. A hit
    (`stored_again` None) does: what a load reads is in use, whatever it was
    admitted as. Stored again by another prompt, only where that prompt
    admits it hot; a cold or skipped admission leaves its class as it was."""
    return stored_again is None or stored_again is Admission.HOT


def cold_after(cold: bool, stored_again: Admission | None = None) -> bool:
    """Whether an entry held (`cold`: as it stood) is cold after a use (`refreshes`)."""
    return cold and not refreshes(stored_again)


def may_displace(admission: Admission, victim_cold: bool) -> bool:
    """Whether a new entry admitted so may evict `victim` to make room: a cold
    entry takes only a free slot or another cold entry's (it never displaces
    one in use); a hot one takes any."""
    return not enters_cold(admission) or victim_cold


def eviction_reason(cold: bool) -> EvictionReason:
    return EvictionReason.COLD if cold else EvictionReason.LRU


# ---- the eviction order: cold below every entry that is not, oldest cold first -------------------

# The offset puts every cold rank below every other; each clock's must exceed
# any recency it counts. Ticks (host memory counts one per use) stay exact
# integers; seconds (the file tier's mtimes) keep the ledger's milliseconds at
# 2^40 below now, where 2^52 would round them to whole seconds.
_COLD_TICKS = 1 << 52
_COLD_SECONDS = float(1 << 40)


def tick_rank(tick: int, cold: bool) -> int:
    """An entry's place in an eviction order counted in ticks (lowest first)."""
    return tick - _COLD_TICKS if cold else tick


def time_rank(t: float, cold: bool) -> float:
    """An entry's place in an eviction order counted in seconds (lowest first)."""
    return t - _COLD_SECONDS if cold else t


# ---- a tier that keeps its own order ------------------------------------------------------------

def own_lru_admits(admission: Admission) -> bool:
    """Whether a tier that orders entries by its own LRU (LMCache's pool and
    remote) takes an entry: it has no cold end to put one at, and an entry
    stored at its recent end would outlive hot ones, so it takes hot entries
    only; a read refreshes the entry in its LRU, as a hit does everywhere."""
    return admission is Admission.HOT
