"""The deployment key (offload/store/auth.py) on real files and real LMCache
objects: what a MAC binds (header, identity, payload), what a reader does with
an entry no key of ours vouches for, rotation, key configuration errors, and
that the key shows up in no repr, error or tool output.

The MAC is checked against the documented constructions (docs/format.md) with
the `blake3` and `cryptography` packages directly, not through the code under test:
v2 (AES-256-GMAC under a one-entry key) signs, v1 (keyed BLAKE3) still verifies.
"""

from __future__ import annotations

import base64
import os
import pickle
import shutil
import struct
from pathlib import Path

import blake3
import pytest
import torch
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from offload import cli
from offload.store.auth import (
    GMAC_CONTEXT,
    GMAC_KEY_ID_CONTEXT,
    KEY_ID_CONTEXT,
    MAC_CONTEXT,
    AuthRef,
    KeyConfigError,
    Keyring,
    Unauthenticated,
    check_entry,
    frame,
    load_keyring,
)
from offload.store.base import ChunkMiss, MissReason, OptionError
from offload.store.cachedir.paths import LAYOUT_DIR
from offload.store.files import FileStore
from offload.store.format import HEADER_LEN, MAC_OFFSET, NO_KEY, ChunkHeader, FormatError
from offload.store.options import FsOptions
from test_format_store import FIELD_OFFSETS, FP, LAYOUT, crc32c_ref, header, key_of, payload

K1 = bytes(range(32, 80))  # 48 bytes
K2 = b"second deployment key, rotated in.." + bytes(range(13))
K3 = os.urandom(40)


def key_file(tmp_path: Path, name: str, secret: bytes, mode: int = 0o600) -> str:
    p = tmp_path / name
    p.write_bytes(secret)
    os.chmod(p, mode)
    return str(p)


def store(tmp_path: Path, current: bytes | None, *previous: bytes) -> FileStore:
    """A FileStore on tmp_path/cache with `current` (and `previous`) as key files (None: no key)."""
    auth = None
    if current is not None:
        keys = tmp_path / "keys"
        keys.mkdir(parents=True, exist_ok=True)
        files = [key_file(keys, f"k{i}-{s[:4].hex()}", s) for i, s in enumerate((current, *previous))]
        auth = AuthRef(key_file=files[0], previous_key_files=tuple(files[1:]))
    return FileStore.open(str(tmp_path / "cache"), FP, options=FsOptions(path=str(tmp_path / "cache"), auth=auth))


def with_layout(s: FileStore) -> FileStore:
    """A layout.json for the test groups (fsck checks files against it)."""
    (s.root / "layout.json").write_text('{"groups": [{}, {}]}')
    return s


def read(s: FileStore, h: ChunkHeader) -> torch.Tensor:
    out = torch.zeros(h.payload_len, dtype=torch.uint8)
    s.read_into(h, out)
    return out


def miss(s: FileStore, h: ChunkHeader) -> ChunkMiss:
    with pytest.raises(ChunkMiss) as e:
        read(s, h)
    return e.value


def quarantined(s: FileStore) -> list[Path]:
    q = s.root / "quarantine"
    return sorted(q.iterdir()) if q.is_dir() else []


def rewrite(path: Path, **fields) -> None:
    """Change header fields as a writer without the key can: header CRC recomputed; with
    `payload=`, the payload replaced and its CRC recomputed too."""
    raw = bytearray(path.read_bytes())
    new_payload = fields.pop("payload", None)
    if new_payload is not None:
        raw[HEADER_LEN:] = new_payload
        fields["payload_crc"] = crc32c_ref(bytes(new_payload))
    vals = dict(zip(FIELD_OFFSETS, LAYOUT.unpack(bytes(raw[:HEADER_LEN]))))
    vals.update(fields)
    body = LAYOUT.pack(*list(vals.values())[:-1], 0)[:-4]
    raw[:HEADER_LEN] = body + struct.pack("<I", crc32c_ref(body))
    path.write_bytes(bytes(raw))


# ---- the documented construction ----------------------------------------------------------


