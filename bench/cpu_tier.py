"""Item 3: gather/scatter of scattered block pages into and out of host memory,
against a plain contiguous memcpy of the same bytes, in the same run.

- gather: every (chunk, group)'s pages (scattered block ids; attention pages
  are 2 segments per layer, Mamba pages 2 per layer with padding skipped) into
  its slot of a pre-faulted host arena, as the CPU tier and the filesystem
  tier's pooled staging buffers receive them. One copier call per
  (chunk, group), one thread (the worker's setting).
- scatter: the same slots back into the same blocks.
- memcpy baselines, same thread count: the same bytes from one contiguous
  buffer into the arena (and back), with the same per-call sizes; and one
  single memcpy of everything.
- gather into a fresh buffer per call, all held until the pass ends (as
  stores wait for their writes): what `FsData.stage` did before its buffer
  pool (for comparison).
Copies of 1 MiB and more use streaming (non-temporal) stores in the copier;
the memcpy baselines are glibc's memcpy.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from bench.common import GB, copy_bench_main, interleaved, median, table, write_results
from bench.kvsynth import TINY, HybridKV, Shape
from offload import copier


def run(gib: float, reps: int, tiny: bool = False, out_dir: Path | None = None) -> dict:
    kv = HybridKV(int(gib * 2**30), TINY if tiny else Shape(), seed=1)
    total = kv.total_bytes
    files = kv.files()
    arena = torch.ones(total, dtype=torch.uint8)  # pre-faulted
    src = torch.ones(total, dtype=torch.uint8)
    slots, pos = [], 0
    for _c, g in files:
        slots.append(arena[pos:pos + g.payload])
        pos += g.payload
    src_slots = [src[s.data_ptr() - arena.data_ptr():][:s.numel()] for s in slots]

    def gather():
        for (c, g), s in zip(files, slots):
            g.pages.gather(g.ids[c], out=s)

    def scatter():
        for (c, g), s in zip(files, slots):
            g.pages.scatter(s, len(g.ids[c]), list(enumerate(g.ids[c])))

    def memcpy_in():
        for d, s in zip(slots, src_slots):
            copier.memcpy(d, s)

    def memcpy_out():
        for d, s in zip(slots, src_slots):
            copier.memcpy(s, d)

    def memcpy_one():
        copier.memcpy(arena, src)

    def gather_fresh():  # held until the pass ends, as stores wait for their writes
        held = [g.pages.gather(g.ids[c]) for c, g in files]
        del held

    ops = {"gather (pages -> host slots)": gather, "memcpy, same call sizes (in)": memcpy_in,
           "scatter (host slots -> pages)": scatter, "memcpy, same call sizes (out)": memcpy_out,
           "memcpy, one call": memcpy_one, "gather into a fresh buffer per call": gather_fresh}
    for fn in ops.values():  # warm-up: fault in everything once
        fn()
    # verify once: scatter of the gathered slots restores identical pages
    gather()
    before = [copier.crc32c(s) for s in slots]
    kv.zero()
    scatter()
    gather()
    assert [copier.crc32c(s) for s in slots] == before, "scatter/gather round trip differs"
    times = interleaved(ops, reps)
    res = {k: {"gb_s": total / median(v) / GB, "runs_s": v} for k, v in times.items()}
    gb = {k: v["gb_s"] for k, v in res.items()}
    doc = {"bytes": total, "files": len(files), "reps": reps, "threads": 1,
           "page_bytes": {g.kind.value: g.pages.page_bytes for g in kv.groups},
           "copies_per_file": {g.kind.value: len(g.ids[0]) * 2 * (kv.shape.attn_layers if g.index
                                                                   else kv.shape.mamba_layers)
                               for g in kv.groups},
           "results": res,
           "ratio_gather_to_memcpy": gb["gather (pages -> host slots)"] / gb["memcpy, same call sizes (in)"],
           "ratio_scatter_to_memcpy": gb["scatter (host slots -> pages)"] / gb["memcpy, same call sizes (out)"],
           "ratio_gather_to_one_memcpy": gb["gather (pages -> host slots)"] / gb["memcpy, one call"],
           "ratio_scatter_to_one_memcpy": gb["scatter (host slots -> pages)"] / gb["memcpy, one call"]}
    base = {"gather (pages -> host slots)": "memcpy, same call sizes (in)",
            "scatter (host slots -> pages)": "memcpy, same call sizes (out)",
            "gather into a fresh buffer per call": "memcpy, same call sizes (in)"}
    rows = [[k, f"{v:.2f}", f"{v / gb[base[k]]:.0%}" if k in base else "-",
             f"{v / gb['memcpy, one call']:.0%}"] for k, v in gb.items()]
    print(f"{total / 2**30:.2f} GiB in {len(files)} (chunk, group) copies, 1 thread, median of {reps}")
    print(table(["operation", "GB/s", "of memcpy (same calls)", "of one memcpy"], rows))
    print(f"wrote {write_results('cpu_tier', doc, out_dir)}")
    return doc


def main(argv: list[str] | None = None) -> int:
    return copy_bench_main(run, __doc__, argv, gib=1.0)


if __name__ == "__main__":
    sys.exit(main())
