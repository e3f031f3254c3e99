"""The stores' options, as typed and validated as the tier keys users write.

Each class is one store's options and its tier's declaration (`StoreOptions`),
registered in `offload.store.TIERS`: the tier union of the connector config
(`offload/config.py`) is made of the registered classes, discriminated by
`store`, so the keys of a tier are exactly the fields of its store's options,
and a key of another store is refused naming the store it belongs to.
Defaults are declared here once; the stores import them.

Byte sizes (`ByteCount`) take an integer or a string with a unit, the same
way in the JSON config and on the command line (`parse_bytes`).

Only pydantic and the standard library are imported, so `kvoffload
check-config` and the connector config load without torch, and the
cache-directory machinery (offload/store/cachedir/) may import the defaults
without importing back into its own package.
"""

from __future__ import annotations

import dataclasses
import os
import re
import stat
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    GetPydanticSchema,
    PlainValidator,
    Strict,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    field_validator,
    model_validator,
)
from pydantic.dataclasses import dataclass

# ---- defaults (the stores and the CLI use these) ------------------------------------------

DIR_MODE = 0o750  # `dir_mode`: owner and group only
FILE_MODE = 0o640  # `file_mode`: owner and group only
DEFAULT_ORPHAN_AGE_S = 3600.0  # `orphan_tmp_age_s`
DEFAULT_RECONCILE_S = 6 * 3600.0  # `reconcile_interval_s`
DEFAULT_REMOTE_TIMEOUT_S = 2.0  # `remote_timeout_s`

# ---- byte sizes ---------------------------------------------------------------------------

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGTP]?)(?:I?B)?\s*")
SIZE_HINT = "bytes, optionally with K, M, G, T or P (powers of 1024: 512M, 512MiB and 512MB are all 512 MiB)"


def parse_bytes(text: str) -> int:
    """'1073741824', '512M', '512MiB', '1.5G' -> bytes; units are powers of
    1024 whether written K, KB or KiB (the convention `kvoffload gc` always had)."""
    m = _SIZE.fullmatch(text.upper())
    if not m:
        raise ValueError(f"expected {SIZE_HINT}, e.g. 512M or 2GiB")
    number, unit = m.group(1), _UNITS[m.group(2)]
    return int(number) * unit if "." not in number else int(float(number) * unit)


def _bytes_from_text(v: object) -> object:
    return parse_bytes(v) if isinstance(v, str) else v  # anything else meets the strict int check


# A byte count: a JSON integer, or a string with a unit. Booleans and floats stay refused.
ByteCount = Annotated[int, Strict(), BeforeValidator(_bytes_from_text)]

# ---- permission modes ---------------------------------------------------------------------


# Validation context of a config as users write it: modes must be octal strings there (750 is not 0o750).
FROM_CONFIG = {"from_config": True}


def _octal_mode(need: int, what: str):
    def check(v: object, info: ValidationInfo) -> int:
        if isinstance(v, int) and not isinstance(v, bool) and not (info.context or {}).get("from_config"):
            bits = v  # from code (dataclasses.replace, a caller's FsOptions): already the bits
        elif not isinstance(v, str) or not re.fullmatch(r"0?[0-7]{3}", v):
            raise ValueError("must be an octal string such as '0640'")
        else:
            bits = int(v, 8)
        if bits & 0o002:
            raise ValueError("must not be writable by others (anyone could plant or replace cache files); "
                             "use e.g. '0660'/'0770' to share with a group")
        if bits & need != need:
            raise ValueError(f"the owner needs {what} (at least {need:04o})")
        return bits

    return PlainValidator(check)


# The JSON takes an octal string ("0640"); the store gets the bits (code may pass them).
FileMode = Annotated[int, _octal_mode(0o600, "read+write")]
DirMode = Annotated[int, _octal_mode(0o700, "rwx")]

# ---- the deployment key, by reference -----------------------------------------------------

_ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"


@dataclasses.dataclass(frozen=True)
class AuthRef:
    """Where the keys are, never the keys: the tier option `auth`.
    `field` prefixes error messages (the config key path of the option)."""

    key_file: str | None = None
    key_env: str | None = None
    previous_key_files: tuple[str, ...] = ()
    previous_key_envs: tuple[str, ...] = ()
    field: str = dataclasses.field(default="auth", compare=False)

    def describe(self) -> str:
        cur = f"key file {self.key_file}" if self.key_file else f"key from ${self.key_env}"
        n = len(self.previous_key_files) + len(self.previous_key_envs)
        return cur + (f", {n} previous key{'s' if n != 1 else ''} for reads" if n else "")


class AuthConfig(BaseModel):
    """The `auth` key as written: the deployment key of a tier, by reference
    (never the key itself): entries are signed with the current key and
    restored only when a key of this deployment's verifies them
    (docs/reliability.md, threat model). Validated into an `AuthRef`."""

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

    def ref(self) -> AuthRef:
        return AuthRef(self.key_file, self.key_env, tuple(self.previous_key_files), tuple(self.previous_key_envs))


