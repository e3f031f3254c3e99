"""`kvoffload` in a process of its own.

A test or bench that reads the CLI's output runs it here, never in-process: in a pytest process,
the background engine lanes (tests/conftest.py) and vLLM's loggers print to the same stdout, and
a warning landing in the middle of `--json` output breaks its parse.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class CliRun:
    """What a run left: named as subprocess.CompletedProcess names them."""

    returncode: int
    stdout: str
    stderr: str

    def json(self) -> Any:
        """stdout as one JSON document (`--json`); ValueError, with both streams, where it is not."""
        try:
            return json.loads(self.stdout)
        except ValueError as e:
            raise ValueError(f"kvoffload's stdout is not one JSON document ({e}); exit {self.returncode}\n"
                             f"stdout:\n{self.stdout[-4000:]}\nstderr:\n{self.stderr[-4000:]}") from None


def run_cli(*argv: str, env: dict[str, str] | None = None, timeout_s: float = 1800) -> CliRun:
    """`kvoffload ARGV` (`python -m offload.cli`) in a new process, from the repository root;
    `env`: variables over this process's."""
    p = subprocess.run([sys.executable, "-m", "offload.cli", *argv], cwd=REPO, capture_output=True, text=True,
                       timeout=timeout_s, env={**os.environ, **(env or {})})
    return CliRun(p.returncode, p.stdout, p.stderr)


def cli_json(*argv: str, env: dict[str, str] | None = None, timeout_s: float = 1800) -> tuple[int, Any]:
    """(exit code, stdout parsed as JSON) of `kvoffload ARGV` in a new process (ARGV asks for --json)."""
    r = run_cli(*argv, env=env, timeout_s=timeout_s)
    return r.returncode, r.json()