def gmac_field(secret: bytes, nonce: bytes, covered: bytes) -> bytes:
    """v2's MAC field, built from the documented construction alone."""
    gmac_key = blake3.blake3(secret, derive_key_context=GMAC_CONTEXT).digest()
    entry_key = blake3.blake3(nonce, key=gmac_key).digest()
    return nonce + AESGCM(entry_key).encrypt(bytes(12), b"", covered)  # no plaintext: the 16-byte tag alone


def test_mac_is_gmac_under_a_one_entry_key_over_payload_and_header_prefix_as_documented(tmp_path):
    s = store(tmp_path, K1)
    h, p = header(key=key_of("doc")), payload(1)
    assert s.write(h, p)
    raw = s.file_path(h.group, h.key).read_bytes()
    fields = dict(zip(FIELD_OFFSETS, LAYOUT.unpack(raw[:HEADER_LEN])))
    key_id = blake3.blake3(K1, derive_key_context=GMAC_KEY_ID_CONTEXT).digest(length=8)
    assert fields["key_id"] == key_id != NO_KEY
    assert MAC_OFFSET == FIELD_OFFSETS["mac"][0] == 156
    # The payload first, then the header bytes before the MAC (docs/format.md).
    nonce = fields["mac"][:16]
    assert fields["mac"] == gmac_field(K1, nonce, raw[HEADER_LEN:] + raw[:156])
    assert fields["payload_crc"] == crc32c_ref(raw[HEADER_LEN:]), "the CRC stays: damage is told from forgery"
    assert fields["header_crc"] == crc32c_ref(raw[:188])
    assert torch.equal(read(s, h), p)
    # Every entry gets its own nonce, so the same bytes signed twice carry different MACs.
    assert frame(h, p, s.keyring)[156:188] != frame(h, p, s.keyring)[156:188]


def test_entries_signed_with_v1_keyed_blake3_still_restore_and_a_forged_v1_mac_is_refused(tmp_path):
    s = store(tmp_path, K1)
    h, p = header(key=key_of("v1")), payload(4)
    assert s.write(h, p)
    path = s.file_path(h.group, h.key)
    raw = bytearray(path.read_bytes())
    # Re-sign the file as the version before GMAC did: v1 key id, keyed BLAKE3 over payload + header prefix.
    rewrite(path, key_id=blake3.blake3(K1, derive_key_context=KEY_ID_CONTEXT).digest(length=8), mac=bytes(32))
    raw = bytearray(path.read_bytes())
    mac_key = blake3.blake3(K1, derive_key_context=MAC_CONTEXT).digest()
    rewrite(path, mac=blake3.blake3(bytes(raw[HEADER_LEN:]) + bytes(raw[:156]), key=mac_key).digest())
    assert torch.equal(read(s, h), p), "a v1 entry of our key restores"
    # The same file with a MAC that is not keyed BLAKE3 under our key: a forgery, moved aside.
    rewrite(path, mac=blake3.blake3(bytes(raw[HEADER_LEN:]) + bytes(raw[:156]), key=bytes(32)).digest())
    assert miss(s, h).reason is MissReason.UNAUTHENTICATED
    assert len(quarantined(s)) == 1


def test_without_a_key_mac_fields_are_zero_and_keyless_readers_accept_signed_files(tmp_path):
    plain, signed = store(tmp_path / "a", None), store(tmp_path / "b", K1)
    h = header(key=key_of("plain"))
    plain.write(h, payload(2))
    fields = dict(zip(FIELD_OFFSETS, LAYOUT.unpack(plain.file_path(h.group, h.key).read_bytes()[:HEADER_LEN])))
    assert fields["key_id"] == NO_KEY and fields["mac"] == bytes(32)
    signed.write(h, payload(3))
    shutil.copy(signed.file_path(h.group, h.key), plain.file_path(h.group, h.key))
    assert torch.equal(read(plain, h), payload(3)), "without a key: CRC only, as before"


# ---- what the MAC binds -------------------------------------------------------------------


def test_planted_file_without_mac_is_a_miss_and_left_alone(tmp_path):
    s = store(tmp_path, K1)
    h = header(key=key_of("plant"))
    attacker = payload(66)
    # A writer without the key: valid header and CRC, its own payload, the right name.
    s.prepare_dir(s.file_path(h.group, h.key))
    s.file_path(h.group, h.key).write_bytes(frame(h, attacker, None)
                                            + bytes(attacker.tolist()))
    e = miss(s, h)
    assert e.reason is MissReason.UNAUTHENTICATED and "no MAC" in str(e)
    assert s.file_path(h.group, h.key).exists() and quarantined(s) == [], "not ours: left alone"