def _auth_ref(v: Any, handler: ValidatorFunctionWrapHandler) -> AuthRef:
    return v if isinstance(v, AuthRef) else handler(v).ref()


# `auth`: an AuthRef as Python code passes it, or the JSON object checked by AuthConfig (its errors keep
# their key paths, `auth.key_env`).
AuthOption = Annotated[AuthRef, GetPydanticSchema(
    lambda _src, handler: handler.generate_schema(Annotated[AuthConfig, WrapValidator(_auth_ref)]))]

# ---- the stores' options ------------------------------------------------------------------


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


def _cache_dir(v: str) -> str:
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


# Field-level strictness (not the dataclass config's): a strict pydantic dataclass refuses dicts, and a tier
# arrives as one. Strict fields keep JSON's "1" from passing for 1 or 1 for true.
OPTIONS_CONFIG = ConfigDict(extra="forbid", validate_by_name=True, validate_by_alias=True)
_FS_KEYS = ("fsync", "file_mode", "dir_mode", "orphan_tmp_age_s", "reconcile_interval_s")


@dataclass(frozen=True, config=OPTIONS_CONFIG)
class StoreOptions:
    """What every store's options have: the tier's `store` kind and `name`.

    A store's options class is its tier's declaration, registered once by a line in
    `offload.store.TIERS`: its fields are the tier's keys, and these class attributes say the
    rest, so the config, `check-config`, `stats`, `fsck` and the demo follow from it. It
    imports no torch (the config and `check-config` load without it); `tier` names the
    `TierSpec` that builds the tier, imported when a stack is built."""

    tier: ClassVar[str]  # "module:Class" of the tier's TierSpec
    help: ClassVar[str]  # what the store is, in the `store` key's help
    # Its chunk files live in a cache directory at its `path` key: what `stats` and `fsck`
    # read and the demo points at a fresh directory, and no two tiers may share it.
    holds_files: ClassVar[bool] = False
    in_host_memory: ClassVar[bool] = False  # this process's memory: what warm start fills
    remote_key: ClassVar[str | None] = None  # the key of its LMCache remote, which `stats --config` reads
    # Keys of other stores it takes and ignores (configs written when one flat model held every
    # store's keys still start) -> the store whose field checks the value.
    tolerated: ClassVar[dict[str, str]] = {}
    # Keys of other stores written on it -> why they are refused and what to do instead
    # (without a line here: "only for store X").
    misplaced: ClassVar[dict[str, str]] = {}

    store: str = dataclasses.field(default="", kw_only=True)  # each store's own Literal, the union's tag
    # Keyword-only, as `store`: positional arguments stay each store's own options. Outside equality: a
    # label, so two tiers with the same options and other names still share LMCache's engine.
    name: Annotated[str | None, Strict(), Field(
        min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$",
        description="this tier's name in per-request results and logs (default: the store kind)")] = \
        dataclasses.field(default=None, kw_only=True, compare=False)

    @property
    def tier_name(self) -> str:
        return self.name or self.store

    def options(self) -> StoreOptions:
        """The store's own options: these."""
        return self


@dataclass(frozen=True, config=OPTIONS_CONFIG)
class FsOptions(StoreOptions):
    """Options of the file tier (`"store": "fs"`); see docs/operations.md."""

    tier: ClassVar[str] = "offload.store.fs:FsTier"
    help: ClassVar[str] = "files on a local or NFS directory"
    holds_files: ClassVar[bool] = True
    tolerated: ClassVar[dict[str, str]] = {"remote_timeout_s": "lmcache"}
    misplaced: ClassVar[dict[str, str]] = {
        "cpu_bytes": "only for store 'cpu'; remove it, or set \"store\": \"cpu\" (the file tier's budget is "
                     "max_bytes)"}

    path: Annotated[str, Strict(), AfterValidator(_cache_dir), Field(
        description="absolute cache directory, created if missing (required for store 'fs')")]
    fsync: Annotated[bool, Strict(), Field(
        description="fsync each file and its directory before it becomes visible")] = False
    max_bytes: Annotated[ByteCount | None, Field(
        ge=1 << 20, le=1 << 50,
        description="byte budget of the cache directory for store 'fs' (1 MiB to 1 PiB; an integer or e.g. "
        "\"512GiB\"; default: no budget); beyond it the least recently used chunks are evicted, descendants "
        "first")] = None
    file_mode: Annotated[FileMode, Field(
        description="permissions of cache files, an octal string such as '0640' or '0660' (owner read+write "
        "required; never writable by others)")] = FILE_MODE
    dir_mode: Annotated[DirMode, Field(
        description="permissions of cache directories, an octal string such as '0750' or '0770' (owner rwx "
        "required; never writable by others)")] = DIR_MODE
    orphan_tmp_age_s: Annotated[float, Strict(), Field(
        ge=60, le=7 * 86400,
        description="age after which a temporary file of any host is an orphan and removed (60 s to 7 days); "
        "this host's temporary files are removed at start-up as soon as their writer is gone")] = \
        DEFAULT_ORPHAN_AGE_S
    reconcile_interval_s: Annotated[float, Strict(), Field(
        ge=60, le=30 * 86400,
        description="store 'fs': how often one instance walks the whole cache directory to correct the "
        "ledger's usage accounting (60 s to 30 days; default 6 h); between walks usage comes from the "
        "ledger")] = DEFAULT_RECONCILE_S
    direct_reads: Annotated[bool, Strict(), Field(
        description="store 'fs': read files with O_DIRECT straight into the load buffer (default: true; a "
        "filesystem that refuses O_DIRECT gets buffered reads); false reads through the page cache, which "
        "keeps recently loaded files in memory but costs a copy per load and makes load speed depend on "
        "the page cache's state")] = True
    auth: Annotated[AuthOption | None, Field(
        description="stores 'fs' and 'lmcache': the deployment key, by reference: {\"key_file\": "
        "\"/etc/kvoffload/key\"} or {\"key_env\": \"KVOFFLOAD_KEY\"}, plus previous_key_files / "
        "previous_key_envs for rotation; every entry then carries a MAC and only entries a key of this "
        "deployment signed are restored (default: none, CRC only)")] = None
    store: Literal["fs"] = dataclasses.field(default="fs", kw_only=True)


