"""The copier's GHASH (csrc/ghash.h), which feeds the chunk MAC (AES-256-GMAC, v2) in the
passes that move or CRC a payload: its tags are `cryptography`'s GMAC tags for any length
and any split into updates, the fused passes hash exactly the bytes they move, and a load
that leaves the MAC to the scatter's pass (`read_framed(crc_later=True)`, then
`HostChunk.check`) refuses what the MAC refuses, as the reader that checks it at once does.
"""

from __future__ import annotations

import os
import random

import pytest
import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from offload import _copier, copier
from offload.copier import GroupPages, LayerPages
from offload.store.base import ChunkMiss, HostChunk, MissReason
from offload.store.buffers import BufferPool
from offload.store.format import HEADER_LEN, MAC_OFFSET
from test_auth import K1, gmac_field, quarantined, rewrite, store
from test_format_store import header, key_of, payload

pytestmark = pytest.mark.skipif(not _copier.ghash_supported(), reason="the copier's GHASH needs x86-64 with PCLMULQDQ")
fed_by_the_copier = pytest.mark.skipif(
    not copier.ghash_available(), reason="the MAC is cryptography's GMAC alone on a CPU without AVX-512 VPCLMULQDQ")


def gmac_tag(key: bytes, parts: list[bytes]) -> bytes:
    e = Cipher(algorithms.AES(key), modes.GCM(bytes(12))).encryptor()
    for p in parts:
        e.authenticate_additional_data(p)
    e.finalize()
    return e.tag


def tag_from_ghash(key: bytes, feed, wide: bool = True) -> bytes:
    """GCM's tag from the copier's hash: S xor AES_K(J0), H = AES_K(0)."""
    aes = Cipher(algorithms.AES(key), modes.ECB()).encryptor()
    h, mask = aes.update(bytes(16)), aes.update(bytes(12) + b"\0\0\0\1")
    g = copier.Ghash(h, wide)
    feed(g)
    return bytes(a ^ b for a, b in zip(g.digest(), mask))


@pytest.mark.parametrize("wide", [True, False], ids=["AVX-512 where it runs", "PCLMULQDQ"])
def test_ghash_gives_gcm_tags_for_every_length_and_split(wide):
    rng = random.Random(7)
    lengths = [0, 1, 15, 16, 17, 63, 64, 65, 511, 512, 513, 1023, 4096 + 5, 70_001, 300_000]
    for n in lengths + [rng.randrange(0, 9000) for _ in range(60)]:
        key, data = os.urandom(32), os.urandom(n)
        cuts = sorted(rng.randrange(0, n + 1) for _ in range(rng.randrange(0, 5)))
        parts = [data[a:b] for a, b in zip([0, *cuts], [*cuts, n])]

        def feed(g, parts=parts):
            for p in parts:
                g.update_buffer(p)
        assert tag_from_ghash(key, feed, wide) == gmac_tag(key, parts), (n, cuts)


