"""`kvoffload plan --model PATH`: the KV cache layout vLLM will build, and how to serve it.

Asks vLLM's own configuration code, on this machine's platform, which KV
cache groups the model gets: per group its kind (full attention, sliding
window, chunked local, Mamba/GDN state), block size in tokens, layers and
page bytes. Nothing is loaded or allocated: the model is built on PyTorch's
`meta` device in a child process (one per tensor-parallel rank), which takes
about as long as importing vLLM (20-40 s on a small CPU machine).

From the groups it derives what the connector will do: the chunk size
(`hybrid_chunk_size`; the planner's default unless --hybrid-chunk-size is
given), the bytes one chunk stores per group (one file each in the
filesystem tier, its header included), and the flags vLLM needs for
those chunks, printed as one line to append to `vllm serve MODEL`
(`engine_kwargs` in --json is the same for `vllm.LLM(...)`). Where a
`--prefix-match-unit` buys hits inside a block (hybrids in vLLM's 'align'
mode), that line carries it; otherwise the plan says why there is none.

Block sizes depend on the platform, so run it where the model will be
served: vLLM on CUDA, vLLM-CPU, and even the CPU's instruction set (which
decides the GDN state dtype) give hybrid models different block sizes. With
--tensor-parallel-size N, page bytes are per rank.

Exit codes: 0 plan printed; 1 vLLM refuses the flags planned for the model
(a bug in the flag rule, `offload.plan.policy.serve_flags`); 2 usage error: the
model directory is missing, vLLM cannot build a configuration for the model
on this platform, or --hybrid-chunk-size does not fit the block sizes.
"""

from __future__ import annotations

import argparse
import json
import sys

from offload.plan.run import FlagsError, PlanError, plan_for_model
from offload.planner import ChunkSizeError


def _positive(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"{s!r}: expected a positive integer")
    return v


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="KV cache groups, block sizes, chunk size and vLLM flags for a model",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, metavar="PATH", help="local Hugging Face model directory")
    p.add_argument("--tensor-parallel-size", type=_positive, default=1, metavar="N",
                   help="tensor parallel ranks the model will be served with (default 1)")
    p.add_argument("--max-model-len", type=_positive, default=None, metavar="N",
                   help="as vLLM's --max-model-len (default: the model's)")
    p.add_argument("--hybrid-chunk-size", type=_positive, default=None, metavar="N",
                   help="the connector's hybrid_chunk_size to plan for (default: the planner's)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout instead of a table")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    print(f"kvoffload plan: asking vLLM for the KV cache layout of {args.model} "
          f"(tensor parallel {args.tensor_parallel_size}) ...", file=sys.stderr, flush=True)
    try:
        plan = plan_for_model(args.model, tensor_parallel_size=args.tensor_parallel_size,
                              max_model_len=args.max_model_len, hybrid_chunk_size=args.hybrid_chunk_size)
    except FileNotFoundError as e:
        print(f"kvoffload plan: --model {args.model}: {e}", file=sys.stderr)
        return 2
    except ChunkSizeError as e:
        print(f"kvoffload plan: --hybrid-chunk-size {args.hybrid_chunk_size}: {e}; "
              "leave it out for the planner's default", file=sys.stderr)
        return 2
    except FlagsError as e:
        print(f"kvoffload plan: {e}\nthis is a bug in offload.plan.policy.serve_flags: please report it",
              file=sys.stderr)
        return 1
    except PlanError as e:
        print(f"kvoffload plan: --model {args.model}: {e}\n"
              "fix: make what the cause names importable, or run `kvoffload plan` where the model will be "
              "served (a vLLM build that loads this architecture)", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(plan.to_json(), indent=2))
    else:
        print(plan.describe())
    return 0
