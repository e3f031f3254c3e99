"""Deterministic cache keys: chained chunk hashes rooted in a layout fingerprint.

SHA-256 over explicit little-endian bytes, never Python's `hash()`, so keys are
identical across processes, hosts and PYTHONHASHSEED values. Anything that
changes the bytes of a page (model, dtype, group specs, KV layout, TP rank and
size, chunk size, format version) goes into the fingerprint, so a different
model or layout can never match.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any, NewType

import numpy as np

FORMAT_VERSION = 3

Fingerprint = NewType("Fingerprint", bytes)  # 32 bytes
ChunkKey = NewType("ChunkKey", bytes)  # 32 bytes


def fingerprint(fields: dict[str, Any]) -> Fingerprint:
    """SHA-256 of the canonical JSON of `fields` plus the format version."""
    doc = json.dumps({"format_version": FORMAT_VERSION, **fields}, sort_keys=True, separators=(",", ":"))
    return Fingerprint(hashlib.sha256(doc.encode()).digest())


def rank_fingerprint(base: Fingerprint, tp_rank: int, tp_size: int) -> Fingerprint:
    """Each tensor-parallel rank holds different heads: its own files."""
    return fingerprint({"base": base.hex(), "tp_rank": tp_rank, "tp_size": tp_size})


def request_root(base: Fingerprint, salt: Sequence[str] = ()) -> bytes:
    """Root of a request's chain: the fingerprint, plus anything else that
    changes KV for the same tokens (LoRA adapter, cache salt).

    Injective in `salt`: each item is length-prefixed, so different sequences
    never hash the same bytes (a separator byte would let ("a\\x00b",) and
    ("a", "b") share a root, hence KV).
    """
    h = hashlib.sha256(base)
    for s in salt:
        b = s.encode()
        h.update(len(b).to_bytes(8, "little") + b)
    return h.digest()


def chunk_keys(root: bytes, token_ids: Sequence[int], chunk_size: int, start: int = 0,
               parent: bytes | None = None, count: int | None = None) -> list[ChunkKey]:
    """Keys of chunks `start, start+1, ...` of `token_ids`.

    key(c) = sha256(key(c-1) || tokens of chunk c as little-endian uint32), with
    key(-1) = root. `parent` is key(start-1) when resuming a chain.
    """
    n_full = len(token_ids) // chunk_size
    end = n_full if count is None else min(n_full, start + count)
    prev = root if start == 0 else parent
    if prev is None:
        raise ValueError("parent key required when start > 0")
    toks = np.asarray(token_ids[start * chunk_size: end * chunk_size], dtype="<u4")
    out: list[ChunkKey] = []
    for i in range(end - start):
        prev = hashlib.sha256(prev + toks[i * chunk_size:(i + 1) * chunk_size].tobytes()).digest()
        out.append(ChunkKey(prev))
    return out


# Prefixed to a partial tail's tokens. 14 bytes: a chunk hashes 32 + 4k bytes
# and a tail 32 + 14 + 4k, so no tail message has a chunk message's length,
# and no tail key can equal a chunk key's preimage.
TAIL_TAG = b"kvoffload-tail"


def tail_key(parent: bytes, tail_tokens: Sequence[int]) -> ChunkKey:
    """Key of a partial tail: the prefix up to a boundary inside a chunk.

    tail_key = sha256(key(c-1) || TAIL_TAG || tokens[c*C:boundary] as
    little-endian uint32), with key(-1) = the request root; `parent` is that
    key. No key is derived from a tail key: on an attention-only model the
    tail entries of one chunk link to each other only through their headers'
    `parent` field (docs/format.md, "Attention-only models").
    """
    if not tail_tokens:
        raise ValueError("a partial tail holds at least one token")
    return ChunkKey(hashlib.sha256(parent + TAIL_TAG + np.asarray(tail_tokens, dtype="<u4").tobytes()).digest())