def test_forged_mac_under_our_key_id_with_recomputed_crc_is_quarantined(tmp_path):
    s = store(tmp_path, K1)
    h, p = header(key=key_of("flip")), payload(4)
    s.write(h, p)
    path = s.file_path(h.group, h.key)
    flipped = bytearray(path.read_bytes()[HEADER_LEN:])
    flipped[100] ^= 0x40
    rewrite(path, payload=flipped)  # CRC recomputed: only the MAC can tell
    e = miss(s, h)
    assert e.reason is MissReason.UNAUTHENTICATED and "MAC mismatch" in str(e)
    assert not path.exists() and len(quarantined(s)) == 1


def test_damage_with_a_stale_crc_is_corrupt_not_unauthenticated(tmp_path):
    s = store(tmp_path, K1)
    h = header(key=key_of("dmg"))
    s.write(h, payload(5))
    path = s.file_path(h.group, h.key)
    raw = bytearray(path.read_bytes())
    raw[HEADER_LEN + 7] ^= 1
    path.write_bytes(bytes(raw))
    assert miss(s, h).reason is MissReason.CORRUPT


def test_header_fields_outside_identity_are_bound_too(tmp_path):
    """`parent` is not an identity field; a changed parent with a valid header CRC fails the MAC."""
    s = store(tmp_path, K1)
    h = header(key=key_of("par"), parent=b"p" * 8)
    s.write(h, payload(6))
    rewrite(s.file_path(h.group, h.key), parent=b"q" * 8)
    assert miss(s, h).reason is MissReason.UNAUTHENTICATED


def test_two_valid_files_swapped_are_both_refused_and_quarantined(tmp_path):
    s = store(tmp_path, K1)
    a, b = header(key=key_of("swap-a")), header(key=key_of("swap-b"))
    s.write(a, payload(7))
    s.write(b, payload(8))
    pa, pb = s.file_path(a.group, a.key), s.file_path(b.group, b.key)
    tmp = pa.with_name("x")
    os.replace(pa, tmp)
    os.replace(pb, pa)
    os.replace(tmp, pb)
    for h in (a, b):
        e = miss(s, h)
        assert e.reason is MissReason.UNAUTHENTICATED and "valid MAC" in str(e) and "key" in str(e)
    assert len(quarantined(s)) == 2


@pytest.mark.parametrize("what", ["name", "group", "token_range"])
def test_valid_file_replayed_under_another_name_is_refused(tmp_path, what):
    s = store(tmp_path, K1)
    src = header(key=key_of("src"))
    s.write(src, payload(9))
    dst = {"name": header(key=key_of("dst")), "group": header(key=key_of("src"), group=2),
           "token_range": header(key=key_of("src"), token_start=512, token_end=768)}[what]
    if what == "token_range":  # same name: the replay is the stored file, asked for at another position
        e = miss(s, dst)
    else:
        target = s.file_path(dst.group, dst.key)
        s.prepare_dir(target)
        shutil.copy(s.file_path(src.group, src.key), target)
        e = miss(s, dst)
    assert e.reason is MissReason.UNAUTHENTICATED and "copied under another name" in str(e)
    assert what == "token_range" or torch.equal(read(store(tmp_path, K1), src), payload(9))


def test_wrong_key_is_a_miss_and_leaves_the_file(tmp_path):
    store(tmp_path, K1).write(header(key=key_of("wk")), payload(10))
    other = store(tmp_path, K3)
    e = miss(other, header(key=key_of("wk")))
    assert e.reason is MissReason.UNAUTHENTICATED and "not one of this deployment's keys" in str(e)
    assert other.file_path(1, key_of("wk")).exists() and quarantined(other) == []


def test_unknown_key_id_with_random_mac_is_left_alone(tmp_path):
    s = store(tmp_path, K1)
    h = header(key=key_of("uk"))
    s.write(h, payload(11))
    rewrite(s.file_path(h.group, h.key), key_id=os.urandom(8), mac=os.urandom(32))
    assert miss(s, h).reason is MissReason.UNAUTHENTICATED
    assert s.file_path(h.group, h.key).exists() and quarantined(s) == []


