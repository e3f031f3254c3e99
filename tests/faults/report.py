"""One row of docs/reliability.md per test: printed, and appended as JSON to
$KVOFFLOAD_RELIABILITY_OUT when set (run pytest with -s to see the lines)."""

from __future__ import annotations

import json
import os


def record(test: str, injected: str, times: int | str, served: int | str, corrupt_loads: int | str,
           lost: str, **figures) -> None:
    row = {"test": test, "injected": injected, "times": times, "served": served,
           "corrupt_loads": corrupt_loads, "lost": lost, **figures}
    print(f"\nRELIABILITY {json.dumps(row)}", flush=True)
    out = os.environ.get("KVOFFLOAD_RELIABILITY_OUT")
    if out:
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")
