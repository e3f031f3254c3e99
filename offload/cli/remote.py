"""Read-only view of an LMCache tier's Redis remote, for `kvoffload stats`.

LMCache 0.5.6's RedisConnector keeps each of our objects as two Redis strings
(docs/lmcache.md, "Key mapping"): `<prefix>kv_bytes`, our framed chunk
(the `HEADER_LEN`-byte header, then the payload: a chunk file's bytes), and
`<prefix>metadata`, LMCache's `RemoteMetadata` record, where `<prefix>` is
`redis_key(object_name(fingerprint, group, key))`
= `kvoffload-k1@1@0@<sha256 hex>@uint8`. The prefix is a hash, so the
fingerprint, group and chunk come from each object's header (its first `HEADER_LEN`
bytes, one GETRANGE); nothing else of the payload is read.

LMCache's own connector API cannot enumerate a remote (`RedisConnector.list()`
is an unimplemented TODO in 0.5.6), so this reads Redis with redis-py, the
client LMCache itself uses. Nothing here writes. Reads do count as uses in
Redis's LRU/LFU unless the server has `CLIENT NO-TOUCH` (Redis 7.2+), which is
turned on where it exists; the report says which.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from offload.cli.cache import ChunkFile, FpDir
from offload.store.format import HEADER_LEN, FormatError, header_of

SCHEMES = ("redis", "rediss", "unix")  # what LMCache 0.5.6's redis adapter accepts
SCHEME_RE = re.compile(rb"^kvoffload-k(\d+)@")  # any key scheme of ours, `KEY_SCHEME` or another
BATCH = 500  # objects per pipelined round trip


class RemoteError(Exception):
    """The remote cannot be read; the message names the URL and the fix."""


def redact(url: str) -> str:
    """The URL without its password (operators paste reports into tickets)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


@dataclass
class RemoteObject:
    """One `<prefix>kv_bytes` value whose header does not verify: no fingerprint to file it under."""

    key: str
    size: int
    problem: str


@dataclass
class RemoteChunk(ChunkFile):
    """A chunk file's record for one object (`path` is its Redis key; mtime = atime = its last use)."""

    idle_s: float | None = None  # Redis's OBJECT IDLETIME; None under an LFU policy (not tracked)


@dataclass
class Remote:
    url: str  # redacted
    server: dict  # redis_version, memory, eviction policy, evicted_keys, no_touch
    dirs: list[FpDir]  # per fingerprint, as a cache directory's: a RemoteChunk per object
    unreadable: list[RemoteObject] = field(default_factory=list)
    metadata_only: int = 0  # LMCache metadata records whose bytes are gone (Redis evicted them)
    vanished: int = 0  # listed by SCAN, gone before they were read (evicted or replaced meanwhile)
    other_schemes: dict[str, int] = field(default_factory=dict)  # `kvoffload-k<N>` -> keys, N != KEY_SCHEME
    unrecognised_keys: int = 0  # under our prefix, neither `kv_bytes` nor `metadata`
    other_keys: int = 0  # keys in this Redis database that are not kvoffload's


def scan_remote(url: str, timeout_s: float, layout_dirs: list[Path] = ()) -> Remote:
    """List and classify every kvoffload object in the Redis at `url`.

    `layout_dirs` are file tiers' layout directories (offload/store/cachedir/paths.py): a fingerprint's
    layout.json there names the model and chunk size (the remote has no layout).
    Raises RemoteError if the server cannot be reached or answers with an error.
    """
    import redis

    from offload.store.lmcache_objects import MODEL_NAME, REDIS_SUFFIXES, remote_url_with_timeouts

    shown = redact(url)
    if urlsplit(url).scheme not in SCHEMES:
        raise RemoteError(f"{shown}: stats reads Redis remotes ({', '.join(s + '://' for s in SCHEMES)}), "
                          "the LMCache tier's remote; give a Redis URL with --lmcache-url")
    try:
        client = redis.Redis.from_url(remote_url_with_timeouts(url, timeout_s))
    except ValueError as e:
        raise RemoteError(f"{shown}: not a Redis URL ({e}); e.g. redis://127.0.0.1:6379") from None
    try:
        client.ping()
        server = _server_info(client)
        ours = f"{MODEL_NAME}@".encode()
        keys: set[bytes] = set(client.scan_iter(match=b"kvoffload-k*", count=1000))
        total = client.dbsize()
        rep = Remote(shown, server, [])
        blobs, metas = set(), set()
        for k in keys:
            m = SCHEME_RE.match(k)
            if m is None:
                continue
            if not k.startswith(ours):
                name = f"kvoffload-k{m.group(1).decode()}"
                rep.other_schemes[name] = rep.other_schemes.get(name, 0) + 1
            elif k.endswith(REDIS_SUFFIXES[0].encode()):
                blobs.add(k[:-len(REDIS_SUFFIXES[0])])
            elif k.endswith(REDIS_SUFFIXES[1].encode()):
                metas.add(k[:-len(REDIS_SUFFIXES[1])])
            else:
                rep.unrecognised_keys += 1
        counted = sum(bool(SCHEME_RE.match(k)) for k in keys)
        rep.other_keys = max(0, total - counted)
        rep.metadata_only = len(metas - blobs)
        by_fp: dict[bytes, FpDir] = {}
        order = sorted(blobs)
        for i in range(0, len(order), BATCH):
            _read_batch(client, order[i:i + BATCH], metas, rep, by_fp, server["no_touch"])
    except redis.exceptions.RedisError as e:
        waited = f" within {timeout_s:g} s (--timeout)" if isinstance(e, redis.exceptions.TimeoutError) else ""
        raise RemoteError(f"cannot read the LMCache remote {shown}{waited}: {type(e).__name__}: "
                          f"{str(e).rstrip('.')}; start that Redis server, or fix the URL (--lmcache-url, or "
                          "the lmcache tier's remote_url in --config)") from None
    finally:
        client.close()
    for fp in by_fp.values():
        _attach_layout(fp, layout_dirs)
    rep.dirs = sorted(by_fp.values(), key=lambda d: d.path.name)
    return rep


