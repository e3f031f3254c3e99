"""Tests for offload/keys.py: deterministic, chained, layout-rooted cache keys.

Expected values are computed here independently (hashlib + struct), never by
calling the code under test twice.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import struct
import subprocess
import sys

import numpy as np
import pytest

from offload import keys
from offload.keys import chunk_keys, fingerprint, rank_fingerprint, request_root
from offload.planner import GroupKind, GroupSpec

CHUNK = 16


def ref_chain(root: bytes, tokens: list[int], chunk_size: int) -> list[bytes]:
    """Independent reference: key(c) = sha256(key(c-1) || LE uint32 tokens of chunk c)."""
    out, prev = [], root
    for c in range(len(tokens) // chunk_size):
        part = tokens[c * chunk_size:(c + 1) * chunk_size]
        prev = hashlib.sha256(prev + struct.pack(f"<{len(part)}I", *part)).digest()
        out.append(prev)
    return out


def base_fields(**over) -> dict:
    """A fingerprint input shaped like offload.layout.fingerprint_fields."""
    d = {
        "model": "Qwen/Qwen3-Next-80B-A3B",
        "hf_config": "ab" * 32,
        "dtype": "torch.bfloat16",
        "cache_dtype": "auto",
        "platform": "cuda",
        "kv_cache_layout": "NHD",
        "groups": [
            {"spec": repr(GroupSpec(GroupKind.FULL_ATTENTION, 16, 4096, 12)), "layers": ["l0", "l4"]},
            {"spec": repr(GroupSpec(GroupKind.MAMBA, 16, 65536, 36)), "layers": ["l1", "l2", "l3"]},
        ],
        "tp_size": 2,
        "chunk_size": 256,
    }
    d.update(over)
    return d


def tokens(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    # Include values whose byte order matters and the uint32 extremes.
    return [rng.choice([0, 1, 255, 256, 65535, 2**31, 2**32 - 1, rng.randrange(2**32)]) for _ in range(n)]


# ------------------------------------------------------------------ process independence --

_CHILD = r"""
import sys
from offload.keys import chunk_keys, fingerprint, rank_fingerprint, request_root
fp = fingerprint({"model": "m", "groups": [{"b": 2, "a": 1}], "tp_size": 2, "chunk_size": 4})
fp = rank_fingerprint(fp, 1, 2)
root = request_root(fp, ["lora:x", "salt:y"])
toks = list(range(1000, 1000 + 4 * 5 + 3))
print(fp.hex())
print(root.hex())
print(",".join(k.hex() for k in chunk_keys(root, toks, 4)))
"""


def _in_process() -> list[str]:
    fp = fingerprint({"model": "m", "groups": [{"b": 2, "a": 1}], "tp_size": 2, "chunk_size": 4})
    fp = rank_fingerprint(fp, 1, 2)
    root = request_root(fp, ["lora:x", "salt:y"])
    toks = list(range(1000, 1000 + 4 * 5 + 3))
    return [fp.hex(), root.hex(), ",".join(k.hex() for k in chunk_keys(root, toks, 4))]


def test_keys_identical_across_processes_and_hash_seeds():
    procs = []
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        procs.append(subprocess.Popen([sys.executable, "-c", _CHILD], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        outs.append(out.split())
    expected = _in_process()
    assert len(expected[2].split(",")) == 5
    assert outs[0] == expected
    assert outs[1] == expected


# ------------------------------------------------------------------ known answers --

def test_chunk_keys_known_answer():
    root = hashlib.sha256(b"some root").digest()
    toks = tokens(7 * CHUNK + 5, seed=1)
    got = chunk_keys(root, toks, CHUNK)
    assert got == ref_chain(root, toks, CHUNK)
    assert len(got) == 7
    assert all(isinstance(k, bytes) and len(k) == 32 for k in got)


def test_chunk_keys_literal_known_answer():
    # Fully spelled out for one tiny chunk: tokens 1, 2 as little-endian uint32.
    root = bytes(32)
    expected = hashlib.sha256(bytes(32) + b"\x01\x00\x00\x00\x02\x00\x00\x00").digest()
    assert chunk_keys(root, [1, 2], 2) == [expected]


def test_chunk_keys_accepts_numpy_tokens():
    root = hashlib.sha256(b"r").digest()
    toks = tokens(3 * CHUNK, seed=2)
    assert chunk_keys(root, np.array(toks, dtype=np.int64), CHUNK) == ref_chain(root, toks, CHUNK)


def test_fingerprint_known_answer_includes_format_version():
    fields = base_fields()
    doc = json.dumps({"format_version": 3, **fields}, sort_keys=True, separators=(",", ":"))
    assert keys.FORMAT_VERSION == 3
    assert fingerprint(fields) == hashlib.sha256(doc.encode()).digest()


def test_fingerprint_changes_with_format_version(monkeypatch):
    before = fingerprint(base_fields())
    monkeypatch.setattr(keys, "FORMAT_VERSION", 2)
    assert fingerprint(base_fields()) != before


# ------------------------------------------------------------------ chaining --

def test_changing_a_token_in_chunk0_changes_every_key():
    root = hashlib.sha256(b"r").digest()
    toks = tokens(6 * CHUNK, seed=3)
    a = chunk_keys(root, toks, CHUNK)
    for pos in (0, CHUNK // 2, CHUNK - 1):
        t2 = list(toks)
        t2[pos] ^= 1
        b = chunk_keys(root, t2, CHUNK)
        assert len(b) == len(a) == 6
        assert all(x != y for x, y in zip(a, b))


def test_changing_a_token_in_chunk3_keeps_earlier_keys():
    root = hashlib.sha256(b"r").digest()
    toks = tokens(6 * CHUNK, seed=4)
    a = chunk_keys(root, toks, CHUNK)
    t2 = list(toks)
    t2[3 * CHUNK + 5] = (t2[3 * CHUNK + 5] + 1) % 2**32
    b = chunk_keys(root, t2, CHUNK)
    assert a[:3] == b[:3]
    assert all(x != y for x, y in zip(a[3:], b[3:]))


def test_high_token_bytes_matter():
    # A token differing only above the low 16 bits must change the key (no truncation).
    root = hashlib.sha256(b"r").digest()
    toks = [7] * CHUNK
    t2 = [7] * CHUNK
    t2[0] = 7 + (1 << 24)
    assert chunk_keys(root, toks, CHUNK) != chunk_keys(root, t2, CHUNK)


def test_same_tokens_different_position_in_chain_differ():
    # Identical chunks at different positions get different keys (the chain is a prefix hash).
    root = hashlib.sha256(b"r").digest()
    ks = chunk_keys(root, [5] * (3 * CHUNK), CHUNK)
    assert len(set(ks)) == 3


@pytest.mark.parametrize("split", [1, 2, 3, 5])
def test_resume_equals_all_at_once(split):
    root = hashlib.sha256(b"r").digest()
    toks = tokens(6 * CHUNK + 3, seed=5)
    whole = chunk_keys(root, toks, CHUNK)
    head = chunk_keys(root, toks, CHUNK, count=split)
    tail = chunk_keys(root, toks, CHUNK, start=split, parent=head[-1])
    assert head + tail == whole
    assert len(whole) == 6


def test_resume_in_steps_of_one():
    root = hashlib.sha256(b"r").digest()
    toks = tokens(5 * CHUNK, seed=6)
    ks: list[bytes] = []
    for c in range(5):
        ks += chunk_keys(root, toks, CHUNK, start=c, parent=ks[-1] if ks else None, count=1)
    assert ks == ref_chain(root, toks, CHUNK)


def test_resume_requires_parent():
    root = hashlib.sha256(b"r").digest()
    with pytest.raises(ValueError):
        chunk_keys(root, tokens(4 * CHUNK), CHUNK, start=2)


def test_wrong_parent_gives_different_keys():
    root = hashlib.sha256(b"r").digest()
    toks = tokens(4 * CHUNK, seed=7)
    whole = chunk_keys(root, toks, CHUNK)
    assert chunk_keys(root, toks, CHUNK, start=2, parent=whole[0]) != whole[2:]


def test_partial_last_chunk_has_no_key():
    root = hashlib.sha256(b"r").digest()
    assert chunk_keys(root, tokens(CHUNK - 1), CHUNK) == []
    assert chunk_keys(root, [], CHUNK) == []
    toks = tokens(3 * CHUNK + CHUNK - 1, seed=8)
    got = chunk_keys(root, toks, CHUNK)
    assert len(got) == 3
    assert got == ref_chain(root, toks[:3 * CHUNK], CHUNK)
    # Completing the partial chunk appends exactly one key and keeps the others.
    more = chunk_keys(root, [*toks, 42], CHUNK)
    assert more[:3] == got and len(more) == 4


def test_count_limits():
    root = hashlib.sha256(b"r").digest()
    toks = tokens(5 * CHUNK, seed=9)
    ref = ref_chain(root, toks, CHUNK)
    assert chunk_keys(root, toks, CHUNK, count=0) == []
    assert chunk_keys(root, toks, CHUNK, count=2) == ref[:2]
    assert chunk_keys(root, toks, CHUNK, count=100) == ref  # capped by full chunks
    assert chunk_keys(root, toks, CHUNK, start=1, parent=ref[0], count=3) == ref[1:4]
    assert chunk_keys(root, toks, CHUNK, start=5, parent=ref[4], count=3) == []  # past the end


def test_chunk_size_changes_keys():
    root = hashlib.sha256(b"r").digest()
    toks = tokens(4 * CHUNK, seed=10)
    a = chunk_keys(root, toks, CHUNK)
    b = chunk_keys(root, toks, 2 * CHUNK)
    assert b == ref_chain(root, toks, 2 * CHUNK)
    assert not set(a) & set(b)


# ------------------------------------------------------------------ fingerprint --

@pytest.mark.parametrize("change", [
    {"model": "Qwen/Qwen3-Next-80B-A3B-Instruct"},
    {"hf_config": "cd" * 32},
    {"dtype": "torch.float16"},
    {"cache_dtype": "fp8"},
    {"platform": "cpu"},
    {"kv_cache_layout": "HND"},
    {"tp_size": 4},
    {"chunk_size": 512},
    {"groups": [  # block size of group 0
        {"spec": repr(GroupSpec(GroupKind.FULL_ATTENTION, 32, 4096, 12)), "layers": ["l0", "l4"]},
        {"spec": repr(GroupSpec(GroupKind.MAMBA, 16, 65536, 36)), "layers": ["l1", "l2", "l3"]},
    ]},
    {"groups": [  # page bytes of group 1
        {"spec": repr(GroupSpec(GroupKind.FULL_ATTENTION, 16, 4096, 12)), "layers": ["l0", "l4"]},
        {"spec": repr(GroupSpec(GroupKind.MAMBA, 16, 65537, 36)), "layers": ["l1", "l2", "l3"]},
    ]},
    {"groups": [  # kind of group 0
        {"spec": repr(GroupSpec(GroupKind.SLIDING_WINDOW, 16, 4096, 12, window=128)), "layers": ["l0", "l4"]},
        {"spec": repr(GroupSpec(GroupKind.MAMBA, 16, 65536, 36)), "layers": ["l1", "l2", "l3"]},
    ]},
    {"groups": [  # layer assignment
        {"spec": repr(GroupSpec(GroupKind.FULL_ATTENTION, 16, 4096, 12)), "layers": ["l0", "l3"]},
        {"spec": repr(GroupSpec(GroupKind.MAMBA, 16, 65536, 36)), "layers": ["l1", "l2", "l4"]},
    ]},
    {"groups": [  # group order
        {"spec": repr(GroupSpec(GroupKind.MAMBA, 16, 65536, 36)), "layers": ["l1", "l2", "l3"]},
        {"spec": repr(GroupSpec(GroupKind.FULL_ATTENTION, 16, 4096, 12)), "layers": ["l0", "l4"]},
    ]},
    {"extra": None},
], ids=lambda c: next(iter(c)))
def test_fingerprint_changes_with_any_field(change):
    assert fingerprint(base_fields(**change)) != fingerprint(base_fields())


def test_fingerprint_is_32_bytes_and_stable():
    a, b = fingerprint(base_fields()), fingerprint(base_fields())
    assert isinstance(a, bytes) and len(a) == 32
    assert a == b


def test_fingerprint_ignores_dict_key_order():
    f = base_fields()
    rev = dict(reversed(list(f.items())))
    rev["groups"] = [dict(reversed(list(g.items()))) for g in f["groups"]]
    assert list(rev) != list(f)
    assert fingerprint(rev) == fingerprint(f)


def test_rank_fingerprint_changes_with_rank_and_size():
    base = fingerprint(base_fields())
    seen = {
        rank_fingerprint(base, r, s)
        for s in (1, 2, 4, 8) for r in range(s)
    }
    assert len(seen) == 1 + 2 + 4 + 8
    assert base not in seen
    assert rank_fingerprint(base, 1, 2) == rank_fingerprint(base, 1, 2)
    other = fingerprint(base_fields(model="other"))
    assert rank_fingerprint(other, 0, 2) != rank_fingerprint(base, 0, 2)
    assert len(rank_fingerprint(base, 0, 1)) == 32


# ------------------------------------------------------------------ request roots --

def test_request_root_same_inputs_same_root():
    fp = fingerprint(base_fields())
    assert request_root(fp) == request_root(fp, ())
    assert request_root(fp, ["lora:a", "salt:b"]) == request_root(fp, ("lora:a", "salt:b"))
    assert len(request_root(fp)) == 32


def test_request_root_differs_by_salt():
    fp = fingerprint(base_fields())
    salts = [
        (),
        ("",),
        ("", ""),
        ("lora:adapter-a",),
        ("lora:adapter-b",),
        ("salt:tenant-1",),
        ("salt:tenant-2",),
        ("lora:adapter-a", "salt:tenant-1"),
        ("salt:tenant-1", "lora:adapter-a"),  # order matters
        ("lora:adapter-asalt:tenant-1",),  # concatenation is not the pair
        ("lora:a\x00salt:b",),  # a separator inside a value is not two values
        ("lora:a", "salt:b"),
        ("lora:a\x00",),
        ("lora:a", ""),
        ("lora:\u00e9",),  # non-ASCII
        ("lora:e",),
    ]
    roots = [request_root(fp, s) for s in salts]
    assert len(set(roots)) == len(salts)


def test_request_root_differs_by_fingerprint():
    a = fingerprint(base_fields())
    b = fingerprint(base_fields(dtype="torch.float16"))
    assert request_root(a) != request_root(b)
    assert request_root(a, ["salt:x"]) != request_root(b, ["salt:x"])


def test_salt_changes_every_chunk_key():
    fp = fingerprint(base_fields())
    toks = tokens(4 * CHUNK, seed=11)
    a = chunk_keys(request_root(fp), toks, CHUNK)
    b = chunk_keys(request_root(fp, ["salt:t"]), toks, CHUNK)
    assert not set(a) & set(b)


def test_tail_key_chains_from_its_chunk_parent_and_never_equals_a_chunk_key():
    from offload.keys import TAIL_TAG, tail_key

    root = hashlib.sha256(b"r").digest()
    toks = tokens(2 * CHUNK, seed=9)
    chain = chunk_keys(root, toks, CHUNK)
    t = tail_key(chain[0], toks[CHUNK:CHUNK + 64])
    assert t == hashlib.sha256(chain[0] + TAIL_TAG + np.asarray(toks[CHUNK:CHUNK + 64], "<u4").tobytes()).digest()
    assert t not in chain and tail_key(chain[0], toks[CHUNK:2 * CHUNK]) != chain[1]  # a whole chunk's tokens too
    assert tail_key(root, toks[:64]) != tail_key(chain[0], toks[:64])  # the parent is in the key
    assert tail_key(chain[0], toks[CHUNK:CHUNK + 64]) == t  # deterministic: no process-local state
    with pytest.raises(ValueError):
        tail_key(chain[0], [])
