"""Another process on the same LMCache remote, for tests/test_lmcache_objects.py.

    python tests/lmcache_peer.py write|read URL NAME:SEED:SIZE ...

`write` puts each payload and waits for the remote writes; `read` reads each
name back (a fresh process: its local pool is empty, so every hit comes from the
remote) and compares with the expected bytes. Prints one JSON line.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from offload.store.lmcache_objects import LMCacheObjects


def payload(seed: int, size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g)


def main() -> int:
    mode, url, *specs = sys.argv[1:]
    items = [(n, int(s), int(z)) for n, s, z in (spec.split(":") for spec in specs)]
    objs = LMCacheObjects.open(64 << 20, url, timeout_s=1.0)
    result: dict = {"mode": mode}
    t0 = time.monotonic()
    if mode == "write":
        result["put"] = [objs.put(name, payload(seed, size)) for name, seed, size in items]
        result["flushed"] = objs.flush(10.0)
    else:
        result["equal"] = []
        for name, seed, size in items:
            out = torch.empty(size, dtype=torch.uint8)
            result["equal"].append(objs.get_into(name, out) and torch.equal(out, payload(seed, size)))
    result["seconds"] = round(time.monotonic() - t0, 3)
    time.sleep(0.2)  # let write-behind callbacks land in the counters
    result["stats"] = {k: v for k, v in vars(objs.stats).items() if not k.startswith("_")}
    objs.close()
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
