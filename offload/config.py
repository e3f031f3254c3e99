"""Typed connector config, parsed from `kv_connector_extra_config`.

Every problem fails at start-up with the key, the value and what would be
valid, so an operator can fix a kv-transfer-config without reading our code.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Annotated, Any, Literal, Union

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    create_model,
    model_validator,
)

from offload.store import tier_options
from offload.store.options import FROM_CONFIG, AuthConfig, ByteCount, StoreOptions

EXTRA_CONFIG = "kv_connector_extra_config"

# The registered stores' options classes by `store` name (offload.store.TIERS), read at each parse.
Stores = dict[str, type[StoreOptions]]


class ConfigError(ValueError):
    """A kv-transfer-config that cannot work; the message says how to fix it."""


def keys(options: type[StoreOptions]) -> dict[str, Any]:
    """A store's keys as written in the config (aliases), each with its pydantic FieldInfo; `store` first."""
    fields = options.__pydantic_fields__  # type: ignore[attr-defined]
    out = {f.alias or n: f for n, f in fields.items()}
    return {"store": out.pop("store"), **out}


def _tier_keys(stores: Stores) -> tuple[str, ...]:
    """Every key of any store, each once."""
    return tuple(dict.fromkeys(k for o in stores.values() for k in keys(o)))


def _store_help(stores: Stores) -> str:
    kinds = [f"'{s}' ({o.help})" for s, o in stores.items()]
    return "tier backend: " + " or ".join(filter(None, (", ".join(kinds[:-1]), kinds[-1])))


def _misplaced(stores: Stores, store: str, key: str) -> str | None:
    """Why `key`, a key of another store, is not one of `store`'s (None: no store has it)."""
    if key in stores[store].misplaced:
        return stores[store].misplaced[key]
    owners = [s for s, o in stores.items() if s != store and key in keys(o)]
    if not owners:
        return None
    return f"only for store '{owners[0]}'; remove it, or set \"store\": \"{owners[0]}\""


def tier_kind(tier: Any) -> type[StoreOptions] | None:
    """The registered options class of a tier as written (None: no `store`, or one not registered)."""
    store = tier.get("store") if isinstance(tier, dict) else None
    return tier_options().get(store) if isinstance(store, str) else None


def _key_adapter(options: type[StoreOptions], key: str) -> TypeAdapter:
    info = keys(options)[key]
    form: Any = Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation
    return TypeAdapter(form)


def _drop_tolerated(stores: Stores, tier: Any) -> Any:
    """A tier without the keys its store ignores (its `tolerated`), once their values pass their own store's check."""
    if not isinstance(tier, dict) or tier.get("store") not in stores:
        return tier
    tolerated = stores[tier["store"]].tolerated
    found = [k for k in tier if k in tolerated]
    for key in found:
        try:
            _key_adapter(stores[tolerated[key]], key).validate_python(tier[key], context=FROM_CONFIG)
        except ValidationError as e:
            msg = e.errors()[0]["msg"].removeprefix("Value error, ")
            raise ValueError(f"{key}={tier[key]!r}: {msg}; it has no effect on store '{tier['store']}': "
                             "remove it") from None
    return {k: v for k, v in tier.items() if k not in found} if found else tier


