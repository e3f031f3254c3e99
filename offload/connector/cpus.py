"""The CPUs the connector's I/O threads run on.

vLLM-CPU binds its worker's main thread to the model's cores (through its OpenMP runtime's
variables), and a thread inherits the binding of the thread that starts it. The load, store and warm-start
threads, started from vLLM's threads, would share the model's cores and never run on the ones vLLM
keeps from the model (`VLLM_CPU_NUM_OF_RESERVED_CPU`: its API server, its engine core, a KV
connector's threads); on 2 cores with one reserved, every thread of the worker, ours too, ran on
core 0. So each I/O thread takes the CPUs of the process that started the worker (vLLM's engine
core, which it does not bind) where that process has more, and the kernel puts it where there is
room, and so do the threads a tier starts at registration (`threads_started_on`); the store
threads run at SCHED_IDLE, so on the model's cores only while those are idle. A thread that OpenMP
did not bind (a GPU worker, a process under `taskset` alone) keeps its CPUs.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager


def _cpu_list(text: str) -> set[int]:
    """CPU numbers written as OpenMP's variables write them: "0,1,2", "0 1 2", "0-3", "0-15:2"."""
    cpus: set[int] = set()
    for part in text.replace(",", " ").split():
        span, _, step = part.partition(":")
        lo, _, hi = span.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1, int(step or 1)))
    return cpus


def _openmp_cpus() -> frozenset[int] | None:
    """The CPUs OpenMP binds this process's threads to, as vLLM-CPU sets them for its worker, one
    variable per OpenMP runtime: `OMP_PLACES` as one place with `OMP_PROC_BIND`, GNU's
    `GOMP_CPU_AFFINITY`, Intel's `KMP_AFFINITY` proclist. None: no binding, or one this does not read."""
    env = os.environ
    try:
        if "proclist=[" in env.get("KMP_AFFINITY", ""):
            return frozenset(_cpu_list(env["KMP_AFFINITY"].split("proclist=[", 1)[1].split("]", 1)[0]))
        if env.get("GOMP_CPU_AFFINITY", "").strip():
            return frozenset(_cpu_list(env["GOMP_CPU_AFFINITY"]))
        places = env.get("OMP_PLACES", "").strip()
        if (env.get("OMP_PROC_BIND", "").strip().lower() not in ("", "false") and places.startswith("{")
                and places.endswith("}") and "}" not in places[1:-1]):
            return frozenset(_cpu_list(places[1:-1]))
    except ValueError:  # a form this does not read (abstract names, several places): leave the threads be
        return None
    return None


def io_cpus() -> frozenset[int] | None:
    """The CPUs for the I/O threads this thread starts, or None: they keep what they inherit. Call it
    on the thread that starts them (vLLM's), where its binding can be seen."""
    place = _openmp_cpus()
    if place is None:
        return None
    try:
        own = frozenset(os.sched_getaffinity(0))
        parent = frozenset(os.sched_getaffinity(os.getppid()))
    except (AttributeError, OSError):  # not Linux, or the parent gone
        return None
    return parent if own <= place and parent > own else None


def run_on(cpus: frozenset[int] | None) -> None:
    """An I/O thread's first step: run on `cpus` (`io_cpus`), where given."""
    if cpus is not None:
        try:
            os.sched_setaffinity(0, cpus)
        except OSError:  # a CPU gone offline since: the inherited ones still work
            pass


@contextmanager
def threads_started_on(cpus: frozenset[int] | None) -> Iterator[None]:
    """Threads this thread starts inside take `cpus` (`io_cpus`), where given: the threads a tier
    starts itself (host memory's prefault), which no initializer of ours reaches. The calling thread
    runs there meanwhile, and on its own CPUs again after."""
    if cpus is None:
        yield
        return
    own = os.sched_getaffinity(0)
    run_on(cpus)
    try:
        yield
    finally:
        try:
            os.sched_setaffinity(0, own)
        except OSError:  # a CPU gone offline since: what is left of its own
            pass
