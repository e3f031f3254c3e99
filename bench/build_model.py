"""Build the random-weight Llama the end-to-end benchmarks (items 5 and 6) run on.

Large enough that prefilling an 8K-token prompt takes seconds on a 2-core CPU,
small enough to fit next to other engines (bf16, ~0.2 GB of weights). Built
locally like tools/tiny_models.py (no model hub here): the same byte-level BPE
tokenizer, random weights from a fixed seed.

Usage: python bench/build_model.py OUT_DIR [--force]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

NAME = "llama-bench"
CONFIG = dict(
    hidden_size=768, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=12,
    num_key_value_heads=4, head_dim=64, max_position_embeddings=16384,
)


def build(out: Path) -> None:
    import torch
    from tiny_models import VOCAB_SIZE, build_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(2468)
    cfg = LlamaConfig(**CONFIG, vocab_size=VOCAB_SIZE, torch_dtype="bfloat16",
                      eos_token_id=0, bos_token_id=0, pad_token_id=1)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out)
    build_tokenizer(out)


def ensure(models_dir: Path, force: bool = False) -> Path:
    target = models_dir / NAME
    cfg = target / "config.json"
    if cfg.exists() and not force and all(json.loads(cfg.read_text()).get(k) == v for k, v in CONFIG.items()):
        return target
    target.mkdir(parents=True, exist_ok=True)
    build(target)
    return target


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args(argv)
    print(f"{NAME}: {ensure(args.out_dir, args.force)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
