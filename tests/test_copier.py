"""Tests for offload._copier and offload/copier.py against pure-Python / torch references."""

from __future__ import annotations

import errno
import os
import random

import pytest
import torch

from offload import _copier, copier
from offload.copier import GroupPages, LayerPages


# ---------------------------------------------------------------- CRC-32C --
def crc32c_ref(data: bytes, seed: int = 0) -> int:
    crc = seed ^ 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def _u8(data: bytes) -> torch.Tensor:
    return torch.tensor(list(data), dtype=torch.uint8)


def test_crc32c_known_vectors():
    assert copier.crc32c(b"123456789") == 0xE3069283
    assert copier.crc32c(b"") == 0
    assert copier.crc32c(_u8(b"123456789")) == 0xE3069283
    assert copier.crc32c(torch.empty(0, dtype=torch.uint8)) == 0
    assert copier.crc32c(bytes(32)) == 0x8A9136AA  # RFC 3720 B.4: 32 zero bytes
    assert copier.crc32c(b"\xff" * 32) == 0x62A8AB43
    t = _u8(b"123456789")
    assert _copier.crc32c_software(t.data_ptr(), 9) == 0xE3069283


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 63, 64, 65, 257, 1000])
def test_crc32c_matches_bitwise_reference(n):
    data = bytes(random.Random(n).getrandbits(8) for _ in range(n))
    assert copier.crc32c(data) == crc32c_ref(data)
    assert copier.crc32c(bytearray(data), seed=0x1234) == crc32c_ref(data, 0x1234)
    assert copier.crc32c(memoryview(data)) == crc32c_ref(data)


def test_crc32c_hardware_and_software_agree():
    rng = random.Random(0)
    big = torch.randint(0, 256, (3 * 8192 * 4 + 4096,), dtype=torch.uint8)
    base = big.data_ptr()
    sizes = [rng.randrange(0, 10001) for _ in range(200)] + [0, 1, 24575, 24576, 24577, 3 * 8192 * 4]
    for size in sizes:
        start = rng.randrange(0, 16)
        seed = rng.getrandbits(32)
        hw = _copier.crc32c(base + start, size, seed)
        sw = _copier.crc32c_software(base + start, size, seed)
        assert hw == sw, (start, size)
    # The lane-interleaved path (>= 3*8192 bytes) against the bitwise reference.
    chunk = bytes(big[5:5 + 3 * 8192 + 11].tolist())
    assert copier.crc32c(chunk) == crc32c_ref(chunk)


@pytest.mark.parametrize("variant", ["crc32", "clmul", "vpclmul"])
def test_crc32c_variants_agree_with_the_table_path(variant):
    """Each CPU path against slice-by-8 at every alignment, around the folding
    path's thresholds (256 bytes, 64-byte steps, 16-byte tail) and at file sizes."""
    try:
        _copier.crc32c_variant(0, 0, 0, variant)
    except ValueError:
        pytest.skip(f"{variant} is not available on this CPU")
    rng = random.Random(7)
    big = torch.randint(0, 256, (7 << 20,), dtype=torch.uint8)
    base = big.data_ptr()
    sizes = [*range(240, 340), *range(1000, 1350, 7), 1023, 1024, 1025, 1279, 1280, 1281, 4096 + 128,
             65536 + 17, 4194304, 6946816, 7 << 20]
    for size in sizes:
        start = rng.randrange(0, 64) if size < (7 << 20) else 0
        size = min(size, big.numel() - start)
        seed = rng.getrandbits(32)
        want = _copier.crc32c_variant(base + start, size, seed, "table")
        assert _copier.crc32c_variant(base + start, size, seed, variant) == want, (variant, start, size)
    assert _copier.crc32c_implementation() in ("vpclmul", "clmul", "crc32", "table")


def test_crc32c_seed_chaining():
    rng = random.Random(1)
    a = bytes(rng.getrandbits(8) for _ in range(1234))
    b = bytes(rng.getrandbits(8) for _ in range(30001))
    assert copier.crc32c(b, seed=copier.crc32c(a)) == copier.crc32c(a + b)
    ta, tb = _u8(a), _u8(b)
    assert copier.crc32c(tb, seed=copier.crc32c(ta)) == copier.crc32c(torch.cat([ta, tb]))


def test_crc32c_rejects_non_cpu_u8_tensor():
    with pytest.raises(ValueError):
        copier.crc32c(torch.zeros(4, dtype=torch.float32))
    with pytest.raises(ValueError):
        copier.crc32c(torch.zeros(8, dtype=torch.uint8)[::2])