def test_rotation_previous_keys_read_current_key_writes(tmp_path):
    old = store(tmp_path, K1)
    h_old, h_new = header(key=key_of("old")), header(key=key_of("new"))
    old.write(h_old, payload(12))
    rotated = store(tmp_path, K2, K1)  # a restart with the new key, the old one for reads
    assert torch.equal(read(rotated, h_old), payload(12)), "what the old key wrote still restores"
    rotated.write(h_new, payload(13))
    raw = rotated.file_path(h_new.group, h_new.key).read_bytes()
    assert raw[124:132] == blake3.blake3(K2, derive_key_context=GMAC_KEY_ID_CONTEXT).digest(length=8)
    assert torch.equal(read(rotated, h_new), payload(13))
    # After the old key is retired, its files are another key's: misses, left alone.
    retired = store(tmp_path, K2)
    assert miss(retired, h_old).reason is MissReason.UNAUTHENTICATED
    assert torch.equal(read(retired, h_new), payload(13))
    assert quarantined(retired) == []
    # A reader that only knows the old key cannot read what the new key wrote.
    assert miss(store(tmp_path, K1), h_new).reason is MissReason.UNAUTHENTICATED


def test_check_entry_order_crc_before_mac_and_identity_after(tmp_path):
    ring = Keyring(K1)
    h, p = header(key=key_of("ord")), payload(14)
    raw = frame(h, p, ring)
    assert ChunkHeader.unpack(raw).payload_crc == crc32c_ref(bytes(p.tolist()))
    assert check_entry(raw, crc32c_ref(bytes(p.tolist())), h, p, ring).key_id == ring.current.key_id
    # Damage: the MAC fails and the CRC tells it is an accident.
    damaged = p.clone()
    damaged[3] ^= 1
    with pytest.raises(FormatError, match="checksum"):
        check_entry(raw, None, h, damaged, ring)
    assert check_entry(raw, None, h, p, ring) == ChunkHeader.unpack(raw), "no CRC given: a valid MAC suffices"
    with pytest.raises(Unauthenticated) as e:
        check_entry(raw, crc32c_ref(bytes(p.tolist())), header(key=key_of("other")), p, ring)
    assert e.value.quarantine
    with pytest.raises(Unauthenticated) as e:
        check_entry(raw, crc32c_ref(bytes(p.tolist())), h, p, Keyring(K2))
    assert not e.value.quarantine


# ---- key configuration errors ---------------------------------------------------------------


def forms(secret: bytes) -> list[bytes]:
    return [secret, secret.hex().encode(), base64.b64encode(secret), base64.b64encode(secret).rstrip(b"=")]


def assert_no_key(text: str, *secrets: bytes) -> None:
    for s in secrets:
        for f in forms(s):
            assert f.decode("latin-1") not in text


@pytest.mark.parametrize("case", ["short_file", "loose_group", "loose_other", "missing_file", "missing_env",
                                  "short_env", "short_previous", "loose_previous", "directory"])