@dataclass(frozen=True, config=OPTIONS_CONFIG)
class CpuOptions(StoreOptions):
    """Options of the host-memory tier (`"store": "cpu"`)."""

    tier: ClassVar[str] = "offload.store.cpu:CpuTier"
    help: ClassVar[str] = "host memory"
    in_host_memory: ClassVar[bool] = True
    tolerated: ClassVar[dict[str, str]] = {**dict.fromkeys(_FS_KEYS, "fs"), "remote_timeout_s": "lmcache"}
    misplaced: ClassVar[dict[str, str]] = {
        "auth": "not for store 'cpu': host memory is this process's own and needs no MAC; remove it",
        "max_bytes": "only for store 'fs'; the host-memory budget is cpu_bytes",
        "direct_reads": "only for store 'fs' (files); store 'cpu' reads no files, remove it"}

    cpu_bytes: Annotated[ByteCount, Field(
        ge=1 << 20, le=1 << 44,
        description="the host memory budget in bytes for store 'cpu' (1 MiB to 16 TiB; an integer or e.g. "
        "\"8GiB\"; required for it)")]
    store: Literal["cpu"] = dataclasses.field(default="cpu", kw_only=True)


@dataclass(frozen=True, config=OPTIONS_CONFIG)
class LMCacheOptions(StoreOptions):
    """Options of the LMCache tier (`"store": "lmcache"`); see docs/operations.md."""

    tier: ClassVar[str] = "offload.store.lmcache:LMCacheTier"
    help: ClassVar[str] = "LMCache's storage engine: a local CPU pool, optionally a remote"
    remote_key: ClassVar[str | None] = "remote_url"
    tolerated: ClassVar[dict[str, str]] = dict.fromkeys(_FS_KEYS, "fs")
    misplaced: ClassVar[dict[str, str]] = {
        "path": "not a key of store 'lmcache' (files are store 'fs': add a tier); remove it",
        "cpu_bytes": "not a key of store 'lmcache' (its pool is local_cpu_bytes); remove it",
        "max_bytes": "not a key of store 'lmcache' (its pool is local_cpu_bytes); remove it",
        "direct_reads": "only for store 'fs' (files); store 'lmcache' reads no files, remove it"}

    local_cpu_bytes: Annotated[ByteCount, Field(
        ge=1 << 20, le=1 << 44,
        description="LMCache's local CPU pool for store 'lmcache', in bytes (an integer or e.g. \"4GiB\"; "
        "required for it; LMCache's max_local_cpu_size)")]
    remote_url: Annotated[str | None, Strict(), Field(
        pattern=r"^[a-z][a-z0-9+.-]*://\S+$",
        description="LMCache remote for store 'lmcache', e.g. 'redis://127.0.0.1:6379' (LMCache's remote_url; "
        "default: none, the local pool only)")] = None
    timeout_s: Annotated[float, Strict(), Field(
        alias="remote_timeout_s", gt=0, le=60,
        description="bound on one LMCache remote operation for store 'lmcache' (seconds, up to 60); "
        "beyond it the lookup or load is a miss")] = DEFAULT_REMOTE_TIMEOUT_S
    auth: Annotated[AuthOption | None, Field(
        description="the deployment key, by reference, as for store 'fs' (default: none, CRC only)")] = None
    store: Literal["lmcache"] = dataclasses.field(default="lmcache", kw_only=True)