class OffloadConfig(BaseModel):
    """Options of one OffloadConnector: its tier stack, top (fastest) first,
    and what applies to all of them."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    # Each a registered store's options; `parse_config` validates them as the union of those stores.
    tiers: list[StoreOptions] = Field(
        min_length=1, max_length=8,
        description="the tier stack, fastest first, e.g. [{\"store\": \"cpu\", \"cpu_bytes\": ...}, "
        "{\"store\": \"fs\", \"path\": ...}]; or give one tier's keys at the top level instead")
    hybrid_chunk_size: int | None = Field(
        default=None, gt=0,
        description="tokens per chunk; a multiple of every KV cache group's block size "
        "(default: the smallest such multiple >= 256)",
    )
    io_threads: int = Field(
        default=16, ge=1, le=64,
        description="file I/O threads per worker for loads (each reads, verifies and scatters one file at a "
        "time, so this many reads are in flight); stores get half as many")
    max_pending_store_bytes: ByteCount = Field(
        default=1 << 30, ge=1 << 20,
        description="bytes of gathered pages waiting to be written (an integer or e.g. \"1GiB\"); stores beyond "
        "it are dropped",
    )
    # Bounded: concurrent.futures.wait overflows (and shutdown crashes) on inf or beyond TIMEOUT_MAX.
    shutdown_timeout_s: float = Field(
        default=60.0, ge=0, le=threading.TIMEOUT_MAX, description="how long shutdown waits for pending stores"
    )
    state_policy: Literal["by_use", "all", "tails"] = Field(
        default="by_use",
        description="how recurrent (Mamba/GDN) states enter each tier: 'by_use' stores every state and lets a "
        "state at a prompt's internal chunk boundary go first unless it is read (tails and branch points stay "
        "hot); 'all' treats every state like attention KV; 'tails' stores no internal state",
    )
    warm_start: bool = Field(
        default=True,
        description="at start, copy the most recently used entries of a tier below host memory (files) into "
        "host memory in the background, up to warm_start_share of it; only where the stack has host memory "
        "above a file tier. Turn it off where the cache is far larger than host memory and rarely reused",
    )
    warm_start_share: float = Field(
        default=0.5, gt=0, le=1,
        description="the share of host memory warm start may fill (it only takes free room, never evicts)",
    )
    model_id: str | None = Field(
        default=None, min_length=1,
        description="identity of the model in cache keys (default: the served model path); "
        "set it when one model is served from different paths sharing a cache",
    )

    @property
    def store_threads(self) -> int:
        """Threads of the worker's store pool: half the load threads (8 at the default), so writes
        fill the device too while a load never queues behind them. A shared directory's budget
        counts every write in flight before it lands (`offload.store.cachedir.inflight`)."""
        return max(1, self.io_threads // 2)

    @model_validator(mode="after")
    def _distinct(self) -> OffloadConfig:
        names = [t.tier_name for t in self.tiers]
        for i, n in enumerate(names):
            if n in names[:i]:
                raise ValueError(f"tiers[{i}].name: tier name {n!r} is also tiers[{names.index(n)}]'s; "
                                 "give each tier a distinct 'name'")
        paths = [t.path if t.holds_files else None for t in self.tiers]  # type: ignore[attr-defined]
        for i, p in enumerate(paths):
            if p is not None and p in paths[:i]:
                raise ValueError(f"tiers[{i}].path={p!r}: also tiers[{paths.index(p)}]'s; one directory per tier")
        return self


_EXTRA = ("extra_forbidden", "unexpected_keyword_argument")  # a model's and a dataclass's unknown key
_CONNECTOR_KEYS = tuple(k for k in OffloadConfig.model_fields if k != "tiers")


def _model(stores: Stores) -> type[OffloadConfig]:
    """OffloadConfig with its tiers checked as the union of `stores`, `store` picking one. Made at
    each parse from the registered stores (a millisecond), so a registration holds from the next."""
    tier = Annotated[Union[tuple(stores.values())], Field(discriminator="store"),  # noqa: UP007
                     BeforeValidator(lambda t: _drop_tolerated(stores, t))]
    return create_model("OffloadConfig", __base__=OffloadConfig, __module__=__name__,
                        tiers=(list[tier], OffloadConfig.model_fields["tiers"]))


def _store_of(tier: Any, stores: Stores) -> str | None:
    store = tier.get("store") if isinstance(tier, dict) else None
    return store if isinstance(store, str) and store in stores else None


def _written(doc: Any, path: list[Any], default: Any) -> Any:
    """The value at `path` as the user wrote it ("1K", where a check after parsing reports 1024)."""
    for p in path:
        if (isinstance(doc, dict) and p in doc) or (isinstance(doc, list) and isinstance(p, int) and p < len(doc)):
            doc = doc[p]
        else:
            return default
    return doc


def _line(key: str, err: Mapping[str, Any], fields: dict[str, Any], field: str, written: Any = None,
          path: list[Any] | None = None) -> str:
    """`key=value: what is wrong (what the key is)`, or `key: required (...)`."""
    info = fields.get(field)
    hint = f" ({info.description})" if info is not None and info.description else ""
    if err["type"] == "missing":
        return f"{EXTRA_CONFIG}.{key}: required{hint}"
    value = err.get("input") if path is None else _written(written, path, err.get("input"))
    return f"{EXTRA_CONFIG}.{key}={value!r}: {err['msg'].removeprefix('Value error, ')}{hint}"


def _describe(err: Mapping[str, Any], flat: bool, doc: dict[str, Any], stores: Stores) -> str:
    """One operator-facing line: the key path as the user wrote it, the
    value, and what would be valid. In the one-tier form (tier keys at the
    top level) `tiers[0].` is not what the user wrote, so it is dropped."""
    msg = err["msg"].removeprefix("Value error, ")
    loc = list(err["loc"])
    fields: dict[str, Any] = dict(OffloadConfig.model_fields)
    prefix, store, written = "", None, doc
    if len(loc) >= 2 and loc[0] == "tiers" and isinstance(loc[1], int):
        prefix = "" if flat else f"tiers[{loc[1]}]."
        tier = written = doc["tiers"][loc[1]]
        if not isinstance(tier, dict):
            return (f"{EXTRA_CONFIG}.{prefix.rstrip('.')}={tier!r}: must be an object of tier keys, e.g. "
                    "{\"store\": \"fs\", \"path\": \"/var/cache/kvoffload\"}")
        if err["type"] == "union_tag_not_found":
            return f"{EXTRA_CONFIG}.{prefix}store: required ({_store_help(stores)})"
        if err["type"] == "union_tag_invalid":
            kinds = ", ".join(repr(k) for k in stores)
            return f"{EXTRA_CONFIG}.{prefix}store={tier.get('store')!r}: must be one of {kinds} ({_store_help(stores)})"
        if len(loc) >= 3 and loc[2] in stores:  # a key of the store `store` picked
            store = str(loc[2])
            fields = keys(stores[store])
            loc = loc[3:]
        else:
            loc = loc[2:]
    elif flat:
        store = _store_of(doc["tiers"][0], stores)
    if not loc:  # a rule across keys; its message starts with the key
        if flat and msg.startswith("tiers[0]."):
            msg = msg.removeprefix("tiers[0].")
        return f"{EXTRA_CONFIG}.{prefix}{msg}"
    key = prefix + ".".join(str(p) for p in loc)
    path = list(loc)  # where the value is in `written`, the tier (or the whole config)
    if loc[0] == "auth" and len(loc) > 1 and store is not None:
        fields, loc = dict(AuthConfig.model_fields), loc[1:]  # a key inside `auth`: its own keys and descriptions
        flat = False
    if err["type"] in _EXTRA:
        in_tier = written is not doc and len(loc) == 1
        why = _misplaced(stores, store, str(loc[0])) if in_tier and store is not None else None
        if why is not None:
            return f"{EXTRA_CONFIG}.{key}: {why}"
        if flat:
            valid = [*(keys(stores[store]) if store is not None else _tier_keys(stores)), *_CONNECTOR_KEYS]
        else:
            valid = list(fields)
        return f"{EXTRA_CONFIG}.{key}: unknown key; valid keys are: {', '.join(valid)}"
    return _line(key, err, fields, str(loc[0]), written, path)


def _storeless(tier: dict[str, Any], prefix: str, stores: Stores) -> list[str]:
    """Problems of a tier's other keys when its `store` is missing or unknown (the union then checks none):
    each key against the store that has it, as when every store's keys were checked at once."""
    lines = []
    for key, value in tier.items():
        owners = [s for s, o in stores.items() if key in keys(o)]
        if key == "store":
            continue
        if not owners:
            lines.append(f"{EXTRA_CONFIG}.{prefix}{key}: unknown key; valid keys are: {', '.join(_tier_keys(stores))}")
            continue
        try:
            _key_adapter(stores[owners[0]], key).validate_python(value, context=FROM_CONFIG)
        except ValidationError as e:
            fields = keys(stores[owners[0]])
            for err in e.errors():
                sub = "".join(f".{p}" for p in err["loc"])
                inner = dict(AuthConfig.model_fields) if sub else fields
                lines.append(_line(f"{prefix}{key}{sub}", err, inner, str(err["loc"][0]) if sub else key, tier,
                                   [key, *err["loc"]]))
    return lines