def test_key_config_errors_name_the_field_never_the_key(tmp_path, monkeypatch, case):
    good = key_file(tmp_path, "good", K1)
    short = b"too short a key, 31 bytes long!"
    assert len(short) == 31
    ref, field = {
        "short_file": (lambda: AuthRef(key_file=key_file(tmp_path, "s", short)), "auth.key_file"),
        "loose_group": (lambda: AuthRef(key_file=key_file(tmp_path, "g", K2, 0o640)), "auth.key_file"),
        "loose_other": (lambda: AuthRef(key_file=key_file(tmp_path, "o", K2, 0o604)), "auth.key_file"),
        "missing_file": (lambda: AuthRef(key_file=str(tmp_path / "nope")), "auth.key_file"),
        "missing_env": (lambda: AuthRef(key_env="KVOFFLOAD_TEST_NO_SUCH_KEY"), "auth.key_env"),
        "short_env": (lambda: AuthRef(key_env="KVOFFLOAD_TEST_SHORT_KEY"), "auth.key_env"),
        "short_previous": (lambda: AuthRef(key_file=good, previous_key_files=(key_file(tmp_path, "p", short),)),
                           "auth.previous_key_files[0]"),
        "loose_previous": (lambda: AuthRef(key_file=good, previous_key_files=(key_file(tmp_path, "lp", K2, 0o644),)),
                           "auth.previous_key_files[0]"),
        "directory": (lambda: AuthRef(key_file=str(tmp_path)), "auth.key_file"),
    }[case]
    monkeypatch.setenv("KVOFFLOAD_TEST_SHORT_KEY", short.decode())
    monkeypatch.delenv("KVOFFLOAD_TEST_NO_SUCH_KEY", raising=False)
    with pytest.raises(KeyConfigError) as e:
        load_keyring(ref())
    msg = str(e.value)
    assert msg.startswith(field), msg
    if "loose" in case:
        assert "chmod 600" in msg and "group or others" in msg
    if "short" in case:
        assert "at least 32" in msg
    assert_no_key(msg, K1, K2, short)
    # Through the tier's start-up check: an OptionError, the same message.
    with pytest.raises(OptionError) as e2:
        FileStore.open(str(tmp_path / "c"), FP, options=FsOptions(path=str(tmp_path / "c"), auth=ref()))
    assert str(e2.value) == msg


def test_connector_start_up_refuses_a_loose_key_file_naming_the_config_key(vllm_setup, tmp_path):
    from conftest import fs_kv_config, start_connector
    from offload.config import ConfigError

    loose = key_file(tmp_path, "loose", K1, 0o640)
    with pytest.raises(ConfigError) as e:
        start_connector(vllm_setup, fs_kv_config(tmp_path / "cache", auth={"key_file": loose}))
    msg = str(e.value)
    assert f"kv_connector_extra_config.auth.key_file={loose!r}" in msg and "chmod 600" in msg
    assert_no_key(msg, K1)


def test_the_key_is_in_no_repr_pickle_or_output(tmp_path, capsys):
    s = store(tmp_path, K1, K2)
    h = header(key=key_of("repr"))
    s.write(h, payload(15))
    with_layout(s)
    ring = s.keyring
    assert ring is not None
    texts = [repr(ring), str(ring), repr(ring.current), repr(s), repr(FsOptions(path="/x", auth=AuthRef("/k"))),
             repr(ring.__dict__ if hasattr(ring, "__dict__") else None)]
    for obj in (ring, ring.current):
        with pytest.raises(TypeError):
            pickle.dumps(obj)
    derived = [blake3.blake3(k, derive_key_context=c).digest() for k in (K1, K2) for c in (MAC_CONTEXT, GMAC_CONTEXT)]
    for t in texts:
        assert_no_key(t, K1, K2, *derived)
    # fsck's output with the key.
    rc = cli.main(["fsck", str(tmp_path / "cache"), "--key-file", str(next((tmp_path / "keys").iterdir()))])
    out = capsys.readouterr()
    assert rc in (0, 1) and "MACs checked with 1 key" in out.out, out.out  # (a lone chunk 1: a chain hole)
    assert_no_key(out.out + out.err, K1, K2, *derived)


# ---- fsck -----------------------------------------------------------------------------------


