"""The CUDA copier on a GPU: gather/scatter of scattered block pages between
the KV cache in GPU memory and pinned host slots, against plain copies of the
same bytes between device memory and pinned host memory, in the same run.

- gather: every (chunk, group)'s pages (Qwen3-Next-80B's per-layer geometry:
  attention pages 2 segments per layer, GDN pages conv + recurrent state with
  the padding skipped, at scattered block ids) into its slot of a pinned host
  arena, one copier call per (chunk, group), as the worker stores them.
- scatter: the same slots back into the same blocks, as the worker loads them.
- baselines: the same bytes between one contiguous device buffer and the
  pinned arena, with the same per-call sizes (`Tensor.copy_`, synchronized per
  call like the copier), and in one single copy each way (the link's ceiling).
- torch's copies (`GroupPages` without the kernel: index_select + copy), what
  the worker falls back to where the kernel cannot run.
Run on a machine with a CUDA GPU and `offload._copier_cuda` built.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from bench.common import GB, copy_bench_main, interleaved, median, table, write_results
from bench.kvsynth import QWEN3_NEXT_80B, TINY, HybridKV
from offload import copier
from offload.copier import GroupPages


def run(gib: float, reps: int, tiny: bool = False, out_dir: Path | None = None) -> dict:
    if not torch.cuda.is_available() or copier._copier_cuda is None:
        raise SystemExit("copier_gpu needs a CUDA GPU and offload._copier_cuda (make cuda-build)")
    kv = HybridKV(int(gib * 2**30), TINY if tiny else QWEN3_NEXT_80B, seed=1, device="cuda")
    assert all(g.pages.backend == "cuda" for g in kv.groups)
    saved, copier._copier_cuda = copier._copier_cuda, None
    try:
        fallback = {g.index: GroupPages(g.pages.layers, g.pages.num_blocks, g.pages.device) for g in kv.groups}
    finally:
        copier._copier_cuda = saved
    assert all(p.backend == "torch" for p in fallback.values())
    total = kv.total_bytes
    files = kv.files()
    arena = torch.ones(total, dtype=torch.uint8, pin_memory=True)
    dsrc = torch.ones(total, dtype=torch.uint8, device="cuda")
    slots, pos = [], 0
    for _c, g in files:
        slots.append(arena[pos:pos + g.payload])
        pos += g.payload
    dslots = [dsrc[s.data_ptr() - arena.data_ptr():][:s.numel()] for s in slots]
    sync = torch.cuda.synchronize

    def gather():
        for (c, g), s in zip(files, slots):
            g.pages.gather(g.ids[c], out=s)

    def scatter():
        for (c, g), s in zip(files, slots):
            g.pages.scatter(s, len(g.ids[c]), list(enumerate(g.ids[c])))

    def torch_gather():
        for (c, g), s in zip(files, slots):
            fallback[g.index].gather(g.ids[c], out=s)

    def torch_scatter():
        for (c, g), s in zip(files, slots):
            fallback[g.index].scatter(s, len(g.ids[c]), list(enumerate(g.ids[c])))

    def d2h_calls():
        for h, d in zip(slots, dslots):
            h.copy_(d, non_blocking=True)
            sync()

    def h2d_calls():
        for h, d in zip(slots, dslots):
            d.copy_(h, non_blocking=True)
            sync()

    def d2h_one():
        arena.copy_(dsrc, non_blocking=True)
        sync()

    def h2d_one():
        dsrc.copy_(arena, non_blocking=True)
        sync()

    ops = {"gather, kernel (GPU pages -> pinned slots)": gather,
           "gather, torch's copies": torch_gather,
           "device -> host, same call sizes": d2h_calls,
           "scatter, kernel (pinned slots -> GPU pages)": scatter,
           "scatter, torch's copies": torch_scatter,
           "host -> device, same call sizes": h2d_calls,
           "device -> host, one call": d2h_one, "host -> device, one call": h2d_one}
    for fn in ops.values():  # warm-up
        fn()
    # Verify once: a scatter of the gathered slots restores identical pages, through each path.
    gather()
    before = [copier.crc32c(s) for s in slots]
    for put, get in ((scatter, gather), (torch_scatter, torch_gather), (scatter, torch_gather)):
        kv.zero()
        put()
        arena.zero_()
        get()
        assert [copier.crc32c(s) for s in slots] == before, f"{put.__name__}/{get.__name__} round trip differs"
    times = interleaved(ops, reps, sync)
    res = {k: {"gb_s": total / median(v) / GB, "runs_s": v} for k, v in times.items()}
    gb = {k: v["gb_s"] for k, v in res.items()}
    d2h = ("device -> host, same call sizes", "device -> host, one call")
    h2d = ("host -> device, same call sizes", "host -> device, one call")
    base = {"gather, kernel (GPU pages -> pinned slots)": d2h, "gather, torch's copies": d2h,
            "scatter, kernel (pinned slots -> GPU pages)": h2d, "scatter, torch's copies": h2d,
            d2h[0]: (None, d2h[1]), h2d[0]: (None, h2d[1])}
    rows = []
    for k, v in gb.items():
        same, one = base.get(k, (None, None))
        rows.append([k, f"{v:.1f}", f"{v / gb[same]:.0%}" if same else "-", f"{v / gb[one]:.0%}" if one else "-"])
    doc = {"bytes": total, "files": len(files), "reps": reps, "device": torch.cuda.get_device_name(),
           "page_bytes": {g.kind.value: g.pages.page_bytes for g in kv.groups},
           "copies_per_file": {g.kind.value: len(g.ids[0]) * 2 * (kv.shape.attn_layers if g.index
                                                                   else kv.shape.mamba_layers)
                               for g in kv.groups},
           "results": res}
    print(f"{total / 2**30:.2f} GiB in {len(files)} (chunk, group) copies on {doc['device']}, median of {reps}")
    print(table(["operation", "GB/s", "of plain copies (same calls)", "of one copy"], rows))
    print(f"wrote {write_results('copier_gpu', doc, out_dir)}")
    return doc


def main(argv: list[str] | None = None) -> int:
    return copy_bench_main(run, __doc__, argv, gib=2.0)


if __name__ == "__main__":
    sys.exit(main())
