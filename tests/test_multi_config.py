"""MultiConnector configuration, checked against vLLM's real KV cache spec types."""

from __future__ import annotations

import pytest
import torch

from offload.config import ConfigError
from offload.multi_connector.connector import check_children, parse_children

OURS = {"kv_connector": "OffloadConnector", "kv_connector_module_path": "offload.connector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"store": "cpu", "cpu_bytes": 1 << 30}}
LMCACHE = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}


def kv_cache_config(hybrid: bool):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec

    groups = [KVCacheGroupSpec(["attn.0"], FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64,
                                                              dtype=torch.bfloat16))]
    if hybrid:
        groups.insert(0, KVCacheGroupSpec(["mamba.0"], MambaSpec(block_size=16, shapes=((3, 192), (1, 64, 64)),
                                                                 dtypes=(torch.bfloat16, torch.float32))))
    return KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=groups)


def test_children_defaults_and_weights():
    c = parse_children({"children": [OURS, {**OURS, "load_weight": 2.5, "store": False}]})
    assert [(x.load_weight, x.store) for x in c] == [(1.0, True), (2.5, False)]
    assert "load_weight" not in c[1].ktc and "store" not in c[1].ktc


@pytest.mark.parametrize("extra,key", [
    (None, "children"), ({}, "children"), ({"children": []}, "children"),
    ({"children": [OURS], "connectors": []}, "unknown keys"),
    ({"children": ["OffloadConnector"]}, "children[0]"),
    ({"children": [{**OURS, "load_weight": 0}]}, "children[0].load_weight=0"),
    ({"children": [{**OURS, "load_weight": -1}]}, "load_weight=-1"),
    ({"children": [{**OURS, "load_weight": "2"}]}, "load_weight='2'"),
    ({"children": [{**OURS, "load_weight": float("inf")}]}, "load_weight=inf"),
    ({"children": [OURS, {**OURS, "store": "no"}]}, "children[1].store='no'"),
])
def test_bad_children_fail_naming_the_key(extra, key):
    with pytest.raises(ConfigError) as e:
        parse_children(extra)
    assert key in str(e.value)


def test_lmcache_child_refused_on_hybrid_model_with_reason_and_alternative():
    children = parse_children({"children": [LMCACHE, OURS]})
    with pytest.raises(ConfigError) as e:
        check_children(children, kv_cache_config(hybrid=True))
    msg = str(e.value)
    assert "children[0].kv_connector='LMCacheConnectorV1'" in msg
    assert "Mamba" in msg and "2845" in msg and '"store": "cpu"' in msg
    assert "MP mode" in msg and "not bit-exact" in msg and '"store": "lmcache"' in msg
    check_children(children, kv_cache_config(hybrid=False))  # fine for pure attention


def test_read_only_only_for_our_children():
    with pytest.raises(ConfigError, match=r"children\[0\].store=false"):
        check_children(parse_children({"children": [{**LMCACHE, "store": False}]}), kv_cache_config(False))
    check_children(parse_children({"children": [{**OURS, "store": False}]}), kv_cache_config(True))


def test_lmcache_attention_config_parses():
    import json

    from conftest import REPO

    kv = json.loads((REPO / "configs" / "attention-tiered-lmcache.json").read_text())
    children = parse_children(kv["kv_connector_extra_config"])
    assert children[0].ktc["kv_connector"] == "LMCacheConnectorV1"
    check_children(children, kv_cache_config(hybrid=False))
    with pytest.raises(ConfigError):
        check_children(children, kv_cache_config(hybrid=True))


def test_every_child_problem_is_listed_after_the_lists_own():
    with pytest.raises(ConfigError) as e:
        parse_children({"children": [{**OURS, "load_weight": True}, "x", {**OURS, "store": 1}]})
    assert str(e.value).splitlines() == [
        "kv_connector_extra_config.children[0].load_weight=True: must be a positive number (default 1.0)",
        "kv_connector_extra_config.children[1]: must be a kv-transfer-config object with a 'kv_connector' name",
        "kv_connector_extra_config.children[2].store=1: must be true or false"]
    with pytest.raises(ConfigError) as e:  # the list's own problem makes its children's moot
        parse_children({"children": ["x"], "connectors": []})
    assert str(e.value) == "kv_connector_extra_config: unknown keys ['connectors']; the only key is 'children'"


def test_a_childs_own_keys_pass_through_unchanged():
    raw = {"kv_connector": "X", "load_weight": 2, "kv_role": "kv_both", "extra": {"a": [1]}, "store": True}
    [c] = parse_children({"children": [raw]})
    assert c.ktc == {"kv_connector": "X", "kv_role": "kv_both", "extra": {"a": [1]}}
    assert list(c.ktc) == ["kv_connector", "kv_role", "extra"] and c.load_weight == 2.0
    assert type(c.load_weight) is float and c.store is True