def test_fsck_reports_mac_failures_with_the_key_and_says_when_it_did_not_check(tmp_path, capsys):
    s = store(tmp_path, K1)
    # Chunk 0 each (no parent), so that no chain hole is reported.
    good, forged, copied, plain = (header(key=key_of(n), token_start=0, token_end=256)
                                   for n in ("good", "forged", "copied", "plain"))
    for i, h in enumerate((good, forged, copied)):
        s.write(h, payload(20 + i))
    flipped = bytearray(s.file_path(forged.group, forged.key).read_bytes()[HEADER_LEN:])
    flipped[0] ^= 1
    rewrite(s.file_path(forged.group, forged.key), payload=flipped)
    shutil.copy(s.file_path(good.group, good.key), s.file_path(copied.group, copied.key))
    store(tmp_path, None).write(plain, payload(30))  # written without a key
    with_layout(s)
    kf = str(next((tmp_path / "keys").iterdir()))

    rc = cli.main(["fsck", str(tmp_path / "cache")])
    out = capsys.readouterr().out
    # Without a key: the copy is damage (its identity), the forgery and the keyless file look fine.
    assert rc == 1 and "MACs not checked" in out, out
    assert "1 corrupt, 0 unauthenticated, 0 foreign-key" in out, out

    rc = cli.main(["fsck", str(tmp_path / "cache"), "--key-file", kf])
    out = capsys.readouterr().out
    assert rc == 1
    assert "1 unauthenticated" not in out  # forged and copied: two
    assert "2 unauthenticated" in out and "1 foreign-key" in out and "0 corrupt" in out, out
    lines = {ln.split()[0]: ln for ln in out.splitlines() if ln.startswith(("unauthenticated", "foreign-key"))}
    assert set(lines) == {"unauthenticated", "foreign-key"}

    cfg = tmp_path / "kv.json"
    cfg.write_text(f'{{"kv_connector": "OffloadConnector", "kv_connector_extra_config": '
                   f'{{"store": "fs", "path": "{tmp_path / "cache"}", "auth": {{"key_file": "{kf}"}}}}}}')
    rc = cli.main(["fsck", str(tmp_path / "cache"), "--config", str(cfg), "--repair"])
    out = capsys.readouterr().out
    assert rc == 1, out  # the foreign-key file is left alone
    assert out.count("-> quarantined") == 2 and "-> left alone" in out
    assert not s.file_path(forged.group, forged.key).exists() and s.file_path(plain.group, plain.key).exists()
    assert torch.equal(read(s, good), payload(20))


def test_fsck_key_errors_exit_2_without_the_key(tmp_path, capsys):
    store(tmp_path, None).write(header(), payload(0))
    loose = key_file(tmp_path, "loose", K1, 0o644)
    assert cli.main(["fsck", str(tmp_path / "cache"), "--key-file", loose]) == 2
    err = capsys.readouterr().err
    assert "--key-file[0]" in err and "chmod 600" in err
    assert_no_key(err, K1)


# ---- LMCache objects --------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:.*LoggingHandler.*:DeprecationWarning")
def test_lmcache_objects_carry_the_same_mac(tmp_path):
    from offload.store.base import Placement
    from offload.store.buffers import BufferPool
    from offload.store.cachedir.owners import CacheDirs
    from offload.store.lmcache import LMCacheData, LMCacheOptions, open_objects
    from offload.store.lmcache_objects import lmcache_key, object_name
    from test_lmcache_tier import pooled

    kf1, kf2 = key_file(tmp_path, "k1", K1), key_file(tmp_path, "k2", K2)
    opts = LMCacheOptions(local_cpu_bytes=8 << 20, auth=AuthRef(kf1))
    dirs = CacheDirs()
    d1 = LMCacheData(open_objects(dirs, opts), opts, load_keyring(AuthRef(kf1)), dirs)
    d2 = LMCacheData(d1.objects, opts, load_keyring(AuthRef(kf2)))  # same objects, another deployment's key
    rot = LMCacheData(d1.objects, opts, load_keyring(AuthRef(kf2, previous_key_files=(kf1,))))
    try:
        a, b = header(key=key_of("lm-a")), header(key=key_of("lm-b"))
        assert d1.put(a, pooled(payload(40)), Placement()) and d1.put(b, pooled(payload(41)), Placement())
        got = d1.get(a, Placement(), BufferPool())
        assert torch.equal(got.payload, payload(40))
        got.release()
        got = rot.get(a, Placement(), BufferPool())  # rotation: the previous key reads
        assert torch.equal(got.payload, payload(40))
        got.release()
        with pytest.raises(ChunkMiss) as e:
            d2.get(a, Placement(), BufferPool())
        assert e.value.reason is MissReason.UNAUTHENTICATED
        # Swap the two objects' bytes in LMCache's pool: both valid MACs, wrong names.
        n = HEADER_LEN + a.payload_len
        fa, fb = torch.empty(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8)
        objs = d1.objects
        na, nb = object_name(FP, a.group, a.key), object_name(FP, b.group, b.key)
        assert objs.get_into(na, fa) and objs.get_into(nb, fb)
        for name, src in ((na, fb), (nb, fa)):
            objs._local.remove(lmcache_key(name))
            assert objs.put(name, src)
        for h in (a, b):
            with pytest.raises(ChunkMiss) as e:
                d1.get(h, Placement(), BufferPool())
            assert e.value.reason is MissReason.UNAUTHENTICATED and "copied under another name" in str(e.value)
    finally:
        d1.close()