def parse_config(extra: dict[str, Any] | None) -> OffloadConfig:
    """Validate the extra config dict; raise ConfigError listing every problem.

    Two forms: `{"tiers": [{tier keys}, ...], connector keys}`, or one tier's
    keys next to the connector keys (`{"store": "fs", "path": ...}`), which is
    a stack of that one tier.
    """
    if not isinstance(extra, dict):
        raise ConfigError(f"{EXTRA_CONFIG} must be a JSON object, got {type(extra).__name__}")
    stores = tier_options()
    tier_keys = _tier_keys(stores)
    flat = "tiers" not in extra
    if flat:
        doc: dict[str, Any] = {k: v for k, v in extra.items() if k not in tier_keys}
        doc["tiers"] = [{k: v for k, v in extra.items() if k in tier_keys}]
    else:
        mixed = sorted(k for k in extra if k in tier_keys)
        if mixed:
            raise ConfigError(f"invalid OffloadConnector config:\n  {EXTRA_CONFIG}.{mixed[0]}: a tier key next to "
                              "'tiers'; move it into the tier it belongs to (tiers[i]) or drop 'tiers'") from None
        doc = extra
    try:
        # by_name=False: a key is what the docs call it (`remote_timeout_s`), not a store's attribute name.
        cfg = _model(stores).model_validate(doc, by_alias=True, by_name=False, context=FROM_CONFIG)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            lines.append(_describe(err, flat, doc, stores))
            if err["type"] in ("union_tag_not_found", "union_tag_invalid"):
                lines += _storeless(doc["tiers"][err["loc"][1]], "" if flat else f"tiers[{err['loc'][1]}].", stores)
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
