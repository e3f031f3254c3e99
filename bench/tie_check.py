"""A first token that differs after a restore: is it a near-tie of the logits?

One server without a connector computes bench/peer_race.py's first long prompt (same seed) whole,
then again from vLLM's own prefix cache, and prints the first token and the top-5 logprobs of each:
`python -m bench.tie_check MODEL TOKENS`. If vLLM's own prefix cache flips the token too, the
difference is vLLM's arithmetic with a cached prefix, not a connector's bytes.
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
from pathlib import Path

from bench import peer_race as pr


def main(argv: list[str]) -> int:
    from offload.plan.run import plan_for_models

    model, n = argv[0], int(argv[1])
    plan = plan_for_models([model])[0]
    vocab = json.loads(Path(model, "config.json").read_text())["vocab_size"]
    ids = pr._rand(random.Random(pr.SEED), n, vocab)  # the race's first prompt
    log = Path(tempfile.gettempdir()) / "kvoffload-tie-check.log"
    with pr.server(model, None, list(plan.serve_args), n + 64, log) as s:
        for attempt in ("computed whole", "from vLLM's prefix cache"):
            out = s.complete(ids, 1, logprobs=5)
            c = out["choices"][0]
            cached = (out["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
            print(f"{attempt}: token {c['token_ids']}, cached {cached}, top-5 {c['logprobs']['top_logprobs'][0]}",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