# ------------------------------------------------------------- LayerPages --
NB = 6  # num_blocks in layout tests


def _contig(dtype=torch.bfloat16):
    return torch.randn(NB, 4, 16, 8).to(dtype)


def _kv_first(dtype=torch.bfloat16):
    return torch.randn(2, NB, 16, 4, 8).to(dtype)


def _mamba_padded(used=1000, page=4096):
    raw = torch.randint(-128, 128, (NB, page), dtype=torch.int8)
    return raw, raw[:, :used].reshape(NB, 1, 1, used)


def test_layer_pages_contiguous():
    t = torch.empty(NB, 4, 128, 128, dtype=torch.bfloat16)
    lp = LayerPages.from_tensor(t, NB)
    assert lp.seg_offsets == (0,)
    assert lp.seg_bytes == 4 * 128 * 128 * 2
    assert lp.block_stride == 4 * 128 * 128 * 2
    assert lp.base_ptr == t.data_ptr()
    assert lp.page_bytes == lp.seg_bytes


def test_layer_pages_kv_first():
    t = _kv_first()
    lp = LayerPages.from_tensor(t, NB)
    assert lp.seg_offsets == (0, t.stride(0) * 2)
    assert lp.seg_bytes == 16 * 4 * 8 * 2
    assert lp.block_stride == t.stride(1) * 2
    assert lp.page_bytes == 2 * lp.seg_bytes


def test_layer_pages_mamba_padded():
    raw = torch.empty(NB, 131072, dtype=torch.int8)
    view = raw[:, :17536].reshape(NB, 1, 1, 17536)
    lp = LayerPages.from_tensor(view, NB)
    assert lp.seg_offsets == (0,)
    assert lp.seg_bytes == 17536
    assert lp.block_stride == 131072


def test_layer_pages_multi_leading_dims_row_major():
    t = torch.empty(2, 3, NB, 5, dtype=torch.float32)
    lp = LayerPages.from_tensor(t, NB)
    s0, s1 = t.stride(0) * 4, t.stride(1) * 4
    assert lp.seg_offsets == tuple(i * s0 + j * s1 for i in range(2) for j in range(3))


def test_layer_pages_errors():
    with pytest.raises(ValueError, match="shape"):
        LayerPages.from_tensor(torch.empty(3, 4), NB)
    t = torch.empty(NB, 8, 16).transpose(1, 2)
    with pytest.raises(ValueError, match="strides"):
        LayerPages.from_tensor(t, NB)


# --------------------------------------------------------- gather/scatter --
def _block_bytes(t: torch.Tensor, b: int) -> torch.Tensor:
    """Reference page part of block b: segments (leading-dim combos) in row-major order."""
    d = next(i for i, s in enumerate(t.shape) if s == NB)
    sub = t.select(d, b).contiguous()  # leading dims then trailing dims, row-major
    return sub.view(torch.uint8).reshape(-1)


def _layers():
    raw, mamba = _mamba_padded()
    return [_contig(torch.bfloat16), _kv_first(torch.float32), mamba, _kv_first(torch.int8)], raw


def _group(tensors, device="cpu") -> GroupPages:
    return GroupPages([LayerPages.from_tensor(t, NB) for t in tensors], NB, torch.device(device))


@pytest.mark.parametrize("ids", [[3, 0, 5], [0, 1, 2, 3, 4, 5], [2, 2], [4], []])
def test_gather_matches_torch(ids):
    tensors, _ = _layers()
    g = _group(tensors)
    out = g.gather(ids)
    assert out.dtype == torch.uint8 and out.numel() == len(ids) * g.page_bytes
    expected = [_block_bytes(t, b) for t in tensors for b in ids]
    ref = torch.cat(expected) if expected else torch.empty(0, dtype=torch.uint8)
    assert torch.equal(out, ref)
    if ids:  # torch fallback (the CUDA path without the extension) agrees too
        alt = torch.empty_like(out)
        g._torch_gather(ids, alt)
        assert torch.equal(alt, ref)


@pytest.mark.parametrize("ids", [[3, 0, 5], [0, 1, 2, 3, 4, 5], [2, 2], []])
def test_a_gather_with_its_crc_writes_what_gather_does_and_returns_its_crc(ids):
    tensors, _ = _layers()
    g = _group(tensors)
    out = torch.full((len(ids) * g.page_bytes,), 7, dtype=torch.uint8)
    crc = g.gather_crc(ids, out)
    assert torch.equal(out, g.gather(ids))
    assert crc == crc32c_ref(bytes(out.numpy()))
    with pytest.raises(ValueError, match="exactly"):
        g.gather_crc(ids, torch.empty(len(ids) * g.page_bytes + 1, dtype=torch.uint8))


