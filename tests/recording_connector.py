"""`OffloadConnector`, unchanged, that also writes down what its scheduler half
reports when a request finishes.

vLLM hands a request's `kv_transfer_params` to its client only in the final
response, so a client that hung up never gets them, nor the facts they carry
(`vllm_sub_block_hit`: vLLM's own prefix cache started or resumed the request
inside a block). Tests that must judge such a request configure this class
(`recording(kv, path)`) and read the file: one JSON object per finished
request, `{"request_id": vLLM's id, "params": what request_finished returned}`.
vLLM's id is `cmpl-<X-Request-Id>-<prompt index>-<8 hex>` for the completions
API (tests/loadgen.py sends an X-Request-Id per request).
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

from offload.connector import OffloadConnector

RECORD_ENV = "KVOFFLOAD_TEST_FINISHED"
TESTS = Path(__file__).resolve().parent


class RecordingOffloadConnector(OffloadConnector):
    _lock = threading.Lock()

    def _record(self, request, out: tuple[bool, dict[str, Any] | None]) -> tuple[bool, dict[str, Any] | None]:
        path = os.environ.get(RECORD_ENV)
        if path:
            line = json.dumps({"request_id": request.request_id, "params": out[1]}) + "\n"
            with self._lock, open(path, "a") as f:
                f.write(line)
        return out

    def request_finished(self, request, block_ids):
        return self._record(request, super().request_finished(request, block_ids))

    def request_finished_all_groups(self, request, block_ids):
        return self._record(request, super().request_finished_all_groups(request, block_ids))


def recording(kv: dict, path: Path) -> tuple[dict, dict[str, str]]:
    """`kv` (an OffloadConnector config) with this class configured, and the
    environment a server needs to load it and write to `path`."""
    assert kv["kv_connector"] == "OffloadConnector", kv["kv_connector"]
    kv = {**kv, "kv_connector": "RecordingOffloadConnector", "kv_connector_module_path": "recording_connector"}
    pythonpath = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH", "")) if p)
    return kv, {RECORD_ENV: str(path), "PYTHONPATH": pythonpath}


def finished(path: Path) -> dict[str, dict[str, Any] | None]:
    """vLLM's request id -> the params recorded for it."""
    out: dict[str, dict[str, Any] | None] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            assert rec["request_id"] not in out, f"request {rec['request_id']} finished twice"
            out[rec["request_id"]] = rec["params"]
    return out


def params_of(records: dict[str, dict[str, Any] | None], request_id: str) -> tuple[bool, dict[str, Any] | None]:
    """(whether vLLM finished the request the client sent as X-Request-Id `request_id`, its params)."""
    hits = [rid for rid in records if rid.startswith(f"cmpl-{request_id}-")]
    assert len(hits) <= 1, hits
    return (True, records[hits[0]]) if hits else (False, None)
