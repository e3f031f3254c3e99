"""A vLLM logits processor that lets a random-weight model answer only with tokens that have text.

vLLM's multi-turn benchmark client (bench/multi_turn_client.py) streams chat completions and takes
the first *non-empty* content delta as the first token; a request whose deltas are all empty counts
as failed, and the answer's text is what the next turn sends back. The local models have random
weights and a vocabulary larger than their tokenizer's (ids the tokenizer does not know decode to
nothing), and their greedy answers may be EOS or lone bytes of a UTF-8 sequence. So every server of
that benchmark is given this processor (`--logits-processors bench.visible_tokens:VisibleTokensOnly`):
it masks every id that is special, unknown to the tokenizer, or does not decode on its own to
printable ASCII with a visible character. Every answer then has `max_tokens` tokens (EOS cannot be
sampled), each one streamed as text. Prefill, and so the offload tiers' work, is untouched.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor


def visible(text: str) -> bool:
    """Whether a token's text is printable ASCII with at least one visible character."""
    return bool(text.strip()) and text.isascii() and text.isprintable()


def visible_ids(tokenizer: Any) -> list[int]:
    """The ids of `tokenizer` that are not special and decode on their own to `visible` text."""
    special = set(tokenizer.all_special_ids)
    return [i for i in range(len(tokenizer)) if i not in special and visible(tokenizer.decode([i]))]


class VisibleTokensOnly(LogitsProcessor):
    """-inf on every logit but the tokenizer's `visible_ids` (the same mask for every request)."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        from transformers import AutoTokenizer

        mc = vllm_config.model_config
        ids = visible_ids(AutoTokenizer.from_pretrained(mc.tokenizer, trust_remote_code=mc.trust_remote_code))
        if not ids:
            raise ValueError(f"VisibleTokensOnly: the tokenizer of {mc.tokenizer} has no token with visible text")
        self.ids = torch.tensor(ids, dtype=torch.long)
        self.mask: torch.Tensor | None = None  # built on the first batch, as wide as its logits

    def is_argmax_invariant(self) -> bool:
        return False  # it changes which token greedy sampling picks

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        pass  # one mask for every request: nothing per request to track

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.mask is None or self.mask.shape[-1] != logits.shape[-1] or self.mask.dtype != logits.dtype:
            mask = torch.full((logits.shape[-1],), float("-inf"), dtype=logits.dtype)
            mask[self.ids[self.ids < logits.shape[-1]]] = 0
            self.mask = mask.to(logits.device)
        return logits.add_(self.mask)