def test_gather_validates_ids():
    tensors, _ = _layers()
    g = _group(tensors)
    for bad in ([NB], [-1], [0, 99]):
        with pytest.raises(ValueError):
            g.gather(bad)
    table = _copier.PageTable([(tensors[0].data_ptr(), 16, [0], 16)])
    with pytest.raises(ValueError):
        table.gather([-1], 0, 16)
    with pytest.raises(ValueError):
        table.gather([0], 0, 15)


@pytest.mark.parametrize("torch_path", [False, True])
def test_scatter_round_trip_touches_only_destinations(torch_path):
    src_tensors, _ = _layers()
    src = _group(src_tensors)
    ids = [4, 1, 2]
    buf = src.gather(ids)

    raw = torch.zeros(NB, 4096, dtype=torch.int8)
    dst_tensors = [
        torch.zeros(NB, 4, 16, 8, dtype=torch.bfloat16),
        torch.zeros(2, NB, 16, 4, 8, dtype=torch.float32),
        raw[:, :1000].reshape(NB, 1, 1, 1000),
        torch.zeros(2, NB, 16, 4, 8, dtype=torch.int8),
    ]
    dst = _group(dst_tensors)
    pairs = [(0, 5), (2, 0), (1, 3)]  # src index -> dst block
    if torch_path:
        dst._torch_scatter(buf, len(ids), pairs)
    else:
        dst.scatter(buf, len(ids), pairs)

    moved = {d: ids[s] for s, d in pairs}
    for s_t, d_t in zip(src_tensors, dst_tensors):
        for b in range(NB):
            got = _block_bytes(d_t, b)
            if b in moved:
                assert torch.equal(got, _block_bytes(s_t, moved[b]))
            else:
                assert not got.any()
    assert not raw[:, 1000:].any()  # padding beyond the used state bytes untouched
    assert torch.equal(dst.gather([5, 3, 0]), buf)  # src order 0, 1, 2


def test_scatter_validates():
    tensors, _ = _layers()
    g = _group(tensors)
    buf = g.gather([0, 1])
    with pytest.raises(ValueError):
        g.scatter(buf, 2, [(2, 0)])  # src index out of range
    with pytest.raises(ValueError):
        g.scatter(buf, 2, [(0, NB)])  # dst block out of range
    with pytest.raises(ValueError):
        g.scatter(buf, 3, [(0, 0)])  # size mismatch
    with pytest.raises(ValueError):
        g.scatter(buf.view(torch.int8), 2, [(0, 0)])


def test_scatter_coalesced_runs():
    t = torch.randn(16, 3, 5)
    g = GroupPages([LayerPages.from_tensor(t, 16)], 16, torch.device("cpu"))
    buf = g.gather(list(range(4, 12)))
    assert torch.equal(buf.view(torch.float32).view(8, 3, 5), t[4:12])
    out = torch.zeros_like(t)
    GroupPages([LayerPages.from_tensor(out, 16)], 16, torch.device("cpu")).scatter(
        buf, 8, [(i, i + 6) for i in range(8)]
    )
    assert torch.equal(out[6:14], t[4:12]) and not out[:6].any() and not out[14:].any()


# ---------------------------------------------------------------- file IO --
@pytest.fixture
def umask0():
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def test_write_read_round_trip(tmp_path, umask0):
    payload = torch.randint(0, 256, (100_003,), dtype=torch.uint8)
    header = b"HDR\x00" + bytes(range(60))
    tmp, final = tmp_path / "x.tmp", tmp_path / "x.bin"
    copier.write_file(tmp, final, header, payload, fsync=True)
    assert not tmp.exists() and final.exists()
    assert os.stat(final).st_mode & 0o777 == 0o640
    assert final.read_bytes() == header + bytes(payload.tolist())

    out = torch.empty_like(payload)
    got_header, crc = copier.read_file(final, len(header), out)
    assert got_header == header
    assert torch.equal(out, payload)
    assert crc == copier.crc32c(payload)
    assert copier.read_header(final, 4) == b"HDR\x00"

    copier.write_file(tmp_path / "y.tmp", tmp_path / "y.bin", b"", payload[:10], fsync=False, mode=0o600)
    assert os.stat(tmp_path / "y.bin").st_mode & 0o777 == 0o600


