"""Child process of `kvoffload warmup --model`: `offload.engine_run`, plus a
line in a progress file after every prompt (the parent draws the bar).

    python -m offload.cli._serve SPEC OUT PROGRESS
"""

from __future__ import annotations

import sys

from offload import engine_run


def main(argv: list[str]) -> int:
    serve_pass = engine_run._serve_pass
    with open(argv[2], "a", buffering=1) as progress:

        def one_by_one(llm, prompts, params):
            out = []
            for ids in prompts:
                out.extend(serve_pass(llm, [ids], params))
                progress.write(".\n")
            return out

        engine_run._serve_pass = one_by_one
        return engine_run.main(argv[:2])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
