"""A synthetic hybrid KV cache in host memory (or on a CUDA device), laid out as vLLM lays it out.

- Full attention: `attn_layers` tensors [2, num_blocks, block, kv_heads, head_dim]
  (K/V first, as GPU attention backends keep it): 2 segments per layer per page.
- Mamba/GDN: per layer one raw [num_blocks, padded page] buffer, with a conv
  state and an SSM state viewed into it (vLLM's padded Mamba pages): 2 segments
  per layer, the padding skipped.
Each chunk of `CHUNK` tokens owns `CHUNK / block` attention blocks and one
Mamba state block, at random (scattered) block ids, as a long-running engine's
free list leaves them. Values are random bytes.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from offload.copier import GroupPages, LayerPages
from offload.keys import ChunkKey
from offload.planner import GroupKind

CHUNK = 256


@dataclass(frozen=True)
class Shape:
    attn_layers: int = 8
    block: int = 64
    kv_heads: int = 4
    head_dim: int = 128
    mamba_layers: int = 24
    conv_rows: int = 3
    conv_dim: int = 4096
    ssm_heads: int = 8
    ssm_dim: int = 128
    pad: int = 8192

    @property
    def attn_page(self) -> int:
        return self.attn_layers * 2 * self.block * self.kv_heads * self.head_dim * 2

    @property
    def mamba_page(self) -> int:
        return self.mamba_layers * (self.conv_rows * self.conv_dim + self.ssm_heads * self.ssm_dim ** 2) * 2

    @property
    def chunk_bytes(self) -> int:
        return CHUNK // self.block * self.attn_page + self.mamba_page


# Qwen3-Next-80B-A3B's per-layer geometry (12 attention layers with 2 KV heads
# of 256; 36 GDN layers, conv 3 x 8192, 32 value heads of 128 x 128).
QWEN3_NEXT_80B = Shape(attn_layers=12, block=64, kv_heads=2, head_dim=256, mamba_layers=36, conv_rows=3,
                       conv_dim=8192, ssm_heads=32, ssm_dim=128, pad=8192)
TINY = Shape(attn_layers=2, kv_heads=2, head_dim=64, mamba_layers=3, conv_dim=512, ssm_heads=2, ssm_dim=64, pad=4096)


@dataclass
class Group:
    index: int
    kind: GroupKind
    pages: GroupPages
    ids: list[list[int]]  # per chunk: block ids holding that chunk's pages
    tensors: list[torch.Tensor]

    @property
    def payload(self) -> int:  # bytes of one (chunk, group) file's payload
        return len(self.ids[0]) * self.pages.page_bytes


class HybridKV:
    def __init__(self, target_bytes: int, shape: Shape = Shape(), seed: int = 0, num_threads: int = 1,
                 device: str = "cpu") -> None:
        self.shape = s = shape
        self.chunks = max(1, -(-target_bytes // s.chunk_bytes))
        rng = random.Random(seed)
        per_chunk = CHUNK // s.block
        nb_a = self.chunks * per_chunk * 5 // 4 + 1
        nb_m = self.chunks * 5 // 4 + 1
        gen = torch.Generator().manual_seed(seed)
        attn = [torch.randint(0, 256, (2, nb_a, s.block, s.kv_heads, s.head_dim * 2), dtype=torch.uint8,
                              generator=gen).to(device).view(torch.bfloat16) for _ in range(s.attn_layers)]
        conv_b, ssm_b = s.conv_rows * s.conv_dim * 2, s.ssm_heads * s.ssm_dim ** 2 * 2
        padded = -(-(conv_b + ssm_b) // s.pad) * s.pad
        mamba_raw = [torch.randint(0, 256, (nb_m, padded), dtype=torch.uint8, generator=gen).to(device)
                     for _ in range(s.mamba_layers)]
        m_layers = []
        for raw in mamba_raw:
            conv = raw[:, :conv_b].view(torch.bfloat16).view(nb_m, s.conv_rows, s.conv_dim)
            ssm = raw[:, conv_b:conv_b + ssm_b].view(torch.bfloat16).view(nb_m, s.ssm_heads, s.ssm_dim, s.ssm_dim)
            m_layers += [LayerPages.from_tensor(conv, nb_m), LayerPages.from_tensor(ssm, nb_m)]
        a_ids = rng.sample(range(nb_a), self.chunks * per_chunk)
        m_ids = rng.sample(range(nb_m), self.chunks)
        dev = torch.device(device)
        # vLLM numbers the groups; Mamba first as in Qwen3-Next.
        self.groups = [
            Group(0, GroupKind.MAMBA, GroupPages(m_layers, nb_m, dev, num_threads), [[b] for b in m_ids], mamba_raw),
            Group(1, GroupKind.FULL_ATTENTION,
                  GroupPages([LayerPages.from_tensor(t, nb_a) for t in attn], nb_a, dev, num_threads),
                  [a_ids[c * per_chunk:(c + 1) * per_chunk] for c in range(self.chunks)], attn),
        ]
        self.keys = [ChunkKey(rng.randbytes(32)) for _ in range(self.chunks)]

    @property
    def total_bytes(self) -> int:
        return sum(g.payload for g in self.groups) * self.chunks

    def files(self):
        """(chunk, group) pairs, in store order."""
        return [(c, g) for c in range(self.chunks) for g in self.groups]

    def zero(self) -> None:
        for g in self.groups:
            for t in g.tensors:
                t.zero_()
