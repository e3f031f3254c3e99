"""Typed connector config, parsed from `kv_connector_extra_config`.

Every problem fails at start-up with the key, the value and what would be
valid, so an operator can fix a kv-transfer-config without reading our code.
"""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

EXTRA_CONFIG = "kv_connector_extra_config"


class ConfigError(ValueError):
    """A kv-transfer-config that cannot work; the message says how to fix it."""


class OffloadConfig(BaseModel):
    """Options of one OffloadConnector (one tier)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    store: Literal["fs", "cpu"] = Field(
        description="tier backend: 'fs' (files on a local or NFS directory) or 'cpu' (host memory)")
    path: str | None = Field(default=None, description="absolute cache directory, created if missing "
                             "(required for store 'fs')")
    cpu_bytes: int | None = Field(default=None, ge=1 << 20, le=1 << 44,
                                  description="host memory for store 'cpu', in bytes (required for it)")
    hybrid_chunk_size: int | None = Field(
        default=None, gt=0,
        description="tokens per chunk; a multiple of every KV cache group's block size "
        "(default: the smallest such multiple >= 256)",
    )
    fsync: bool = Field(default=False, description="fsync each file and its directory before it becomes visible")
    io_threads: int = Field(default=4, ge=1, le=64, description="file I/O threads per worker")
    max_pending_store_bytes: int = Field(
        default=1 << 30, ge=1 << 20,
        description="bytes of gathered pages waiting to be written; stores beyond it are dropped",
    )
    # Bounded: concurrent.futures.wait overflows (and shutdown crashes) on inf or beyond TIMEOUT_MAX.
    shutdown_timeout_s: float = Field(
        default=60.0, ge=0, le=threading.TIMEOUT_MAX, description="how long shutdown waits for pending stores"
    )
    name: str | None = Field(
        default=None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$",
        description="this tier's name in per-request results and logs (default: the store kind)")
    model_id: str | None = Field(
        default=None, min_length=1,
        description="identity of the model in cache keys (default: the served model path); "
        "set it when one model is served from different paths sharing a cache",
    )
    file_mode: str = Field(
        default="0640", pattern=r"^0?[0-7]{3}$",
        description="permissions of cache files, an octal string such as '0640' or '0660' (owner read+write "
        "required; never writable by others)",
    )
    dir_mode: str = Field(
        default="0750", pattern=r"^0?[0-7]{3}$",
        description="permissions of cache directories, an octal string such as '0750' or '0770' (owner rwx "
        "required; never writable by others)",
    )
    max_bytes: int | None = Field(
        default=None, ge=1 << 20, le=1 << 50,
        description="byte budget of the cache directory for store 'fs' (1 MiB to 1 PiB; default: no budget); "
        "beyond it the least recently used chunks are evicted, descendants first",
    )
    orphan_tmp_age_s: float = Field(
        default=3600.0, ge=60, le=7 * 86400,
        description="age after which a temporary file of any host is an orphan and removed (60 s to 7 days); "
        "this host's temporary files are removed at start-up as soon as their writer is gone",
    )

    @property
    def file_mode_bits(self) -> int:
        return int(self.file_mode, 8)

    @property
    def dir_mode_bits(self) -> int:
        return int(self.dir_mode, 8)

    @property
    def tier_name(self) -> str:
        return self.name or self.store

    @model_validator(mode="after")
    def _tier_keys(self) -> OffloadConfig:
        if self.store == "fs" and self.path is None:
            raise ValueError("path: required for store 'fs' (an absolute cache directory, created if missing)")
        if self.store == "cpu" and self.cpu_bytes is None:
            raise ValueError("cpu_bytes: required for store 'cpu' (the host memory budget in bytes)")
        if self.store == "cpu" and self.path is not None:
            raise ValueError("path: only for store 'fs'; remove it, or set \"store\": \"fs\"")
        if self.store == "fs" and self.cpu_bytes is not None:
            raise ValueError("cpu_bytes: only for store 'cpu'; remove it, or set \"store\": \"cpu\" "
                             "(the file tier's budget is max_bytes)")
        if self.store == "cpu" and self.max_bytes is not None:
            raise ValueError("max_bytes: only for store 'fs'; the host-memory budget is cpu_bytes")
        return self

    @field_validator("file_mode", "dir_mode")
    @classmethod
    def _mode(cls, v: str, info) -> str:
        bits = int(v, 8)
        if bits & 0o002:
            raise ValueError("must not be writable by others (anyone could plant or replace cache files); "
                             "use e.g. '0660'/'0770' to share with a group")
        need = 0o600 if info.field_name == "file_mode" else 0o700
        if bits & need != need:
            raise ValueError(f"the owner needs {'read+write' if need == 0o600 else 'rwx'} "
                             f"(at least {need:04o})")
        return f"{bits:04o}"

    @field_validator("path")
    @classmethod
    def _absolute(cls, v: str | None) -> str | None:
        if v is None:
            return v
        p = Path(v)
        if not p.is_absolute():
            raise ValueError("must be an absolute path, e.g. /var/cache/kvoffload")
        if ".." in p.parts:
            raise ValueError("must not contain '..'")
        if "\x00" in v:
            raise ValueError("must not contain NUL bytes")
        v = os.path.normpath(v)
        problem = not_a_directory(v)
        if problem:
            raise ValueError(problem)
        return v


def _kind(p: Path) -> str:
    st = p.stat()
    for test, name in ((stat.S_ISREG, "a regular file"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket")):
        if test(st.st_mode):
            return name
    return "not a directory"


def not_a_directory(path: str) -> str | None:
    """Why `path` cannot be the cache directory because it, or the nearest
    of its ancestors that exists, is not a directory; None if it can be."""
    p = Path(path)
    try:
        for q in (p, *p.parents):
            if q.exists():
                if q.is_dir():
                    return None
                if q == p:
                    return (f"exists and is {_kind(q)}, not a directory; choose a directory, or a path that "
                            "does not exist yet (it is created)")
                return (f"{q} is {_kind(q)}, so no directory can be created under it; choose a directory, or "
                        "a path that does not exist yet under one")
    except OSError:  # unreadable: the start-up check reports what it can
        return None
    return None


def _describe(err: dict[str, Any]) -> str:
    err = {**err, "msg": err["msg"].removeprefix("Value error, ")}
    if not err["loc"]:  # a rule across keys; its message starts with the key
        return f"{EXTRA_CONFIG}.{err['msg'].removeprefix('Value error, ')}"
    key = ".".join(str(p) for p in err["loc"])
    if err["type"] == "extra_forbidden":
        valid = ", ".join(OffloadConfig.model_fields)
        return f"{EXTRA_CONFIG}.{key}: unknown key; valid keys are: {valid}"
    field = OffloadConfig.model_fields.get(str(err["loc"][0])) if err["loc"] else None
    hint = f" ({field.description})" if field is not None and field.description else ""
    if err["type"] == "missing":
        return f"{EXTRA_CONFIG}.{key}: required{hint}"
    return f"{EXTRA_CONFIG}.{key}={err.get('input')!r}: {err['msg']}{hint}"


def parse_config(extra: dict[str, Any] | None) -> OffloadConfig:
    """Validate the extra config dict; raise ConfigError listing every problem."""
    if not isinstance(extra, dict):
        raise ConfigError(f"{EXTRA_CONFIG} must be a JSON object, got {type(extra).__name__}")
    try:
        cfg = OffloadConfig.model_validate(extra)
    except ValidationError as e:
        lines = [_describe(err) for err in e.errors()]
        raise ConfigError("invalid OffloadConnector config:\n  " + "\n  ".join(lines)) from None
    return cfg
