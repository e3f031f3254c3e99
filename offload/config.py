"""Typed connector config, parsed from `kv_connector_extra_config`.

Every problem fails at start-up with the key, the value and what would be
valid, so an operator can fix a kv-transfer-config without reading our code.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from offload.store.hygiene import not_a_directory
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

if TYPE_CHECKING:
    from offload.store.cpu import CpuOptions
    from offload.store.fs import FsOptions
    from offload.store.lmcache import LMCacheOptions

EXTRA_CONFIG = "kv_connector_extra_config"


class ConfigError(ValueError):
    """A kv-transfer-config that cannot work; the message says how to fix it."""


_ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"


class AuthConfig(BaseModel):
    """The deployment key of a tier, by reference (never the key itself):
    entries are signed with the current key and restored only when a key of
    this deployment's verifies them (docs/reliability.md, threat model)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    key_file: str | None = Field(
        default=None, description="absolute path of a file holding the current key (at least 32 bytes; mode 0600, "
        "owner only); new entries are signed with it")
    key_env: str | None = Field(
        default=None, pattern=_ENV_NAME,
        description="or: the name of an environment variable holding the current key (at least 32 bytes)")
    previous_key_files: list[str] = Field(
        default_factory=list, max_length=8,
        description="files of earlier keys, for reads only (rotation: entries they signed still restore)")
    previous_key_envs: list[str] = Field(
        default_factory=list, max_length=8,
        description="environment variables of earlier keys, for reads only")

    @field_validator("key_file", "previous_key_files")
    @classmethod
    def _absolute(cls, v):
        for p in ([v] if isinstance(v, str) else v or []):
            if not Path(p).is_absolute():
                raise ValueError("must be an absolute path to the key file, e.g. /etc/kvoffload/key")
        return v

    @field_validator("previous_key_envs")
    @classmethod
    def _env_names(cls, v: list[str]) -> list[str]:
        import re

        for name in v:
            if not re.match(_ENV_NAME, name):
                raise ValueError(f"{name!r} is not an environment variable name")
        return v

    @model_validator(mode="after")
    def _one_current(self) -> AuthConfig:
        if (self.key_file is None) == (self.key_env is None):
            raise ValueError("key_file: give exactly one of key_file (a file holding the key) or key_env (the name "
                             "of an environment variable holding it)")
        return self

    def ref(self):
        from offload.store.auth import AuthRef

        return AuthRef(self.key_file, self.key_env, tuple(self.previous_key_files), tuple(self.previous_key_envs))