def _pages(num_blocks: int, page: int, layers: int = 3) -> tuple[GroupPages, list[torch.Tensor]]:
    kv = [torch.zeros(2, num_blocks, page // 2, dtype=torch.uint8) for _ in range(layers)]
    return GroupPages([LayerPages.from_tensor(t, num_blocks) for t in kv], num_blocks, torch.device("cpu")), kv


@pytest.mark.parametrize("pairs", [[(0, 5), (1, 2), (2, 7)], [(2, 1), (0, 3), (1, 4)]],
                         ids=["in-order (fused)", "out-of-order (hashed first)"])
def test_a_scatter_hashes_exactly_the_buffer_it_moves(pairs):
    pages, kv = _pages(8, 40_002)  # pages not a multiple of 16 bytes: blocks straddle pieces
    buf = torch.randint(0, 256, (3 * pages.page_bytes,), dtype=torch.uint8)
    key = os.urandom(32)
    got = tag_from_ghash(key, lambda g: pages.scatter(buf, 3, pairs, ghash=g))
    assert got == gmac_tag(key, [buf.numpy().tobytes()])
    moved = [t.clone() for t in kv]
    for t in kv:
        t.zero_()
    pages.scatter(buf, 3, pairs)
    assert all(torch.equal(a, b) for a, b in zip(moved, kv)), "the hash must not change what is copied"
    assert any(t.any() for t in kv)


def test_crc_and_hash_in_one_pass_are_each_what_they_are_alone():
    buf = torch.randint(0, 256, (1_000_003,), dtype=torch.uint8)
    key = os.urandom(32)
    crcs = []
    tag = tag_from_ghash(key, lambda g: crcs.append(copier.crc32c_ghash(buf, g)))
    assert tag == gmac_tag(key, [buf.numpy().tobytes()])
    assert crcs == [copier.crc32c(buf)]


def _load_for_scatter(s, h):
    """A load's path: read for a scatter, scatter into pages with the MAC's hash fed in the
    copy's pass, settle; returns the chunk's payload as scattered, or raises the ChunkMiss."""
    chunk = HostChunk.pooled(BufferPool(), h.payload_len)
    try:
        s.read_framed(h, chunk, crc_later=True)
        assert chunk.crc_due is None, "with a key the MAC is checked, not the CRC"
        assert chunk.mac_due is not None and chunk.mac_due.ghash is not None, "left to the scatter's pass"
        pages, kv = _pages(4, h.payload_len, layers=1)
        pages.scatter(chunk.payload, 1, [(0, 1)], ghash=chunk.mac_due.ghash)
        chunk.check(mac_fed=True)
        return torch.cat([kv[0][0, 1], kv[0][1, 1]])
    finally:
        chunk.release()


@fed_by_the_copier
def test_a_load_settled_by_the_scatter_restores_a_signed_entry(tmp_path):
    s = store(tmp_path, K1)
    h, p = header(key=key_of("ok")), payload(3)
    assert s.write(h, p)
    assert torch.equal(_load_for_scatter(s, h), p)
    assert quarantined(s) == []


@fed_by_the_copier
@pytest.mark.parametrize("damage,reason", [
    ("payload replaced, CRC recomputed", MissReason.UNAUTHENTICATED),
    ("payload flipped, CRC stale", MissReason.CORRUPT),
    ("identity changed, CRCs recomputed", MissReason.UNAUTHENTICATED),
])
def test_a_load_settled_by_the_scatter_refuses_what_the_mac_refuses(tmp_path, damage, reason):
    s = store(tmp_path, K1)
    h, p = header(key=key_of("bad")), payload(4)
    assert s.write(h, p)
    path = s.file_path(h.group, h.key)
    if damage.startswith("payload replaced"):
        rewrite(path, payload=bytes(payload(5).numpy()))
    elif damage.startswith("payload flipped"):
        raw = bytearray(path.read_bytes())
        raw[-1] ^= 0x40
        path.write_bytes(bytes(raw))
    else:
        rewrite(path, token_end=h.token_end + 64)
    with pytest.raises(ChunkMiss) as e:
        _load_for_scatter(s, h)
    assert e.value.reason is reason
    assert len(quarantined(s)) == 1, "a file that claims our key and fails is moved aside"


@fed_by_the_copier
def test_entries_signed_with_either_hash_verify_with_the_other(tmp_path, monkeypatch):
    """The copier's GHASH and cryptography's GMAC are one MAC: entries written on a CPU
    without the copier's hash restore where it runs, and the other way round."""
    s = store(tmp_path, K1)
    h1, p1 = header(key=key_of("native")), payload(6)
    assert s.write(h1, p1)
    monkeypatch.setattr(copier, "ghash_available", lambda: False)
    h2, p2 = header(key=key_of("cryptography")), payload(7)
    assert s.write(h2, p2)
    out = torch.zeros(h1.payload_len, dtype=torch.uint8)
    s.read_into(h1, out)
    assert torch.equal(out, p1)
    monkeypatch.undo()
    assert torch.equal(_load_for_scatter(s, h2), p2)


@fed_by_the_copier
@pytest.mark.parametrize("copy", ["gather", "fill"])
def test_a_copy_that_fed_the_mac_signs_the_documented_mac_and_no_store_thread_reads_it_again(tmp_path, copy):
    """The forward path's gather (`HostChunk.gather`) or a store thread's copy out of a
    host-memory slot (`HostChunk.fill`) feeds the MAC its key begins; the writer signs with
    it (the MAC `gmac_field` builds from the documented construction), and the file loads."""
    s = store(tmp_path, K1)
    pages, kv = _pages(8, 30_000)
    for t in kv:
        t.random_(0, 256)
    ids = [6, 1]
    p = pages.gather(ids)
    h = header(key=key_of(copy), num_pages=2, page_bytes=pages.page_bytes)
    chunk = HostChunk.pooled(BufferPool(), h.payload_len)
    if copy == "gather":
        chunk.gather(pages, ids, s.keyring)
    else:
        chunk.fill(p, s.keyring)
    assert chunk.crc == copier.crc32c(p)
    assert chunk.signed is not None and chunk.signed[0] is s.keyring
    assert chunk.fed_mac(object()) is None, "a MAC fed for one key is no other signer's"
    assert s.write_framed(h, chunk, direct=False)[0]
    assert chunk.signed is None, "the writer signed with the fed MAC"
    raw = s.file_path(h.group, h.key).read_bytes()
    nonce = raw[MAC_OFFSET:MAC_OFFSET + 16]
    assert raw[MAC_OFFSET:MAC_OFFSET + 32] == gmac_field(K1, nonce, raw[HEADER_LEN:] + raw[:MAC_OFFSET])
    assert torch.equal(_load_for_scatter(s, h), p)
    chunk.release()