def test_read_file_size_checks(tmp_path):
    final = tmp_path / "x.bin"
    copier.write_file(tmp_path / "x.tmp", final, b"h" * 8, torch.zeros(100, dtype=torch.uint8), False)
    out = torch.full((99,), 7, dtype=torch.uint8)
    with pytest.raises(ValueError, match="108"):
        copier.read_file(final, 8, out)
    assert (out == 7).all()  # nothing read from a wrong-size file
    with pytest.raises(ValueError):
        copier.read_header(final, 109)
    with pytest.raises(ValueError):
        copier.read_file(final, 8, torch.empty(100, dtype=torch.float32))


@pytest.mark.parametrize("n", [0, 1, 4096 - 128, 4096, 100_003, 1 << 20])
def test_read_file_direct_reads_header_and_payload_into_an_aligned_buffer(tmp_path, n):
    from offload.store.buffers import BufferPool, probe_o_direct

    payload = torch.randint(0, 256, (n,), dtype=torch.uint8)
    header = bytes(range(128))
    final = tmp_path / "x.bin"
    copier.write_file(tmp_path / "x.tmp", final, header, payload, fsync=False)
    buf = BufferPool().get(128 + n)  # aligned, rounded up: the O_DIRECT path
    got, crc, used = copier.read_file_direct(final, 128, buf, n)
    assert got == header and torch.equal(buf[128:128 + n], payload) and crc == copier.crc32c(payload)
    assert used == probe_o_direct(tmp_path)  # O_DIRECT wherever this filesystem takes it
    # A buffer that is not aligned, or too short for the rounded-up read: the same bytes, buffered.
    raw = torch.zeros(128 + n + 4096 + 1, dtype=torch.uint8)
    off = 1 if raw.data_ptr() % 4096 else 0
    unaligned = raw[off + 1:off + 1 + 128 + n]
    got, crc, used = copier.read_file_direct(final, 128, unaligned, n)
    assert (got, crc, used) == (header, copier.crc32c(payload), False)
    assert torch.equal(unaligned[128:], payload)


def test_read_file_direct_size_and_missing_checks(tmp_path):
    from offload.store.buffers import BufferPool

    final = tmp_path / "x.bin"
    copier.write_file(tmp_path / "x.tmp", final, b"h" * 128, torch.zeros(5000, dtype=torch.uint8), False)
    buf = BufferPool().get(128 + 4999).fill_(7)
    with pytest.raises(ValueError, match="5128"):
        copier.read_file_direct(final, 128, buf, 4999)
    assert (buf == 7).all()  # nothing read from a wrong-size file
    with pytest.raises(ValueError):
        copier.read_file_direct(final, 128, torch.empty(100, dtype=torch.uint8), 5000)  # buffer too small
    with pytest.raises(OSError) as ei:
        copier.read_file_direct(tmp_path / "nope", 128, BufferPool().get(5128), 5000)
    assert ei.value.errno == errno.ENOENT


def test_missing_file_and_bad_dir(tmp_path):
    with pytest.raises(OSError) as ei:
        copier.read_file(tmp_path / "nope", 0, torch.empty(1, dtype=torch.uint8))
    assert ei.value.errno == errno.ENOENT
    with pytest.raises(OSError) as ei:
        copier.read_header(tmp_path / "nope", 1)
    assert ei.value.errno == errno.ENOENT

    # tmp is fine but the final directory does not exist: rename fails, tmp removed.
    payload = torch.ones(10, dtype=torch.uint8)
    with pytest.raises(OSError) as ei:
        copier.write_file(tmp_path / "a.tmp", tmp_path / "missing" / "a.bin", b"h", payload, True)
    assert ei.value.errno == errno.ENOENT
    assert not (tmp_path / "a.tmp").exists()
    # tmp itself in a nonexistent directory.
    with pytest.raises(OSError) as ei:
        copier.write_file(tmp_path / "missing" / "b.tmp", tmp_path / "b.bin", b"h", payload, True)
    assert ei.value.errno == errno.ENOENT
    assert os.listdir(tmp_path) == []


def test_write_file_exclusive_tmp(tmp_path):
    tmp = tmp_path / "c.tmp"
    tmp.write_bytes(b"someone else's")
    with pytest.raises(OSError) as ei:
        copier.write_file(tmp, tmp_path / "c.bin", b"h", torch.ones(3, dtype=torch.uint8), False)
    assert ei.value.errno == errno.EEXIST
    assert tmp.read_bytes() == b"someone else's"  # another writer's tmp is left alone
    assert not (tmp_path / "c.bin").exists()