class TierConfig(BaseModel):
    """Options of one tier of the stack; `options()` gives the store's own dataclass."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    store: Literal["fs", "cpu", "lmcache"] = Field(
        description="tier backend: 'fs' (files on a local or NFS directory), 'cpu' (host memory) or "
        "'lmcache' (LMCache's storage engine: a local CPU pool, optionally a remote)")
    path: str | None = Field(default=None, description="absolute cache directory, created if missing "
                             "(required for store 'fs')")
    cpu_bytes: int | None = Field(default=None, ge=1 << 20, le=1 << 44,
                                  description="host memory for store 'cpu', in bytes (required for it)")
    local_cpu_bytes: int | None = Field(
        default=None, ge=1 << 20, le=1 << 44,
        description="LMCache's local CPU pool for store 'lmcache', in bytes (required for it; LMCache's "
        "max_local_cpu_size)")
    remote_url: str | None = Field(
        default=None, pattern=r"^[a-z][a-z0-9+.-]*://\S+$",
        description="LMCache remote for store 'lmcache', e.g. 'redis://127.0.0.1:6379' (LMCache's remote_url; "
        "default: none, the local pool only)")
    remote_timeout_s: float = Field(
        default=2.0, gt=0, le=60,
        description="bound on one LMCache remote operation for store 'lmcache' (seconds, up to 60); "
        "beyond it the lookup or load is a miss")
    fsync: bool = Field(default=False, description="fsync each file and its directory before it becomes visible")
    direct_reads: bool = Field(
        default=False,
        description="store 'fs': read files with O_DIRECT (no page-cache copy: less CPU per load, but no page "
        "cache either); a filesystem that refuses O_DIRECT gets buffered reads")
    name: str | None = Field(
        default=None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$",
        description="this tier's name in per-request results and logs (default: the store kind)")
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
    auth: AuthConfig | None = Field(
        default=None,
        description="stores 'fs' and 'lmcache': the deployment key, by reference: {\"key_file\": \"/etc/kvoffload/key\"} "
        "or {\"key_env\": \"KVOFFLOAD_KEY\"}, plus previous_key_files / previous_key_envs for rotation; every "
        "entry then carries a MAC and only entries a key of this deployment signed are restored (default: none, "
        "CRC only)")
    reconcile_interval_s: float = Field(
        default=21600.0, ge=60, le=30 * 86400,
        description="store 'fs': how often one instance walks the whole cache directory to correct the "
        "ledger's usage accounting (60 s to 30 days; default 6 h); between walks usage comes from the ledger",
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

    def options(self) -> CpuOptions | FsOptions | LMCacheOptions:
        """The store's own options (stores never see this config)."""
        # Imported here: `kvoffload plan` and `check-config` import this module without torch.
        from offload.store.cpu import CpuOptions
        from offload.store.fs import FsOptions
        from offload.store.lmcache import LMCacheOptions

        if self.store == "lmcache":
            assert self.local_cpu_bytes is not None
            return LMCacheOptions(local_cpu_bytes=self.local_cpu_bytes, remote_url=self.remote_url,
                                  timeout_s=self.remote_timeout_s, auth=self.auth.ref() if self.auth else None)
        if self.store == "cpu":
            assert self.cpu_bytes is not None
            return CpuOptions(cpu_bytes=self.cpu_bytes)
        assert self.path is not None
        return FsOptions(path=self.path, fsync=self.fsync, max_bytes=self.max_bytes, file_mode=self.file_mode_bits,
                         dir_mode=self.dir_mode_bits, orphan_tmp_age_s=self.orphan_tmp_age_s,
                         reconcile_interval_s=self.reconcile_interval_s,
                         direct_reads=self.direct_reads, auth=self.auth.ref() if self.auth else None)

    @model_validator(mode="after")
    def _tier_keys(self) -> TierConfig:
        if self.store == "fs" and self.path is None:
            raise ValueError("path: required for store 'fs' (an absolute cache directory, created if missing)")
        if self.store == "cpu" and self.cpu_bytes is None:
            raise ValueError("cpu_bytes: required for store 'cpu' (the host memory budget in bytes)")
        if self.store == "cpu" and self.path is not None:
            raise ValueError("path: only for store 'fs'; remove it, or set \"store\": \"fs\"")
        if self.store == "fs" and self.cpu_bytes is not None:
            raise ValueError("cpu_bytes: only for store 'cpu'; remove it, or set \"store\": \"cpu\" "
                             "(the file tier's budget is max_bytes)")
        if self.store == "cpu" and self.auth is not None:
            raise ValueError("auth: not for store 'cpu': host memory is this process's own and needs no MAC; "
                             "remove it")
        if self.store == "cpu" and self.max_bytes is not None:
            raise ValueError("max_bytes: only for store 'fs'; the host-memory budget is cpu_bytes")
        if self.store != "fs" and "direct_reads" in self.model_fields_set:
            raise ValueError(f"direct_reads: only for store 'fs' (files); store '{self.store}' reads no files, "
                             "remove it")
        if self.store == "lmcache":
            if self.local_cpu_bytes is None:
                raise ValueError("local_cpu_bytes: required for store 'lmcache' (LMCache's local CPU pool in "
                                 "bytes; its remote backend buffers through it too)")
            for key, hint in (("path", "files are store 'fs': add a tier"), ("cpu_bytes", "its pool is local_cpu_bytes"),
                              ("max_bytes", "its pool is local_cpu_bytes")):
                if getattr(self, key) is not None:
                    raise ValueError(f"{key}: not a key of store 'lmcache' ({hint}); remove it")
        else:
            for key in ("local_cpu_bytes", "remote_url"):
                if getattr(self, key) is not None:
                    raise ValueError(f"{key}: only for store 'lmcache'; remove it, or set \"store\": \"lmcache\"")
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


TIER_KEYS = tuple(TierConfig.model_fields)


