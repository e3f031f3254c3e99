"""Typed connector config, parsed from `kv_connector_extra_config`.

Every problem fails at start-up with the key, the value and what would be
valid, so an operator can fix a kv-transfer-config without reading our code.
"""

from __future__ import annotations

import os
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

    @property
    def tier_name(self) -> str:
        return self.name or self.store

    @model_validator(mode="after")
    def _tier_keys(self) -> OffloadConfig:
        if self.store == "fs" and self.path is None:
            raise ValueError("path: required for store 'fs' (an absolute cache directory, created if missing)")
        if self.store == "cpu" and self.cpu_bytes is None:
            raise ValueError("cpu_bytes: required for store 'cpu' (the host memory budget in bytes)")
        return self

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
        return os.path.normpath(v)


def _describe(err: dict[str, Any]) -> str:
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
        return OffloadConfig.model_validate(extra)
    except ValidationError as e:
        lines = [_describe(err) for err in e.errors()]
        raise ConfigError("invalid OffloadConnector config:\n  " + "\n  ".join(lines)) from None
