"""The OffloadMultiConnector's `kv_connector_extra_config`, as pydantic types.

`{"children": [...]}`: each child is a kv-transfer-config of its own plus
`load_weight` (default 1.0) and `store` (default true). Each child's own keys
are its connector's business (an OffloadConnector child's are checked by
`offload.config.parse_config`, others by vLLM); here only what the
MultiConnector reads. Every problem names its key, value and fix, as the
OffloadConnector's config does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, ValidationError

from offload.config import EXTRA_CONFIG, ConfigError

CHILDREN = "children"
_OURS = ("load_weight", "store")  # the MultiConnector's keys in a child; the rest is the child's kv-transfer-config


class ChildConfig(BaseModel):
    """One child: its kv-transfer-config (other keys pass through) and ours."""

    model_config = ConfigDict(extra="allow", frozen=True)

    kv_connector: StrictStr = Field(description="must be a kv-transfer-config object with a 'kv_connector' name")
    load_weight: float = Field(default=1.0, gt=0, allow_inf_nan=False, strict=True,
                               description="must be a positive number (default 1.0)")
    store: StrictBool = Field(default=True, description="must be true or false")


class MultiConfig(BaseModel):
    """The MultiConnector's extra config: its children and nothing else."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    children: list[ChildConfig] = Field(min_length=1)


@dataclass(frozen=True)
class Child:
    ktc: dict[str, Any]  # the child's own kv-transfer-config
    load_weight: float
    store: bool


def _problems(e: ValidationError) -> list[str]:
    """The list's own problems if any (they make the children meaningless), else each child's."""
    top, unknown, children = [], [], []
    for err in e.errors():
        loc = err["loc"]
        if loc[0] != CHILDREN:
            unknown.append(str(loc[0]))
        elif len(loc) == 1:
            top = [f"{EXTRA_CONFIG}.{CHILDREN}: required, a non-empty list of kv-transfer-configs, "
                   'e.g. [{"kv_connector": "OffloadConnector", ...}]']
        else:
            where = f"{EXTRA_CONFIG}.{CHILDREN}[{loc[1]}]"
            key = str(loc[2]) if len(loc) > 2 else "kv_connector"
            fix = ChildConfig.model_fields[key].description
            line = f"{where}: {fix}" if key == "kv_connector" else f"{where}.{key}={err['input']!r}: {fix}"
            if line not in children:
                children.append(line)
    if unknown:
        top.append(f"{EXTRA_CONFIG}: unknown keys {sorted(unknown)}; the only key is '{CHILDREN}'")
    return top or children


def parse_children(extra: dict[str, Any] | None) -> list[Child]:
    """Validate `children`; every problem names its key, value and fix."""
    if not isinstance(extra, dict):
        extra = {}  # what the list check reports: `children` is required
    try:
        cfg = MultiConfig.model_validate(extra)
    except ValidationError as e:
        raise ConfigError("\n".join(_problems(e))) from None
    return [Child({k: v for k, v in raw.items() if k not in _OURS}, float(c.load_weight), c.store)
            for raw, c in zip(extra[CHILDREN], cfg.children)]
