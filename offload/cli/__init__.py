"""`kvoffload`: operator commands for a kvoffload cache (docs/operations.md).

    kvoffload warmup --config CONFIG --prompts FILE (--model M | --url URL) [--verify]
    kvoffload stats PATH [--json]
    kvoffload stats (--config CONFIG | --lmcache-url URL) [--json]
    kvoffload fsck PATH [--repair]
    kvoffload gc PATH --max-bytes N
    kvoffload check-config CONFIG
    kvoffload plan --model PATH [--tensor-parallel-size N] [--json]

One module per command; each has `add_parser(subparsers)` and `run(args) -> int`
(the exit code). `cache.py` is the read-only view of a cache directory that
stats, fsck and gc share; `prompts.py` is warmup's prompt file format.
"""

from __future__ import annotations

import argparse
import sys

from offload.cli import check_config, fsck, gc, plan, stats, warmup


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvoffload", description=__doc__.split("\n\n")[0],
                                 epilog="`kvoffload COMMAND --help` describes a command and its exit codes.")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for mod in (warmup, stats, fsck, gc, check_config, plan):
        mod.add_parser(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `kvoffload stats ... | head`
        return 0


if __name__ == "__main__":
    sys.exit(main())
