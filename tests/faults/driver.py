"""Serve prompts through a real vLLM engine in phases, with actions between
phases, writing each result as it comes (so a SIGKILLed run still reports).

`python tests/faults/driver.py SPEC.json OUT.jsonl`. SPEC: RunSpec's fields
(model, prompts, kv_transfer_config, max_tokens, engine_args) plus `phases`:
a list of {"order": [prompt indices], "before": shell command or null,
"wait_for": a path to wait for or null, "reset": empty vLLM's prefix cache
first (default true after the first phase), "touch": a path to create after}.
After the last phase it prints DONE and, with "hang": true, sleeps until
killed (stores may still be in flight); otherwise it shuts down cleanly.
Each OUT line: {"phase", "index", "result": PromptResult, "decode_s"}.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path


def main(spec_path: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from offload.engine_run import _metrics, _serve_pass

    spec = json.loads(Path(spec_path).read_text())
    kw = dict(spec.get("engine_args", {}))
    if spec.get("kv_transfer_config") is not None:
        kw["kv_transfer_config"] = KVTransferConfig(**spec["kv_transfer_config"])
    llm = LLM(model=spec["model"], disable_log_stats=False, **kw)
    params = SamplingParams(temperature=0.0, max_tokens=spec.get("max_tokens", 8), ignore_eos=True)
    print("ENGINE_READY", flush=True)
    with open(out_path, "a") as out:
        for p, phase in enumerate(spec["phases"]):
            if phase.get("wait_for"):
                deadline = time.monotonic() + 600
                while not os.path.exists(phase["wait_for"]) and time.monotonic() < deadline:
                    time.sleep(0.05)
            if phase.get("before"):
                subprocess.run(phase["before"], shell=True, check=True)
            if phase.get("reset", p > 0):
                assert llm.reset_prefix_cache(), "vLLM refused to reset its prefix cache"
            for i in phase["order"]:
                t0 = time.monotonic()
                [r] = _serve_pass(llm, [spec["prompts"][i]], params)
                wall = time.monotonic() - t0
                out.write(json.dumps({"phase": p, "index": i, "result": asdict(r),
                                      "decode_s": max(wall - r.ttft_s, 1e-9)}) + "\n")
                out.flush()
            if phase.get("touch"):
                Path(phase["touch"]).touch()
    Path(out_path + ".metrics").write_text(json.dumps(_metrics()))
    print("DONE", flush=True)
    if spec.get("hang"):
        while True:
            time.sleep(3600)
    del llm


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