def test_gather_out_param_and_threads():
    # > 16 MiB so the threaded split is actually used.
    nb = 64
    t = torch.randint(-128, 128, (2, nb, 300_000), dtype=torch.int8)
    ids = [*list(range(10, 40)), 63, 0, 5, *list(range(41, 60))]
    ref = torch.cat([t[k, b].view(torch.uint8) for b in ids for k in range(2)])  # one layer, K then V per block
    for threads in (1, 3):
        g = GroupPages([LayerPages.from_tensor(t, nb)], nb, torch.device("cpu"), num_threads=threads)
        out = torch.empty(len(ids) * g.page_bytes, dtype=torch.uint8)
        assert g.gather(ids, out=out).data_ptr() == out.data_ptr()
        assert torch.equal(out, ref)
        with pytest.raises(ValueError):
            g.gather(ids, out=out[:-1])
        back = torch.zeros_like(t)
        GroupPages([LayerPages.from_tensor(back, nb)], nb, torch.device("cpu"), num_threads=threads).scatter(
            out, len(ids), list(enumerate(ids))
        )
        mask = torch.zeros(nb, dtype=torch.bool)
        mask[ids] = True
        assert torch.equal(back[:, mask], t[:, mask]) and not back[:, ~mask].any()


def test_scatter_duplicate_destination_last_wins():
    nb = 64
    t = torch.randint(-128, 128, (nb, 600_000), dtype=torch.int8)
    g = GroupPages([LayerPages.from_tensor(t, nb)], nb, torch.device("cpu"), num_threads=2)
    buf = g.gather(list(range(40)))
    out = torch.zeros_like(t)
    pairs = [(i, i) for i in range(40)] + [(7, 3)]
    GroupPages([LayerPages.from_tensor(out, nb)], nb, torch.device("cpu"), num_threads=2).scatter(buf, 40, pairs)
    assert torch.equal(out[3], t[7]) and torch.equal(out[4:40], t[4:40])


@pytest.mark.parametrize("pairs", [
    [(0, 40), (1, 41), (2, 42), (3, 10), (4, 11)],  # every page once, in order: CRC in the copy's pass
    [(0, 40), (2, 42)],  # a subset: the buffer is CRC'd first, then scattered
    [(1, 41), (0, 40), (2, 42), (3, 10), (4, 11)],  # out of order
    [(0, 40), (1, 40), (2, 42), (3, 10), (4, 11)],  # a duplicate destination: the last pair wins
], ids=["in-order", "subset", "reordered", "duplicate-dst"])
def test_scatter_with_crc_returns_the_buffers_crc_and_moves_the_same_bytes(pairs):
    """GroupPages.scatter(crc=True): the CRC-32C of the whole source buffer, whichever way the pairs
    read it, and exactly the pages a plain scatter writes."""
    nb = 64
    kv = torch.randint(0, 256, (2, nb, 16, 2, 64), dtype=torch.uint8)  # K and V segments (>= 4 KiB each)
    state = torch.randint(0, 256, (nb, 3000), dtype=torch.uint8)  # a state page, not 4 KiB-sized

    def pages(k, m):
        return GroupPages([LayerPages.from_tensor(k, nb), LayerPages.from_tensor(m, nb)], nb, torch.device("cpu"))
    buf = pages(kv, state).gather([5, 6, 7, 20, 3])
    k1, m1, k2, m2 = kv.clone(), state.clone(), kv.clone(), state.clone()
    assert pages(k1, m1).scatter(buf, 5, pairs, crc=True) == crc32c_ref(bytes(buf.tolist()))
    assert pages(k2, m2).scatter(buf, 5, pairs) is None
    assert torch.equal(k1, k2) and torch.equal(m1, m2)
    assert not torch.equal(k1, kv), "the scatter wrote nothing"


@pytest.mark.parametrize("n", [0, 1, 100, 16 << 10, (16 << 10) + 7, (1 << 20) + 13])
def test_copy_crc_copies_and_checksums_in_one_pass(n: int) -> None:
    """The write-through's copy out of host memory: the bytes, and their CRC as crc32c gives it,
    on either side of the piece size and of the streaming-store threshold."""
    src = torch.randint(0, 256, (n,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    assert copier.copy_crc(dst, src, seed=12345) == copier.crc32c(src, 12345)
    assert torch.equal(dst, src)
    with pytest.raises(ValueError):
        copier.copy_crc(torch.empty(n + 1, dtype=torch.uint8), src)
