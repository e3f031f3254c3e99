"""Tests for the chunk file format (offload/store/format.py) and the
filesystem tier (offload/store/files.py, offload/store/fs.py), on real files under tmp_path.

Header bytes are checked against the documented layout with `struct` and a
pure-Python CRC-32C, not against the code under test.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from offload.keys import FORMAT_VERSION
from offload.planner import GroupKind
from offload.store.base import ChunkMiss, HostChunk
from offload.store.buffers import BufferPool
from offload.store.cachedir.paths import LAYOUT_DIR
from offload.store.files import FileStore
from offload.store.format import HEADER_LEN, MAGIC, ChunkHeader, FormatError

PAGE = 4096
NPAGES = 3

# Documented layout (docs/format.md, 192 bytes): magic, version, header_len, group, kind,
# fingerprint, key, token_start, token_end, num_pages, page_bytes, payload_len,
# payload_crc, parent, key_id, reserved, mac, header_crc.
LAYOUT = struct.Struct("<8sHHHH32s32sQQIIQI8s8s24s32sI")
FIELD_OFFSETS = {  # name -> (offset, size)
    "magic": (0, 8), "version": (8, 2), "header_len": (10, 2), "group": (12, 2), "kind": (14, 2),
    "fingerprint": (16, 32), "key": (48, 32), "token_start": (80, 8), "token_end": (88, 8),
    "num_pages": (96, 4), "page_bytes": (100, 4), "payload_len": (104, 8), "payload_crc": (112, 4),
    "parent": (116, 8), "key_id": (124, 8), "reserved": (132, 24), "mac": (156, 32), "header_crc": (188, 4),
}
DOC_HEADER_LEN = 192
KIND_CODE = {GroupKind.FULL_ATTENTION: 1, GroupKind.SLIDING_WINDOW: 2, GroupKind.CHUNKED_LOCAL: 3,
             GroupKind.MAMBA: 4}


def _crc_table() -> list[int]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ (0x82F63B78 if c & 1 else 0)
        table.append(c)
    return table


_TABLE = _crc_table()


def crc32c_ref(data: bytes) -> int:
    """Pure-Python CRC-32C (Castagnoli), independent of offload._copier."""
    crc = 0xFFFFFFFF
    for b in data:
        crc = (crc >> 8) ^ _TABLE[(crc ^ b) & 0xFF]
    return crc ^ 0xFFFFFFFF


def raw_header(**over) -> bytes:
    """A header built by hand from the documented layout, with a valid CRC."""
    f = dict(magic=MAGIC, version=3, header_len=DOC_HEADER_LEN, group=1, kind=1, fingerprint=b"F" * 32,
             key=b"K" * 32, token_start=256, token_end=512, num_pages=NPAGES, page_bytes=PAGE,
             payload_len=NPAGES * PAGE, payload_crc=0x12345678, parent=bytes(8), key_id=bytes(8),
             reserved=bytes(24), mac=bytes(32))
    f.update(over)
    body = LAYOUT.pack(*f.values(), 0)[:-4]
    return body + struct.pack("<I", crc32c_ref(body))


FP = b"\x11" * 32
FP2 = b"\x22" * 32


def key_of(name: str) -> bytes:
    return hashlib.sha256(name.encode()).digest()


def header(key: bytes | None = None, fp: bytes = FP, **over) -> ChunkHeader:
    d = dict(fingerprint=fp, key=key if key is not None else key_of("A"), group=1,
             kind=GroupKind.FULL_ATTENTION, token_start=256, token_end=512, num_pages=NPAGES,
             page_bytes=PAGE)
    d.update(over)
    return ChunkHeader(**d)


def payload(seed: int = 0, n: int = NPAGES * PAGE) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def all_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def stray_tmp(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if ".tmp" in p.name]


# ====================================================================== header ==

def test_pack_matches_documented_layout():
    h = header(group=7, kind=GroupKind.MAMBA, token_start=1024, token_end=1280, num_pages=1,
               page_bytes=65536, payload_crc=0xDEADBEEF, parent=b"P" * 8, key_id=b"I" * 8, mac=b"M" * 32)
    raw = h.pack()
    assert len(raw) == HEADER_LEN == DOC_HEADER_LEN
    fields = dict(zip(FIELD_OFFSETS, LAYOUT.unpack(raw)))
    assert fields == {
        "magic": b"KVOFFLD\x00", "version": 3, "header_len": DOC_HEADER_LEN, "group": 7, "kind": 4,
        "fingerprint": FP, "key": key_of("A"), "token_start": 1024, "token_end": 1280,
        "num_pages": 1, "page_bytes": 65536, "payload_len": 65536, "payload_crc": 0xDEADBEEF,
        "parent": b"P" * 8, "key_id": b"I" * 8, "reserved": bytes(24), "mac": b"M" * 32,
        "header_crc": crc32c_ref(raw[:188]),
    }
    # Offsets of the table above really are where struct puts them.
    for name, (off, size) in FIELD_OFFSETS.items():
        if isinstance(fields[name], bytes):
            assert raw[off:off + size] == fields[name], name
    assert ChunkHeader.unpack(raw) == h


@pytest.mark.parametrize("kind", list(GroupKind))
def test_header_round_trip(kind):
    h = header(kind=kind, group=3, token_start=2**40, token_end=2**40 + 256, num_pages=5,
               page_bytes=12345, payload_crc=0xFFFFFFFF)
    back = ChunkHeader.unpack(h.pack())
    assert back == h
    assert back.kind is kind
    assert back.payload_len == 5 * 12345
    back.check_matches(h)


def test_unpack_accepts_hand_built_header():
    h = ChunkHeader.unpack(raw_header(group=2, kind=3))
    assert (h.fingerprint, h.key, h.group, h.kind) == (b"F" * 32, b"K" * 32, 2, GroupKind.CHUNKED_LOCAL)
    assert (h.token_start, h.token_end, h.num_pages, h.page_bytes, h.payload_crc) == (
        256, 512, NPAGES, PAGE, 0x12345678)


@pytest.mark.parametrize("pos", range(HEADER_LEN))
def test_every_flipped_header_byte_is_rejected(pos):
    expected = header(payload_crc=0xCAFEF00D)
    raw = bytearray(expected.pack())
    raw[pos] ^= 0xFF
    with pytest.raises(FormatError):
        ChunkHeader.unpack(bytes(raw)).check_matches(expected)


@pytest.mark.parametrize("pos", [0, 9, 20, 60, 85, 99, 110, 114, 120, 127, 130, 140, 170, 191])
@pytest.mark.parametrize("bit", [0, 7])
def test_single_bit_flips_are_rejected(pos, bit):
    raw = bytearray(header().pack())
    raw[pos] ^= 1 << bit
    with pytest.raises(FormatError):
        ChunkHeader.unpack(bytes(raw))


@pytest.mark.parametrize("raw", [b"", bytes(127), bytes(128), bytes(191), bytes(193), bytes(192)])
def test_wrong_length_or_zero_header_is_rejected(raw):
    with pytest.raises(FormatError):
        ChunkHeader.unpack(raw)


def test_bad_magic_is_named():
    with pytest.raises(FormatError, match="magic"):
        ChunkHeader.unpack(raw_header(magic=b"KVOFFLD\x01"))


@pytest.mark.parametrize("version", [0, 1, 2, 4, 7, 65535])
def test_other_format_version_is_refused_by_number(version):
    """2 included: a version 2 attention-only tail started at its chunk (docs/format.md, Version 3)."""
    assert FORMAT_VERSION == 3
    with pytest.raises(FormatError, match=rf"version {version}\b"):
        ChunkHeader.unpack(raw_header(version=version))


def test_attention_only_tail_entry_is_checked_on_its_token_start():
    """An attention-only tail entry names [b - unit, b); a file under the
    same key that says [chunk start, b) (a version 2 tail's shape) is not it."""
    entry = header(token_start=544, token_end=560, num_pages=1)
    header(token_start=544, token_end=560, num_pages=1).check_matches(entry)
    with pytest.raises(FormatError, match="token_start"):
        header(token_start=512, token_end=560, num_pages=1).check_matches(entry)


def test_wrong_header_len_is_rejected_even_with_valid_crc():
    with pytest.raises(FormatError):
        ChunkHeader.unpack(raw_header(header_len=256))
    with pytest.raises(FormatError):
        ChunkHeader.unpack(raw_header(header_len=128))  # the earlier 128-byte header's value


def test_bad_header_crc_is_rejected():
    raw = bytearray(raw_header())
    raw[188:192] = struct.pack("<I", (crc32c_ref(bytes(raw[:188])) + 1) & 0xFFFFFFFF)
    with pytest.raises(FormatError, match="checksum"):
        ChunkHeader.unpack(bytes(raw))


@pytest.mark.parametrize("over", [{"kind": 0}, {"kind": 5}, {"payload_len": NPAGES * PAGE + 1},
                                  {"payload_len": 0}, {"reserved": b"\x01" + bytes(23)}])
def test_inconsistent_fields_with_valid_crc_are_rejected(over):
    with pytest.raises(FormatError):
        ChunkHeader.unpack(raw_header(**over))


@pytest.mark.parametrize("field,value", [
    ("fingerprint", FP2),
    ("key", key_of("B")),
    ("group", 2),
    ("kind", GroupKind.SLIDING_WINDOW),
    ("token_start", 0),
    ("token_end", 768),
    ("num_pages", NPAGES + 1),
    ("page_bytes", PAGE * 2),
])
def test_check_matches_rejects_each_identity_field(field, value):
    stored = ChunkHeader.unpack(header().pack())
    wanted = header(**{field: value})
    with pytest.raises(FormatError, match=field):
        stored.check_matches(wanted)


def test_check_matches_ignores_payload_crc():
    # The reader cannot know the payload CRC in advance; it is checked against the data instead.
    header(payload_crc=1).check_matches(header(payload_crc=2))


# ======================================================================= store ==

@pytest.fixture
def store(tmp_path: Path) -> FileStore:
    return FileStore.open(str(tmp_path / "cache"), FP)


def test_file_path_follows_documented_layout(tmp_path):
    s = FileStore.open(str(tmp_path), FP)
    k = key_of("A")
    assert f"kvoffload-v{FORMAT_VERSION}" == LAYOUT_DIR, "the layout directory names the format version"
    assert s.root == tmp_path / LAYOUT_DIR / FP.hex()
    assert s.file_path(3, k) == tmp_path / LAYOUT_DIR / FP.hex() / "g3" / k.hex()[:2] / f"{k.hex()}.kv"


@pytest.mark.parametrize("fsync", [False, True])
def test_write_then_read_round_trip(tmp_path, fsync):
    s = FileStore.open(str(tmp_path), FP, fsync=fsync)
    h, data = header(), payload(1)
    assert not s.contains(h.group, h.key)
    assert s.write(h, data) is True
    assert s.contains(h.group, h.key)
    out = torch.zeros(NPAGES * PAGE, dtype=torch.uint8)
    s.read_into(h, out)
    assert torch.equal(out, data)
    # The file is exactly header + payload, readable without our code.
    blob = s.file_path(h.group, h.key).read_bytes()
    assert len(blob) == HEADER_LEN + NPAGES * PAGE
    assert blob[HEADER_LEN:] == bytes(data.tolist())
    fields = dict(zip(FIELD_OFFSETS, LAYOUT.unpack(blob[:HEADER_LEN])))
    assert fields["payload_crc"] == crc32c_ref(blob[HEADER_LEN:])
    assert fields["header_crc"] == crc32c_ref(blob[:188])
    assert fields["key_id"] == bytes(8) and fields["mac"] == bytes(32), "no key: MAC fields are zeros"
    assert fields["key"] == h.key and fields["fingerprint"] == FP
    assert stray_tmp(tmp_path) == []


def test_slots_are_framed_in_the_tiers_reused_buffers(tmp_path):
    """A host-memory slot (no header room) is copied into a frame of the tier's own pool, which
    gets it back after the write: one frame for stores one after another, each file exact."""
    from offload.store.base import Placement
    from offload.store.fs import FsData
    data = FsData(FileStore.open(str(tmp_path), FP))
    for i in range(3):
        h, p = header(key=key_of(f"slot{i}")), payload(i)
        assert data.put(h, HostChunk(p), Placement()) is True
        blob = data.store.file_path(h.group, h.key).read_bytes()
        assert blob[HEADER_LEN:] == bytes(p.tolist())
        fields = dict(zip(FIELD_OFFSETS, LAYOUT.unpack(blob[:HEADER_LEN])))
        assert fields["payload_crc"] == crc32c_ref(blob[HEADER_LEN:])
    assert (data.frames.allocated, data.frames.reused) == (1, 2)
    pool = BufferPool()
    framed = HostChunk.pooled(pool, NPAGES * PAGE)
    with framed.framing(BufferPool(), None) as same:
        assert same is framed, "a chunk with header room is written as it is"


def test_groups_are_separate_files(store):
    k = key_of("A")
    a, b = payload(1), payload(2)
    assert store.write(header(key=k, group=0), a)
    assert store.write(header(key=k, group=1), b)
    out = torch.empty_like(a)
    store.read_into(header(key=k, group=0), out)
    assert torch.equal(out, a)
    store.read_into(header(key=k, group=1), out)
    assert torch.equal(out, b)


def test_second_write_of_same_key_returns_false_and_keeps_file(store):
    h = header()
    assert store.write(h, payload(1))
    path = store.file_path(h.group, h.key)
    before, st = path.read_bytes(), path.stat()
    assert store.write(h, payload(2)) is False  # different bytes must not replace the file
    assert path.read_bytes() == before
    assert path.stat().st_ino == st.st_ino and path.stat().st_mtime_ns == st.st_mtime_ns
    out = torch.empty(NPAGES * PAGE, dtype=torch.uint8)
    store.read_into(h, out)
    assert torch.equal(out, payload(1))
    assert stray_tmp(store.root) == []


def test_write_rejects_payload_of_wrong_size(store):
    h = header()
    with pytest.raises(ValueError):
        store.write(h, payload(1, n=NPAGES * PAGE - 1))
    assert not store.contains(h.group, h.key)
    assert not store.root.exists() or all_files(store.root) == []


def test_files_are_deterministic_across_roots(tmp_path):
    a = FileStore.open(str(tmp_path / "a"), FP)
    b = FileStore.open(str(tmp_path / "b"), FP)
    h, data = header(), payload(3)
    a.write(h, data)
    b.write(h, data.clone())
    fa, fb = a.file_path(h.group, h.key), b.file_path(h.group, h.key)
    assert fa != fb
    assert fa.read_bytes() == fb.read_bytes()
    assert fa.relative_to(tmp_path / "a") == fb.relative_to(tmp_path / "b")


def test_missing_file_is_a_miss_and_nothing_is_created(store):
    out = torch.empty(NPAGES * PAGE, dtype=torch.uint8)
    with pytest.raises(ChunkMiss) as ei:
        store.read_into(header(), out)
    assert ei.value.reason == "missing"
    assert not (store.root / "quarantine").exists()
    # Another key in an existing directory: still missing.
    store.write(header(key=key_of("A")), payload(1))
    with pytest.raises(ChunkMiss) as ei:
        store.read_into(header(key=key_of("B")), out)
    assert ei.value.reason == "missing"
    assert store.contains(1, key_of("A"))


def _flip_payload(p: Path, store: FileStore) -> None:
    b = bytearray(p.read_bytes())
    b[HEADER_LEN + 5000] ^= 0x01
    p.write_bytes(bytes(b))


def _flip_last_payload_byte(p: Path, store: FileStore) -> None:
    b = bytearray(p.read_bytes())
    b[-1] ^= 0x80
    p.write_bytes(bytes(b))


def _flip_header(pos: int):
    def f(p: Path, store: FileStore) -> None:
        b = bytearray(p.read_bytes())
        b[pos] ^= 0x01
        p.write_bytes(bytes(b))
    f.__name__ = f"flip_header_{pos}"
    return f


def _truncate_1(p: Path, store: FileStore) -> None:
    os.truncate(p, p.stat().st_size - 1)


def _truncate_0(p: Path, store: FileStore) -> None:
    os.truncate(p, 0)


def _header_only(p: Path, store: FileStore) -> None:
    os.truncate(p, HEADER_LEN)


def _zero_payload(p: Path, store: FileStore) -> None:
    b = p.read_bytes()
    p.write_bytes(b[:HEADER_LEN] + bytes(len(b) - HEADER_LEN))


def _append_byte(p: Path, store: FileStore) -> None:
    with open(p, "ab") as f:
        f.write(b"\x00")


def _swap_pages(p: Path, store: FileStore) -> None:
    b = p.read_bytes()
    pay = b[HEADER_LEN:]
    p.write_bytes(b[:HEADER_LEN] + pay[PAGE:2 * PAGE] + pay[:PAGE] + pay[2 * PAGE:])


def _other_key_file(p: Path, store: FileStore) -> None:
    # A complete, valid file of key B (same sizes) placed under key A's name.
    other = header(key=key_of("B"))
    assert store.write(other, payload(9))
    shutil.copyfile(store.file_path(other.group, other.key), p)


def _other_fingerprint_file(p: Path, store: FileStore) -> None:
    # The same key and sizes written by a different layout (fingerprint).
    alien = FileStore.open(str(store.root.parent.parent / "alien"), FP2)
    h = header(fp=FP2)
    assert alien.write(h, payload(9))
    shutil.copyfile(alien.file_path(h.group, h.key), p)


def _other_tokens_file(p: Path, store: FileStore) -> None:
    tmp = FileStore.open(str(store.root.parent.parent / "tok"), FP)
    h = header(token_start=0, token_end=256)
    assert tmp.write(h, payload(9))
    shutil.copyfile(tmp.file_path(h.group, h.key), p)


def _directory(p: Path, store: FileStore) -> None:
    p.unlink()
    p.mkdir()


CORRUPTIONS = [_flip_payload, _flip_last_payload_byte, _flip_header(0), _flip_header(9), _flip_header(50),
               _flip_header(100), _flip_header(113), _flip_header(120), _flip_header(126), _truncate_1,
               _truncate_0, _header_only, _zero_payload, _append_byte, _swap_pages, _other_key_file,
               _other_fingerprint_file, _other_tokens_file, _directory]


def _reader(kind: str):
    """`read_into` (buffered, into a bare payload) or `read_framed` (the whole
    file into a pooled buffer, O_DIRECT where the filesystem takes it): the
    same verification, so the same outcome for every kind of damage."""
    def read(store: FileStore, h: ChunkHeader, out: torch.Tensor) -> None:
        if kind == "read_into":
            store.read_into(h, out)
            return
        chunk = HostChunk.pooled(BufferPool(), h.payload_len)
        try:
            store.read_framed(h, chunk)
            out.copy_(chunk.payload)
        finally:
            chunk.release()
    return read


@pytest.mark.parametrize("reader", ["read_into", "read_framed"])
@pytest.mark.parametrize("corrupt", CORRUPTIONS, ids=lambda f: f.__name__.lstrip("_"))
def test_corrupt_file_is_a_miss_and_quarantined(store, corrupt, reader):
    read = _reader(reader)
    h, data = header(), payload(1)
    assert store.write(h, data)
    path = store.file_path(h.group, h.key)
    corrupt(path, store)
    out = torch.zeros(NPAGES * PAGE, dtype=torch.uint8)
    with pytest.raises(ChunkMiss) as ei:
        read(store, h, out)
    assert ei.value.reason == "corrupt"
    assert not store.contains(h.group, h.key)
    assert not path.exists()
    q = list((store.root / "quarantine").iterdir())
    assert len(q) == 1 and q[0].name.startswith(path.name)
    # A later read is a plain miss, and a fresh write works again.
    with pytest.raises(ChunkMiss) as ei:
        read(store, h, out)
    assert ei.value.reason == "missing"
    assert store.write(h, data) is True
    read(store, h, out)
    assert torch.equal(out, data)


def test_asking_for_more_pages_than_stored_is_a_miss(store):
    h = header()
    store.write(h, payload(1))
    bigger = header(num_pages=NPAGES + 1)
    out = torch.full((bigger.payload_len,), 0xAB, dtype=torch.uint8)
    with pytest.raises(ChunkMiss) as ei:
        store.read_into(bigger, out)
    assert ei.value.reason == "corrupt"


@pytest.mark.parametrize("n", [0, NPAGES * PAGE - 1, NPAGES * PAGE + 1, 2 * NPAGES * PAGE])
def test_wrong_size_buffer_raises_and_keeps_good_file(store, n):
    h, data = header(), payload(1)
    store.write(h, data)
    out = torch.zeros(n, dtype=torch.uint8)
    with pytest.raises(ValueError):
        store.read_into(h, out)
    # A caller's mistake must not cost the cache a good file.
    assert store.contains(h.group, h.key)
    good = torch.empty(NPAGES * PAGE, dtype=torch.uint8)
    store.read_into(h, good)
    assert torch.equal(good, data)


def test_non_uint8_buffer_raises_and_keeps_good_file(store):
    h = header()
    store.write(h, payload(1))
    with pytest.raises(ValueError):
        store.read_into(h, torch.zeros(NPAGES * PAGE // 4, dtype=torch.float32))
    with pytest.raises(ValueError):
        store.read_into(h, torch.zeros(2 * NPAGES * PAGE, dtype=torch.uint8)[::2])
    assert store.contains(h.group, h.key)


def test_no_tmp_files_after_many_writes(store):
    for i in range(20):
        assert store.write(header(key=key_of(str(i)), group=i % 3), payload(i))
    files = all_files(store.root)
    assert len(files) == 20
    assert all(p.suffix == ".kv" for p in files)
    assert stray_tmp(store.root) == []


def test_write_fails_when_parent_is_a_file(tmp_path):
    s = FileStore.open(str(tmp_path), FP)
    h = header()
    s.root.mkdir(parents=True)
    (s.root / f"g{h.group}").write_bytes(b"not a directory")
    with pytest.raises(OSError):
        s.write(h, payload(1))
    assert stray_tmp(tmp_path) == []
    assert not s.contains(h.group, h.key)


def test_write_fails_when_rename_fails_and_removes_tmp(store, monkeypatch):
    h = header()
    final = store.file_path(h.group, h.key)
    final.mkdir(parents=True)
    (final / "blocker").write_bytes(b"x")  # rename onto a non-empty directory fails
    real_exists = os.path.exists
    monkeypatch.setattr(os.path, "exists", lambda p: False if Path(p) == final else real_exists(p))
    with pytest.raises(OSError):
        store.write(h, payload(1))
    assert stray_tmp(store.root) == []
    assert [p.name for p in final.parent.iterdir()] == [final.name]


_FSIZE_CHILD = r"""
import resource, signal, sys
from pathlib import Path
import torch
sys.path.insert(0, sys.argv[2])
from test_format_store import FP, header, payload
from offload.store.files import FileStore
s = FileStore.open(sys.argv[1], FP)
h = header()
s.file_path(h.group, h.key).parent.mkdir(parents=True)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (5000, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
try:
    s.write(h, payload(1))
except OSError as e:
    print("OSError", e.errno)
else:
    print("written")
"""


def test_failure_mid_write_raises_and_removes_tmp(tmp_path):
    # RLIMIT_FSIZE makes write(2) fail part way (EFBIG) even for root.
    r = subprocess.run([sys.executable, "-c", _FSIZE_CHILD, str(tmp_path), str(Path(__file__).parent)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["OSError", "27"]  # EFBIG
    assert stray_tmp(tmp_path) == []
    assert [p for p in tmp_path.rglob("*.kv")] == []


def test_write_into_read_only_directory(tmp_path):
    s = FileStore.open(str(tmp_path), FP)
    h = header()
    d = s.file_path(h.group, h.key).parent
    d.mkdir(parents=True)
    d.chmod(0o500)
    try:
        if os.access(d, os.W_OK):
            pytest.skip("running with privileges that ignore directory permissions")
        with pytest.raises(OSError):
            s.write(h, payload(1))
        assert stray_tmp(tmp_path) == []
    finally:
        d.chmod(0o700)


def test_concurrent_writers_of_same_key(store):
    h, data = header(), payload(5)
    n = 8
    barrier = threading.Barrier(n)
    results: list[object] = []
    lock = threading.Lock()

    def run() -> None:
        barrier.wait()
        try:
            r: object = store.write(h, data.clone())
        except Exception as e:
            r = e
        with lock:
            results.append(r)

    threads = [threading.Thread(target=run) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(results) == n
    assert all(isinstance(r, bool) for r in results), results
    assert any(results)
    assert all_files(store.root) == [store.file_path(h.group, h.key)]
    out = torch.empty_like(data)
    store.read_into(h, out)
    assert torch.equal(out, data)


def test_concurrent_writers_of_many_keys_and_readers(store):
    keys = [key_of(f"k{i}") for i in range(16)]
    errors: list[BaseException] = []

    def writer(seed: int) -> None:
        try:
            for i, k in enumerate(keys):
                store.write(header(key=k), payload(i))
        except BaseException as e:
            errors.append(e)

    def reader() -> None:
        out = torch.empty(NPAGES * PAGE, dtype=torch.uint8)
        try:
            for _ in range(3):
                for i, k in enumerate(keys):
                    try:
                        store.read_into(header(key=k), out)
                    except ChunkMiss as e:
                        assert e.reason == "missing", e  # never a half-written file
                        continue
                    assert torch.equal(out, payload(i))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
    threads += [threading.Thread(target=reader) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert errors == []
    assert len(all_files(store.root)) == len(keys)
    assert not (store.root / "quarantine").exists()


# ================================================================ write_layout ==

def test_write_layout(store):
    desc = {"fingerprint": FP.hex(), "tensors": [{"shape": [2, 100, 16, 8, 128], "dtype": "bfloat16"}]}
    store.write_layout(desc)
    target = store.root / "layout.json"
    assert json.loads(target.read_text()) == desc
    before = target.read_bytes()

    # Same tensors (other descriptive fields may differ): accepted, file kept.
    store.write_layout({**desc, "model": "renamed"})
    assert target.read_bytes() == before

    # The same fingerprint over another tensor layout must be refused.
    other = {**desc, "tensors": [{"shape": [2, 100, 16, 8, 64], "dtype": "bfloat16"}]}
    with pytest.raises(RuntimeError) as ei:
        store.write_layout(other)
    assert str(store.root) in str(ei.value)
    assert target.read_bytes() == before
    assert sorted(p.name for p in store.root.iterdir()) == ["layout.json"]


def test_write_layout_missing_tensors_vs_present_is_refused(store):
    store.write_layout({"tensors": None})
    with pytest.raises(RuntimeError):
        store.write_layout({"tensors": [1]})


def test_write_layout_shared_by_two_instances(tmp_path):
    a = FileStore.open(str(tmp_path), FP)
    b = FileStore.open(str(tmp_path), FP)
    desc = {"tensors": [[1, 2, 3]]}
    a.write_layout(desc)
    b.write_layout(desc)
    assert json.loads((a.root / "layout.json").read_text()) == desc
    # Another fingerprint is another directory: no conflict.
    c = FileStore.open(str(tmp_path), FP2)
    c.write_layout({"tensors": [[9]]})
    assert c.root != a.root


def test_registration_makes_every_directory_of_every_group_before_any_store(tmp_path):
    """FsData.record_layout (the connector's registration) makes each group's fan-out
    directories, with the cache's dir_mode, so that no store makes one while loads read."""
    from offload.store.fs import FsData
    from offload.store.options import FsOptions

    opts = FsOptions(path=str(tmp_path), dir_mode=0o750)
    data = FsData(FileStore.open(str(tmp_path), FP, options=opts))
    data.record_layout({"groups": [{}, {}, {}], "tensors": [[1]]})
    s = data.store
    for g in range(3):
        names = sorted(p.name for p in (s.root / f"g{g}").iterdir())
        assert names == [f"{i:02x}" for i in range(256)], g
        assert all((s.root / f"g{g}" / n).stat().st_mode & 0o777 == 0o750 for n in names)
    assert not (s.root / "g3").exists()
    # Every file goes into one of them: the store makes none.
    h = header(key=key_of("lands"))
    before = {p for p in s.root.rglob("*") if p.is_dir()}
    assert s.write(h, payload(3))
    assert {p for p in s.root.rglob("*") if p.is_dir()} == before
    assert s.file_path(h.group, h.key).parent in before
    # A restart finds them: nothing made again. One removed (`gc` removes empty ones) is made again.
    again = FileStore.open(str(tmp_path), FP, options=opts)
    assert again.make_dirs(3) == 0
    (s.root / "g2" / "7f").rmdir()
    assert again.make_dirs(3) == 1 and (s.root / "g2" / "7f").is_dir()
    # A directory that cannot be made now is no start-up failure: its store makes it or fails alone.
    other = FileStore.open(str(tmp_path / "other"), FP, options=FsOptions(path=str(tmp_path / "other")))
    other.root.mkdir(parents=True)
    (other.root / "g0").write_bytes(b"not a directory")
    assert other.make_dirs(2) == 256, "group 1's are made, group 0's cannot be"
    assert (other.root / "g1" / "ff").is_dir()


# ================================================= attention-only tail entries in fsck and gc ==

def test_fsck_and_gc_take_attention_only_tail_entries_for_a_chain(tmp_path, capsys):
    """Format 3 (docs/format.md, Attention-only models): behind chunk 0, tail
    entries [256, 272), [272, 288), [288, 304) of one 16-token block each,
    each naming the one before as its parent. `fsck` verifies them clean and
    links them into a chain; gc's eviction order takes the chain's last entry
    first; a range that is neither a chunk nor inside one is corrupt."""
    from offload import cli
    from offload.cli.cache import scan
    from offload.cli.chains import chunks
    from offload.cli.gc import eviction_order

    store = FileStore.open(str(tmp_path), FP)
    store.write_layout({"chunk_size": 256, "groups": [{"spec": "FullAttentionSpec(...)"}], "tensors": {}})
    keys = [key_of(f"t{i}") for i in range(4)]
    ranges = [(0, 256, 16), (256, 272, 1), (272, 288, 1), (288, 304, 1)]
    for i, (k, (t0, t1, n)) in enumerate(zip(keys, ranges)):
        h = header(key=k, group=0, token_start=t0, token_end=t1, num_pages=n,
                   parent=keys[i - 1][:8] if i else bytes(8))
        assert store.write(h, payload(i, n * PAGE))
    assert cli.main(["fsck", str(tmp_path)]) == 0, capsys.readouterr().out
    [fp] = scan(tmp_path, verify_payloads=True).dirs
    assert [f.problem for f in fp.files if f.problem] == []
    linked = chunks(fp)
    assert all(c.complete and c.orphan is None for c in linked.values())
    by_key = {bytes.fromhex(c.key): c for c in linked.values()}
    assert [[bytes.fromhex(ch.key) for ch in by_key[k].children] for k in keys] == [[k] for k in keys[1:]] + [[]]
    order = [bytes.fromhex(c.key) for _, _, c in sorted(eviction_order(fp, by_mtime=True))]
    assert order == keys[::-1], "gc must evict a chain from its end"
    # Remove the middle entry: the one behind it is below a hole.
    store.file_path(0, keys[2]).unlink()
    [fp] = scan(tmp_path).dirs
    holes = {bytes.fromhex(c.key) for c in chunks(fp).values() if c.orphan}
    assert holes == {keys[3]}
    # A range across a chunk boundary is no entry of this format.
    bad = header(key=key_of("x"), group=0, token_start=240, token_end=272, num_pages=2, parent=keys[0][:8])
    assert store.write(bad, payload(9, 2 * PAGE))
    [fp] = scan(tmp_path).dirs
    assert [f.problem_kind for f in fp.files if f.key == key_of("x").hex()] == ["corrupt"]
