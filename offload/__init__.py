"""kvoffload: tiered KV-cache offload for vLLM (hybrid Mamba/GDN + attention)."""