# ---- without a key: the start-up warning's findings ----------------------------------------------


def test_without_a_key_group_writable_dirs_and_other_writers_are_found(tmp_path):
    from offload.store.cachedir.hygiene import HOST_TAG
    from offload.store.dir_checks import unauthenticated_risks

    path = tmp_path / "cache"
    s = store(tmp_path, None)
    s.write(header(key=key_of("w")), payload(0))  # our own ledger log
    os.chmod(path, 0o750)
    os.chmod(path / LAYOUT_DIR, 0o750)
    assert unauthenticated_risks(str(path)) == [], "only our own writes, owner-and-group-read directories"
    os.chmod(path / LAYOUT_DIR, 0o770)
    risks = unauthenticated_risks(str(path))
    assert len(risks) == 1 and "writable by its group" in risks[0]
    os.chmod(path / LAYOUT_DIR, 0o750)
    other = "0123abcd" if HOST_TAG != "0123abcd" else "fedc4321"
    (path / LAYOUT_DIR / "ledger-v1" / f"{other}-4242-00000000.log").write_text("")
    risks = unauthenticated_risks(str(path))
    assert len(risks) == 1 and "1 other host" in risks[0]


def test_reads_without_crc_give_the_same_bytes(tmp_path):
    """A keyed load reads without the fused CRC (the MAC is checked instead): same bytes, CRC 0."""
    from offload import copier
    from offload.store.buffers import BufferPool

    s = store(tmp_path, None)
    h, p = header(key=key_of("nocrc")), payload(50)
    s.write(h, p)
    path = s.file_path(h.group, h.key)
    out = torch.zeros(h.payload_len, dtype=torch.uint8)
    raw, crc = copier.read_file(path, HEADER_LEN, out, False)
    assert crc == 0 and torch.equal(out, p) and raw == path.read_bytes()[:HEADER_LEN]
    assert copier.read_file(path, HEADER_LEN, out)[1] == crc32c_ref(bytes(p.tolist()))
    buf = BufferPool().get(HEADER_LEN + h.payload_len)
    raw, crc, _ = copier.read_file_direct(path, HEADER_LEN, buf, h.payload_len, False)
    assert crc == 0 and torch.equal(buf[HEADER_LEN:HEADER_LEN + h.payload_len], p)



@pytest.mark.parametrize("auth,store_keys,want", [
    ({"key_file": "relative/key"}, {}, "auth.key_file='relative/key': must be an absolute path"),
    ({"key_file": "/k", "key_env": "K"}, {}, "give exactly one of key_file"),
    ({}, {}, "give exactly one of key_file"),
    ({"key_env": "1BAD"}, {}, "auth.key_env='1BAD'"),
    ({"key_env": "K", "previous_key_envs": ["no-dash"]}, {}, "auth.previous_key_envs"),
    ({"key_env": "K", "secret": "x"}, {}, "auth.secret: unknown key; valid keys are: key_file, key_env"),
    ({"key_env": "K"}, {"store": "cpu", "cpu_bytes": 1 << 20}, "auth: not for store 'cpu'"),
])
def test_auth_config_errors_name_the_key(auth, store_keys, want):
    from offload.config import ConfigError, parse_config

    cfg = {"store": "fs", "path": "/tmp/kvoffload-auth-test", **store_keys, "auth": auth}
    if store_keys:
        cfg.pop("path")
    with pytest.raises(ConfigError) as e:
        parse_config(cfg)
    assert want in str(e.value) and "kv_connector_extra_config.auth" in str(e.value), str(e.value)


def test_auth_config_is_a_reference_in_the_tier_options():
    from offload.config import parse_config

    t = parse_config({"tiers": [{"store": "lmcache", "local_cpu_bytes": 1 << 20,
                                 "auth": {"key_env": "K", "previous_key_files": ["/old"]}}]}).tiers[0]
    assert t.options().auth == AuthRef(key_env="K", previous_key_files=("/old",))
    hash(t.options())  # LMCache's storage engines are shared per options: hashable
