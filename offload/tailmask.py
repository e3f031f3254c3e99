"""Canonical partial attention pages: which bytes of a block belong to which token.

A partial-tail entry stores the attention block that holds its boundary's last
token. The slots past the boundary hold whatever the block held before (stale
KV of another request, or later tokens of this one), so the entry zeroes them:
the file is then a function of the prefix alone, byte-identical for the same
prompt. Where a token's bytes sit inside a block is the attention backend's
business (vLLM-CPU packs keys per ISA: AMX interleaves token pairs, the
vector paths transpose), so `TokenMap.probe` asks the backend's own cache-write
kernel (`AttentionImpl.do_kv_cache_update`) once per layer shape: it writes
bit planes of the token index into a scratch block and reads back which token
owns each element.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

# write(key, value, kv_cache, slot_mapping): the backend's cache write for one layer.
CacheWrite = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


class ProbeError(RuntimeError):
    """The backend's block layout could not be mapped to tokens."""


@dataclass
class TokenMap:
    """Owner token of every element of one layer's block page (-1: no token,
    e.g. padding). `dtype` is the element type the map indexes."""

    owner: torch.Tensor  # int32, one per element of a page
    dtype: torch.dtype
    _masks: dict[int, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def probe(cls, write: CacheWrite, like: torch.Tensor, block_dim: int, block_size: int,
              num_kv_heads: int, head_size: int, model_dtype: torch.dtype) -> TokenMap:
        """Map a layer whose KV cache is shaped like `like`, blocks along `block_dim`.

        The page is what `offload.copier.LayerPages.from_tensor` moves: for
        each index of the dims before `block_dim` (K and V where they come
        first, as in FlashAttention's `(2, num_blocks, ...)`), that block's
        bytes. Writes `block_size` tokens into block 1 of a two-block scratch
        cache on `like`'s device (the backend's write kernel runs there), once
        per bit of the token index (values 1.0 and 2.0, exact in every float
        format), and checks that every token owns as many elements as its key
        and value hold. The map itself lives on the CPU, where entries are masked."""
        cache_dtype, device = like.dtype, like.device
        if not cache_dtype.is_floating_point:
            raise ProbeError(f"KV cache dtype {cache_dtype} is not a float type")
        shape = list(like.shape)
        shape[block_dim] = 2
        scratch = torch.zeros(shape, dtype=cache_dtype, device=device)
        slots = torch.arange(block_size, 2 * block_size, dtype=torch.long, device=device)
        tokens = torch.arange(block_size, device=device)
        n = scratch.select(block_dim, 1).numel()
        owner = torch.zeros(n, dtype=torch.int32, device=device)
        written = torch.zeros(n, dtype=torch.bool, device=device)
        for bit in range(max(1, (block_size - 1).bit_length())):
            plane = ((tokens >> bit) & 1).to(torch.float32) + 1.0
            kv = plane.view(-1, 1, 1).expand(block_size, num_kv_heads, head_size).to(model_dtype).contiguous()
            scratch.zero_()
            write(kv, kv.clone(), scratch, slots)
            page = scratch.select(block_dim, 1).reshape(-1).to(torch.float32)
            written |= page != 0
            owner |= (page == 2.0).to(torch.int32) << bit
        owner, written = owner.cpu(), written.cpu()
        owner[~written] = -1
        counts = torch.bincount(owner[written].to(torch.int64), minlength=block_size)
        if counts.numel() != block_size or bool((counts != 2 * num_kv_heads * head_size).any()):
            raise ProbeError(f"the backend's cache write does not give each of {block_size} tokens "
                             f"{2 * num_kv_heads * head_size} elements of a {tuple(shape)} cache's block {block_dim}")
        return cls(owner, cache_dtype)

    def zero_from(self, page: torch.Tensor, valid: int) -> None:
        """Zero the bytes of `page` (one layer's block page, uint8) that do
        not belong to tokens `0 .. valid - 1`."""
        mask = self._masks.get(valid)
        if mask is None:
            mask = self._masks[valid] = (self.owner < 0) | (self.owner >= valid)
        page.view(self.dtype).masked_fill_(mask, 0)