class OffloadConfig(BaseModel):
    """Options of one OffloadConnector: its tier stack, top (fastest) first,
    and what applies to all of them."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    tiers: list[TierConfig] = Field(
        min_length=1, max_length=8,
        description="the tier stack, fastest first, e.g. [{\"store\": \"cpu\", \"cpu_bytes\": ...}, "
        "{\"store\": \"fs\", \"path\": ...}]; or give one tier's keys at the top level instead")
    hybrid_chunk_size: int | None = Field(
        default=None, gt=0,
        description="tokens per chunk; a multiple of every KV cache group's block size "
        "(default: the smallest such multiple >= 256)",
    )
    io_threads: int = Field(default=4, ge=1, le=64, description="file I/O threads per worker")
    max_pending_store_bytes: int = Field(
        default=1 << 30, ge=1 << 20,
        description="bytes of gathered pages waiting to be written; stores beyond it are dropped",
    )
    # Bounded: concurrent.futures.wait overflows (and shutdown crashes) on inf or beyond TIMEOUT_MAX.
    shutdown_timeout_s: float = Field(
        default=60.0, ge=0, le=threading.TIMEOUT_MAX, description="how long shutdown waits for pending stores"
    )
    model_id: str | None = Field(
        default=None, min_length=1,
        description="identity of the model in cache keys (default: the served model path); "
        "set it when one model is served from different paths sharing a cache",
    )

    @model_validator(mode="after")
    def _distinct(self) -> OffloadConfig:
        names = [t.tier_name for t in self.tiers]
        for i, n in enumerate(names):
            if n in names[:i]:
                raise ValueError(f"tiers[{i}].name: tier name {n!r} is also tiers[{names.index(n)}]'s; "
                                 "give each tier a distinct 'name'")
        paths = [t.path for t in self.tiers]
        for i, p in enumerate(paths):
            if p is not None and p in paths[:i]:
                raise ValueError(f"tiers[{i}].path={p!r}: also tiers[{paths.index(p)}]'s; one directory per tier")
        return self


def _describe(err: dict[str, Any], flat: bool) -> str:
    """One operator-facing line: the key path as the user wrote it, the
    value, and what would be valid. In the one-tier form (tier keys at the
    top level) `tiers[0].` is not what the user wrote, so it is dropped."""
    msg = err["msg"].removeprefix("Value error, ")
    loc = list(err["loc"])
    model: type[BaseModel] = OffloadConfig
    prefix = ""
    if len(loc) >= 2 and loc[0] == "tiers" and isinstance(loc[1], int):
        model = TierConfig
        prefix = "" if flat else f"tiers[{loc[1]}]."
        loc = loc[2:]
    if not loc:  # a rule across keys; its message starts with the key
        if flat and msg.startswith("tiers[0]."):
            msg = msg.removeprefix("tiers[0].")
        return f"{EXTRA_CONFIG}.{prefix}{msg}"
    key = prefix + ".".join(str(p) for p in loc)
    if loc[0] == "auth" and len(loc) > 1 and (model is TierConfig or flat):
        model, loc = AuthConfig, loc[1:]  # a key inside `auth`: its own keys and descriptions
        flat = False
    if err["type"] == "extra_forbidden":
        fields = [*TIER_KEYS, *(k for k in OffloadConfig.model_fields if k != "tiers")] if flat \
            else list(model.model_fields)
        valid = ", ".join(fields)
        return f"{EXTRA_CONFIG}.{key}: unknown key; valid keys are: {valid}"
    field = model.model_fields.get(str(loc[0]))
    hint = f" ({field.description})" if field is not None and field.description else ""
    if err["type"] == "missing":
        return f"{EXTRA_CONFIG}.{key}: required{hint}"
    return f"{EXTRA_CONFIG}.{key}={err.get('input')!r}: {msg}{hint}"


def parse_config(extra: dict[str, Any] | None) -> OffloadConfig:
    """Validate the extra config dict; raise ConfigError listing every problem.

    Two forms: `{"tiers": [{tier keys}, ...], connector keys}`, or one tier's
    keys next to the connector keys (`{"store": "fs", "path": ...}`), which is
    a stack of that one tier.
    """
    if not isinstance(extra, dict):
        raise ConfigError(f"{EXTRA_CONFIG} must be a JSON object, got {type(extra).__name__}")
    flat = "tiers" not in extra
    if flat:
        doc: dict[str, Any] = {k: v for k, v in extra.items() if k not in TIER_KEYS}
        doc["tiers"] = [{k: v for k, v in extra.items() if k in TIER_KEYS}]
    else:
        mixed = sorted(k for k in extra if k in TIER_KEYS)
        if mixed:
            raise ConfigError(f"invalid OffloadConnector config:\n  {EXTRA_CONFIG}.{mixed[0]}: a tier key next to "
                              "'tiers'; move it into the tier it belongs to (tiers[i]) or drop 'tiers'") from None
        doc = extra
    try:
        cfg = OffloadConfig.model_validate(doc)
    except ValidationError as e:
        lines = [_describe(err, flat) for err in e.errors()]
        raise ConfigError("invalid OffloadConnector config:\n  " + "\n  ".join(lines)) from None
    return cfg


def connector_extras(kv_transfer_config: dict[str, Any]) -> list[dict[str, Any]]:
    """Each OffloadConnector's extra config in a kv-transfer-config: the
    config's own, or those of an OffloadMultiConnector's children (the dicts
    themselves, so a tool can edit them)."""
    children = (kv_transfer_config.get(EXTRA_CONFIG) or {}).get("children", [kv_transfer_config])
    return [c.setdefault(EXTRA_CONFIG, {}) for c in children if c.get("kv_connector") == "OffloadConnector"]


def tier_dicts(kv_transfer_config: dict[str, Any]) -> list[dict[str, Any]]:
    """Every tier's keys, in either form (`tiers: [...]`, or one tier's keys
    next to the connector's), across the connectors of a kv-transfer-config."""
    return [t for extra in connector_extras(kv_transfer_config) for t in extra.get("tiers", [extra])]
