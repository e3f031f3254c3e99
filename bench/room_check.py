"""What the room check costs a lookup with a hit (offload/connector/room.py).

`LoadRoom.fits` counts, with vLLM's own `get_num_blocks_to_allocate`, the
blocks the request and every request still holding blocks for a load of ours
need to finish their prompts. Timed on vLLM's real Scheduler (the unit tests'
harness, tests/vllm_unit_utils.py) on the tiny hybrid's geometry with a
prefix-match unit, for 0 to 32 such loads: median of 7 rounds of 200 calls.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(rounds: int = 7, calls: int = 200, held: tuple[int, ...] = (0, 1, 4, 16, 32)) -> dict[int, float]:
    sys.path.insert(0, str(REPO / "tests"))
    import torch

    from vllm_unit_utils import (
        create_request,
        create_scheduler,
        create_vllm_config,
        hybrid_kv_cache_config,
        set_connector,
    )

    cfg = create_vllm_config(str(REPO / ".models" / "qwen3-next-tiny"), block_size=128, max_num_batched_tokens=128,
                             max_model_len=1536, prefix_cache_retention_interval=128, prefix_match_unit=64)
    set_connector(cfg, {"store": "cpu", "cpu_bytes": 1 << 24})
    kcc = hybrid_kv_cache_config(["model.layers.0.linear_attn", "model.layers.2.linear_attn"],
                                 ["model.layers.1.self_attn.attn", "model.layers.3.self_attn.attn"],
                                 block_size=128, mamba_shapes=((3, 192), (1, 64, 64)),
                                 mamba_dtypes=(torch.bfloat16, torch.float32), num_kv_heads=4, head_size=64,
                                 num_blocks=400, mamba_cache_mode=cfg.cache_config.mamba_cache_mode)
    room = create_scheduler(cfg, kcc).connector._sched.room
    assert room is not None, "the connector built no LoadRoom"
    rng = random.Random(0)
    reqs = [create_request(f"r{i}", [rng.randrange(1000) for _ in range(1000)], max_tokens=1, block_size=64)
            for i in range(max(held) + 1)]
    out = {}
    for n in held:
        loading = [(r, 704) for r in reqs[1:n + 1]]  # each load ends inside a Mamba block
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(calls):
                room.fits(reqs[0], 704, loading)
            times.append((time.perf_counter() - t0) / calls)
        out[n] = statistics.median(times) * 1e6
        print(f"loads held {n:2d}: fits() {out[n]:.1f} us (median of {rounds} x {calls})")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args(argv)
    run(a.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
