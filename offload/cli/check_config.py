"""`kvoffload check-config CONFIG`: validate a kv-transfer-config JSON file.

Checks what vLLM and the connector would check at start-up, without starting
an engine (it imports vLLM's config classes, which takes some seconds):

- the top level, as vLLM's `KVTransferConfig` validates it (known keys,
  `kv_role`, `kv_load_failure_policy`), plus the connector name and the
  `kv_connector_module_path` vLLM needs to find it;
- an `OffloadConnector`'s `kv_connector_extra_config`, with the connector's
  own parser (`offload.config.parse_config`: the same pydantic types, byte
  sizes with units included);
- an `OffloadMultiConnector`'s `children` (`offload.multi_connector.config`'s
  `parse_children`, then `check_children`), and each OffloadConnector child as above.

Every problem is printed on one line: the key, its value and what is valid.
Checks that need the model (chunk size against block sizes, LMCache on a
hybrid model) happen at engine start; notes say where they apply.

Exit codes: 0 valid; 1 problems found; 2 the file cannot be read as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from offload.config import EXTRA_CONFIG, ConfigError, parse_config

CHILDREN = "children"
MODULES = {"OffloadConnector": "offload.connector", "OffloadMultiConnector": "offload.multi_connector"}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("check-config", help="validate a kv-transfer-config JSON file without starting vLLM",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="kv-transfer-config JSON file (what --kv-transfer-config takes)")
    p.set_defaults(func=run)


def check_top(ktc: dict[str, Any], where: str = "") -> list[str]:
    """vLLM's own validation of a kv-transfer-config, and our connector names."""
    from pydantic import ValidationError
    from vllm.config.kv_transfer import KVTransferConfig

    problems = []
    try:
        KVTransferConfig(**ktc)
    except ValidationError as e:
        for err in e.errors():
            key = ".".join(str(x) for x in err["loc"])
            msg = err["msg"].removeprefix("Value error, ")
            if err["type"] == "unexpected_keyword_argument":
                valid = ", ".join(KVTransferConfig.__dataclass_fields__)
                msg = f"unknown key; valid keys are: {valid}"
            problems.append(f"{where}{key}={err['input']!r}: {msg}" if key else f"{where}{msg}")
    except (TypeError, ValueError) as e:
        problems.append(f"{where}{e}")
    name = ktc.get("kv_connector")
    if name == "MultiConnector" and "children" in (ktc.get(EXTRA_CONFIG) or {}):
        problems.append(f"{where}kv_connector='MultiConnector': vLLM's own MultiConnector reads 'connectors', "
                        "not 'children'; use \"OffloadMultiConnector\" with kv_connector_module_path "
                        "\"offload.multi_connector\"")
    elif name in MODULES and ktc.get("kv_connector_module_path") != MODULES[name]:
        problems.append(f"{where}kv_connector_module_path={ktc.get('kv_connector_module_path')!r}: "
                        f"vLLM finds {name} only with {MODULES[name]!r}")
    return problems


def check_offload(extra: Any, where: str = "") -> list[str]:
    try:
        parse_config(extra)
    except ConfigError as e:
        lines = str(e).splitlines()
        lines = lines[1:] if len(lines) > 1 else lines  # drop the "invalid OffloadConnector config:" title
        return [f"{where}{ln.strip()}" for ln in lines]
    return []


def check_multi(extra: Any) -> tuple[list[str], list[str]]:
    """Problems of a MultiConnector's `children`, every child checked on its own."""
    from offload.multi_connector import check_children, parse_children

    try:
        parse_children(extra)
    except ConfigError as e:
        if f"{CHILDREN}[" not in str(e):  # the list itself: missing, empty, unknown keys
            return str(e).splitlines(), []
    problems, notes = [], []
    names: dict[str, int] = {}
    for i, raw in enumerate(extra[CHILDREN]):
        where = f"{EXTRA_CONFIG}.{CHILDREN}[{i}]."
        try:
            [c] = parse_children({CHILDREN: [raw]})
            # No model here: an empty group list runs check_children's model-independent rules.
            check_children([c], SimpleNamespace(kv_cache_groups=[]))
        except ConfigError as e:
            problems.append(str(e).replace(f"{CHILDREN}[0]", f"{CHILDREN}[{i}]"))
            if not isinstance(raw, dict) or not isinstance(raw.get("kv_connector"), str):
                continue
        ktc = {k: v for k, v in raw.items() if k not in ("load_weight", "store")}
        problems += check_top(ktc, where)
        if ktc["kv_connector"] == "OffloadConnector":
            inner = check_offload(ktc.get(EXTRA_CONFIG), where)
            problems += inner
            if not inner:
                for tier in parse_config(ktc.get(EXTRA_CONFIG)).tiers:
                    if tier.tier_name in names:
                        problems.append(f"{where}{EXTRA_CONFIG}.name={tier.name!r}: tier name {tier.tier_name!r} "
                                        f"is also children[{names[tier.tier_name]}]'s; give each tier a distinct "
                                        "'name'")
                    names[tier.tier_name] = i
        elif "lmcache" in ktc["kv_connector"].lower():
            notes.append(f"{where}kv_connector={ktc['kv_connector']!r}: refused at start-up on hybrid "
                         "(Mamba/GDN) models; fine for pure-attention models")
        else:
            notes.append(f"{where}kv_connector={ktc['kv_connector']!r}: not ours; vLLM validates its "
                         "extra config at start-up")
    return problems, notes


def check(doc: Any) -> tuple[list[str], list[str]]:
    """(problems, notes) for a parsed kv-transfer-config."""
    if not isinstance(doc, dict):
        return [f"the file must hold a JSON object (a kv-transfer-config), got {type(doc).__name__}"], []
    problems = check_top(doc)
    notes: list[str] = []
    name = doc.get("kv_connector")
    if name == "OffloadConnector":
        problems += check_offload(doc.get(EXTRA_CONFIG))
    elif name == "OffloadMultiConnector":
        p, notes = check_multi(doc.get(EXTRA_CONFIG))
        problems += p
    elif name != "MultiConnector":
        problems.append(f"kv_connector={name!r}: check-config validates \"OffloadConnector\" and "
                        "\"OffloadMultiConnector\" configs")
    if doc.get("kv_load_failure_policy") == "fail" and name in MODULES:
        notes.append("kv_load_failure_policy='fail': "
                     "the connector sets it to 'recompute' (a failed load is a miss)")
    return problems, notes


def run(args: argparse.Namespace) -> int:
    try:
        doc = json.loads(Path(args.config).read_text())
    except (OSError, ValueError) as e:
        print(f"kvoffload check-config: {args.config}: cannot read JSON: {e}", file=sys.stderr)
        return 2
    problems, notes = check(doc)
    for n in notes:
        print(f"note: {n}")
    for p in problems:
        print(f"{args.config}: {p}")
    if problems:
        print(f"{len(problems)} problem{'s' if len(problems) > 1 else ''} found")
        return 1
    print(f"{args.config}: valid {doc.get('kv_connector')} config")
    return 0