def _server_info(client) -> dict:
    import redis

    info = client.info()
    no_touch = True
    try:
        client.execute_command("CLIENT", "NO-TOUCH", "OFF")  # only asks whether the server has it
    except redis.exceptions.ResponseError:  # Redis < 7.2: every read refreshes the object in its LRU/LFU
        no_touch = False
    return {"redis_version": info.get("redis_version"), "used_memory": info.get("used_memory"),
            "maxmemory": info.get("maxmemory"), "maxmemory_policy": info.get("maxmemory_policy"),
            "evicted_keys": info.get("evicted_keys"), "no_touch": no_touch}


def _read_batch(client, bases: list[bytes], metas: set[bytes], rep: Remote, by_fp: dict[bytes, FpDir],
                no_touch: bool) -> None:
    import redis

    from offload.store.lmcache_objects import REDIS_SUFFIXES, object_name, redis_key, remote_metadata

    data, meta = (s.encode() for s in REDIS_SUFFIXES)
    pipe = client.pipeline(transaction=False)
    if no_touch:  # a per-connection flag, and a pipeline is one connection: set it for this batch
        pipe.execute_command("CLIENT", "NO-TOUCH", "ON")
    for b in bases:
        pipe.object("idletime", b + data)  # first: IDLETIME does not touch; the reads after it may
        pipe.strlen(b + data)
        pipe.getrange(b + data, 0, HEADER_LEN - 1)
        pipe.get(b + meta)
    res = pipe.execute(raise_on_error=False)[int(no_touch):]
    now = time.time()
    for j, b in enumerate(bases):
        idle, size, raw, md = res[4 * j:4 * j + 4]
        key = (b + data).decode()
        failed = next((r for r in (size, raw, md) if isinstance(r, redis.exceptions.ResponseError)), None)
        if failed is not None:  # e.g. WRONGTYPE: something else under our name
            rep.unreadable.append(RemoteObject(key, 0, f"Redis: {failed}"))
            continue
        if size == 0:
            rep.vanished += 1
            continue
        try:
            h = header_of(raw, size)
        except FormatError as e:
            rep.unreadable.append(RemoteObject(key, size, f"header: {e}"))
            continue
        problem = None
        if redis_key(object_name(bytes(h.fingerprint), h.group, bytes(h.key))).encode() != b:
            problem = "header names another object than the key it is stored under"
        elif (size_problem := h.size_problem(size)) is not None:
            problem = size_problem
        elif md is None:
            problem = ("no LMCache metadata record: LMCache cannot see it (a write in flight, "
                       "or Redis evicted the record)")
        elif md != remote_metadata(size):
            problem = f"LMCache metadata record does not describe these {size} bytes"
        idle_s = float(idle) if isinstance(idle, int) else None  # an error under LFU policies
        last_use = now - (idle_s or 0.0)
        fp = by_fp.setdefault(bytes(h.fingerprint), FpDir(Path(h.fingerprint.hex())))
        fp.files.append(RemoteChunk(Path(key), h.group, h.key.hex(), size, last_use, last_use, h, problem,
                                    idle_s=idle_s))


def _attach_layout(fp: FpDir, layout_dirs: list[Path]) -> None:
    """layout.json from a file tier of the same fingerprint, else the chunk size from the headers
    (the chains need it); `layout_problem` says which."""
    for d in layout_dirs:
        try:
            lay = json.loads((d / fp.path.name / "layout.json").read_text())
        except (OSError, ValueError):
            continue
        if isinstance(lay, dict):
            fp.layout = lay
            return
    sizes = {f.header.token_end - f.header.token_start for f in fp.files if f.problem is None}
    fp.layout = {"chunk_size": sizes.pop()} if len(sizes) == 1 else None
    fp.layout_problem = "no layout.json (the remote keeps none; a file tier of this fingerprint would have one)"
