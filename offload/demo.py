"""`make demo`: `kvoffload warmup --verify` on the embedded tiny hybrid model.

Writes the embedded prompt set (four groups of three prompts sharing a prefix
of 1-4 chunks) to a JSONL file and a copy of the kv-transfer-config whose
filesystem tier points at a fresh cache directory, then runs

    kvoffload warmup --config CONFIG --prompts PROMPTS --model MODEL \
        --verify --again-after-reset --reference

which serves the set in three engine processes: without the connector (for
comparison), run 1 (cold cache: it stores), and run 2 after a restart (a new
process, empty vLLM prefix cache and host memory, another PYTHONHASHSEED: it
restores what run 1 stored, from host memory where warm start copied the
files' entries there first, else from the files), which then serves the set
again after `reset_prefix_cache()` to show the prefixes held in host memory.
The table has a column per tier; the line under it gives run 2's warm start
(entries and bytes copied, seconds to done, loads served from warmed entries),
read from its engine's metrics. The demo fails (exit 1) unless run 2 restores
every prompt's chunk-aligned prefix and its outputs are token-identical to
run 1's.

Run 2 is compared with run 1, not with the no-connector run: loading any KV
connector (even one that does nothing) can flip a near-tie bf16 greedy token
of a random-weight model in vLLM, so that comparison is for information.

    python -m offload.demo [--model PATH] [--config configs/fs.json] [--cache-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import shutil
import sys
from pathlib import Path

from offload import cli
from offload.cli.warmup import explicit_chunk_size
from offload.config import tier_dicts, tier_kind
from offload.plan.run import plan_for_model

REPO = Path(__file__).resolve().parents[1]


def prompt_set(chunk: int, vocab: int, seed: int = 7) -> tuple[list[list[int]], list[int]]:
    """Four groups of three prompts; each group shares a prefix of 1-4 chunks
    (a multiple of the chunk size, so vLLM's own block-aligned reuse within a
    run never exceeds what the disk tier restores after a restart)."""
    rng = random.Random(seed)
    hi = min(vocab, 30000) - 1
    prompts, shared = [], []
    for g in range(4):
        prefix = [rng.randrange(2, hi) for _ in range((g + 1) * chunk)]
        for k in range(3):
            prompts.append(prefix + [rng.randrange(2, hi) for _ in range(rng.randrange(100, chunk + 150))])
            shared.append(len(prefix) if k else 0)  # what a later prompt shares with an earlier one
    return prompts, shared


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="cross-restart warm-up demo (kvoffload warmup --verify)")
    ap.add_argument("--model", default=str(REPO / ".models" / "qwen3-next-tiny"))
    ap.add_argument("--config", default=str(REPO / "configs" / "hybrid-tiered.json"), help="kv-transfer-config JSON")
    ap.add_argument("--cache-dir", default=str(REPO / ".cache" / "demo"), help="replaces the file tier's path")
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args(argv)

    kv = json.loads(Path(args.config).read_text())
    cache = Path(args.cache_dir).resolve()
    shutil.rmtree(cache, ignore_errors=True)  # run 1 must start cold
    for t in tier_dicts(kv):
        if getattr(tier_kind(t), "holds_files", False):
            t["path"] = str(cache / "fs")
    plan = plan_for_model(args.model, hybrid_chunk_size=explicit_chunk_size(kv))
    chunk = plan.hybrid_chunk_size
    model_cfg = json.loads((Path(args.model) / "config.json").read_text())
    prompts, shared = prompt_set(chunk, int(model_cfg.get("vocab_size", 1024)))
    cache.mkdir(parents=True)
    cfg_path, prompts_path = cache / "kv-transfer-config.json", cache / "prompts.jsonl"
    cfg_path.write_text(json.dumps(kv, indent=2))
    prompts_path.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in prompts))
    kind = "hybrid" if "mamba" in {g.kind for g in plan.groups} else "attention"
    print(f"kvoffload demo: {Path(args.model).name} ({kind}), "
          f"{len(prompts)} prompts in 4 shared-prefix groups (run 1 can reuse "
          f"{sum(shared) / sum(map(len, prompts)):.1%} of its tokens within the run), cache {cache}")
    cmd = ["warmup", "--config", str(cfg_path), "--prompts", str(prompts_path), "--model", args.model,
           "--verify", "--again-after-reset", "--reference", "--max-tokens", str(args.max_tokens)]
    print("$ kvoffload " + shlex.join(cmd), flush=True)
    rc = cli.main(cmd)
    files = sorted(cache.rglob("*.kv"))
    print(f"cache: {len(files)} chunk files, {sum(f.stat().st_size for f in files) / 2**20:.1f} MiB "
          f"(`kvoffload stats {cache / 'fs'}` for more)")
    print("demo OK" if rc == 0 else f"demo FAILED (kvoffload warmup exit {rc})")
    return rc


if __name__ == "__main__":
    sys.exit(main())
