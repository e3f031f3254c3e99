"""Tests for offload/config.py: every bad kv_connector_extra_config fails at
start-up with a message naming the key, the value and what is valid."""

from __future__ import annotations

import json
import math

import pytest
from pydantic import ValidationError

from offload.config import ConfigError, OffloadConfig, parse_config

GOOD = {"store": "fs", "path": "/var/cache/kvoffload"}
VALID_KEYS = ["store", "path", "hybrid_chunk_size", "fsync", "io_threads", "max_pending_store_bytes",
              "shutdown_timeout_s", "model_id"]


def without(key: str) -> dict:
    return {k: v for k, v in GOOD.items() if k != key}


# (id, config, key the message must name, extra fragments the message must contain)
BAD = [
    ("missing-store", without("store"), "store", ["required", "'fs'"]),
    ("store-s3", {**GOOD, "store": "s3"}, "store", ["'s3'", "'fs'"]),
    ("store-FS-case", {**GOOD, "store": "FS"}, "store", ["'FS'"]),
    ("missing-path", without("path"), "path", ["required", "absolute"]),
    ("relative-path", {**GOOD, "path": "cache/kv"}, "path", ["'cache/kv'", "absolute"]),
    ("dot-relative-path", {**GOOD, "path": "./cache"}, "path", ["absolute"]),
    ("empty-path", {**GOOD, "path": ""}, "path", ["absolute"]),
    ("dotdot-path", {**GOOD, "path": "/var/cache/../../etc"}, "path", ["'..'"]),
    ("trailing-dotdot", {**GOOD, "path": "/var/cache/.."}, "path", ["'..'"]),
    ("path-not-str", {**GOOD, "path": 5}, "path", []),
    ("path-regular-file", {**GOOD, "path": "/proc/version"}, "path",
     ["'/proc/version'", "regular file", "choose a directory"]),
    ("path-char-device", {**GOOD, "path": "/dev/null"}, "path", ["'/dev/null'", "character device",
                                                                  "choose a directory"]),
    ("path-under-a-file", {**GOOD, "path": "/proc/version/kv"}, "path",
     ["/proc/version is a regular file", "choose a directory"]),
    ("typo-key", {**GOOD, "hybird_chunk_size": 256}, "hybird_chunk_size", ["unknown key", *VALID_KEYS]),
    ("unknown-key", {**GOOD, "bucket": "x"}, "bucket", ["unknown key", *VALID_KEYS]),
    ("chunk-0", {**GOOD, "hybrid_chunk_size": 0}, "hybrid_chunk_size", ["greater than 0", "tokens per chunk"]),
    ("chunk-neg", {**GOOD, "hybrid_chunk_size": -1}, "hybrid_chunk_size", ["=-1", "greater than 0"]),
    ("chunk-str", {**GOOD, "hybrid_chunk_size": "256"}, "hybrid_chunk_size", ["'256'", "integer"]),
    ("chunk-float", {**GOOD, "hybrid_chunk_size": 2.5}, "hybrid_chunk_size", ["2.5", "integer"]),
    ("chunk-float-integral", {**GOOD, "hybrid_chunk_size": 256.0}, "hybrid_chunk_size", ["integer"]),
    ("chunk-bool", {**GOOD, "hybrid_chunk_size": True}, "hybrid_chunk_size", ["True"]),
    ("fsync-yes", {**GOOD, "fsync": "yes"}, "fsync", ["'yes'", "boolean"]),
    ("fsync-1", {**GOOD, "fsync": 1}, "fsync", ["boolean"]),
    ("direct-reads-yes", {**GOOD, "direct_reads": "yes"}, "direct_reads", ["'yes'", "boolean", "O_DIRECT"]),
    ("direct-reads-on-cpu", {"store": "cpu", "cpu_bytes": 1 << 30, "direct_reads": False}, "direct_reads",
     ["only for store 'fs'"]),
    ("io-threads-0", {**GOOD, "io_threads": 0}, "io_threads", ["=0", "greater than or equal to 1"]),
    ("io-threads-1000", {**GOOD, "io_threads": 1000}, "io_threads", ["=1000", "less than or equal to 64"]),
    ("io-threads-str", {**GOOD, "io_threads": "4"}, "io_threads", ["'4'"]),
    ("pending-1", {**GOOD, "max_pending_store_bytes": 1}, "max_pending_store_bytes", ["=1:", str(1 << 20)]),
    ("pending-neg", {**GOOD, "max_pending_store_bytes": -5}, "max_pending_store_bytes", ["=-5"]),
    ("timeout-neg", {**GOOD, "shutdown_timeout_s": -1}, "shutdown_timeout_s", ["=-1", "greater than or equal to 0"]),
    ("timeout-nan", {**GOOD, "shutdown_timeout_s": math.nan}, "shutdown_timeout_s", []),
    ("timeout-inf", {**GOOD, "shutdown_timeout_s": math.inf}, "shutdown_timeout_s", []),
    ("timeout-huge", {**GOOD, "shutdown_timeout_s": 1e300}, "shutdown_timeout_s", []),
    ("timeout-str", {**GOOD, "shutdown_timeout_s": "60"}, "shutdown_timeout_s", ["'60'"]),
    ("model-id-empty", {**GOOD, "model_id": ""}, "model_id", ["=''", "at least 1 character"]),
    ("model-id-int", {**GOOD, "model_id": 7}, "model_id", ["=7"]),
]


@pytest.mark.parametrize("cfg,key,fragments", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_config_names_key_value_and_fix(cfg, key, fragments):
    with pytest.raises(ConfigError) as ei:
        parse_config(cfg)
    msg = str(ei.value)
    assert f"kv_connector_extra_config.{key}" in msg, msg
    for frag in fragments:
        assert frag in msg, (frag, msg)
    # The message is for an operator: no pydantic URL noise, no traceback chain.
    assert "errors.pydantic.dev" not in msg
    assert ei.value.__cause__ is None and ei.value.__suppress_context__


@pytest.mark.parametrize("extra", [[], ["store", "fs"], None, "store=fs", 42, json.dumps(GOOD)],
                         ids=["empty-list", "list", "None", "string", "int", "json-string"])
def test_non_dict_config_is_rejected(extra):
    with pytest.raises(ConfigError) as ei:
        parse_config(extra)
    msg = str(ei.value)
    assert "kv_connector_extra_config" in msg
    assert "object" in msg
    assert type(extra).__name__ in msg


def test_every_problem_is_listed_at_once():
    with pytest.raises(ConfigError) as ei:
        parse_config({"store": "s3", "path": "rel", "io_threads": 0, "hybird_chunk_size": 1})
    msg = str(ei.value)
    for key in ("store", "path", "io_threads", "hybird_chunk_size"):
        assert f"kv_connector_extra_config.{key}" in msg, msg
    assert len(msg.strip().splitlines()) == 5  # title + one line per problem


def test_good_config_defaults():
    cfg = parse_config(dict(GOOD))
    assert isinstance(cfg, OffloadConfig)
    [tier] = cfg.tiers  # the one-tier form is a stack of one
    assert tier.store == "fs" and tier.tier_name == "fs"
    assert tier.path == "/var/cache/kvoffload"
    assert cfg.hybrid_chunk_size is None
    assert tier.fsync is False
    assert tier.direct_reads is True and tier.options().direct_reads is True
    assert cfg.io_threads == 16
    assert cfg.max_pending_store_bytes == 1 << 30
    assert cfg.shutdown_timeout_s == 60.0
    assert cfg.model_id is None


@pytest.mark.parametrize("raw,norm", [
    ("/var/cache/kvoffload/", "/var/cache/kvoffload"),
    ("/var//cache/./kvoffload", "/var/cache/kvoffload"),
    ("/", "/"),
])
def test_path_is_normalized(raw, norm):
    assert parse_config({**GOOD, "path": raw}).tiers[0].path == norm


def test_good_config_all_keys_from_json():
    # As it arrives from --kv-transfer-config: JSON numbers and booleans.
    text = json.dumps({"store": "fs", "path": "/mnt/nfs/kv", "hybrid_chunk_size": 512, "fsync": True,
                       "io_threads": 64, "max_pending_store_bytes": 1 << 20, "shutdown_timeout_s": 0,
                       "model_id": "qwen3-next"})
    cfg = parse_config(json.loads(text))
    assert (cfg.hybrid_chunk_size, cfg.tiers[0].fsync, cfg.io_threads) == (512, True, 64)
    assert parse_config({**GOOD, "direct_reads": True}).tiers[0].options().direct_reads is True
    assert cfg.max_pending_store_bytes == 1 << 20
    assert cfg.shutdown_timeout_s == 0.0 and cfg.model_id == "qwen3-next"
    assert parse_config({**GOOD, "io_threads": 1}).io_threads == 1
    assert parse_config({**GOOD, "shutdown_timeout_s": 2.5}).shutdown_timeout_s == 2.5
    assert parse_config({**GOOD, "hybrid_chunk_size": None}).hybrid_chunk_size is None


def test_config_is_frozen():
    cfg = parse_config(dict(GOOD))
    with pytest.raises(ValidationError):
        cfg.io_threads = 8  # type: ignore[misc]


def test_parse_does_not_mutate_input():
    extra = {**GOOD, "path": "/a//b/"}
    snapshot = dict(extra)
    parse_config(extra)
    assert extra == snapshot


STACK = {"tiers": [{"store": "cpu", "cpu_bytes": 1 << 30}, {"store": "fs", "path": "/var/cache/kvoffload"}]}

# (id, config, key path the message must name, fragments)
BAD_STACK = [
    ("tier-path-relative", {"tiers": [STACK["tiers"][0], {"store": "fs", "path": "rel"}]}, "tiers[1].path",
     ["'rel'", "absolute"]),
    ("tier-unknown-key", {"tiers": [{**STACK["tiers"][0], "bucket": 1}]}, "tiers[0].bucket",
     ["unknown key", "cpu_bytes"]),
    ("tier-store-missing", {"tiers": [{"cpu_bytes": 1 << 30}]}, "tiers[0].store", ["required", "'fs'"]),
    ("tier-key-at-top", {**STACK, "path": "/x"}, "path", ["tiers[i]"]),
    ("tiers-empty", {"tiers": []}, "tiers", ["at least 1"]),
    ("same-name", {"tiers": [STACK["tiers"][1], {"store": "fs", "path": "/other"}]}, "tiers[1].name",
     ["distinct"]),
    ("same-path", {"tiers": [STACK["tiers"][1], {**STACK["tiers"][1], "name": "b"}]}, "tiers[1].path",
     ["one directory per tier"]),
    ("tier-mixed-keys", {"tiers": [{"store": "cpu", "cpu_bytes": 1 << 30, "path": "/x"}]}, "tiers[0].path",
     ['"store": "fs"']),
]


@pytest.mark.parametrize("cfg,key,fragments", [b[1:] for b in BAD_STACK], ids=[b[0] for b in BAD_STACK])
def test_bad_stack_names_the_tier_key(cfg, key, fragments):
    test_bad_config_names_key_value_and_fix(cfg, key, fragments)


def test_stack_form():
    cfg = parse_config({**STACK, "io_threads": 2})
    assert [t.tier_name for t in cfg.tiers] == ["cpu", "fs"] and cfg.io_threads == 2
    assert cfg.tiers[0].options().cpu_bytes == 1 << 30
    assert cfg.tiers[1].options().path == "/var/cache/kvoffload"
    assert cfg.tiers[1].options().file_mode == 0o640


# ---- the tier members are the stores' own options -------------------------------------------


def test_tiers_are_the_stores_options():
    from offload.store.options import CpuOptions, FsOptions

    cfg = parse_config({**STACK})
    assert type(cfg.tiers[0]) is CpuOptions and type(cfg.tiers[1]) is FsOptions
    assert cfg.tiers[1].options() is cfg.tiers[1]
    assert cfg.tiers[1] == FsOptions(path="/var/cache/kvoffload")
    # `name` labels a tier; two tiers with the same options are the same store's options (LMCache shares its
    # engine per options), whatever they are called.
    named = parse_config({"tiers": [{"store": "cpu", "cpu_bytes": 1 << 30, "name": "hot"}]}).tiers[0]
    assert named.tier_name == "hot" and named == cfg.tiers[0] and hash(named) == hash(cfg.tiers[0])


@pytest.mark.parametrize("text,value", [
    ("512MiB", 512 << 20), ("512M", 512 << 20), ("512mb", 512 << 20), ("2GB", 2 << 30), ("1.5G", 3 << 29),
    ("3 GiB", 3 << 30), ("1073741824", 1 << 30), ("1T", 1 << 40),
])
def test_byte_sizes_take_units_in_the_json_as_on_the_command_line(text, value):
    from offload.cli.gc import parse_size

    assert parse_size(text) == value  # `kvoffload gc --max-bytes`: the same type
    fs_cfg = parse_config({**GOOD, "max_bytes": text, "max_pending_store_bytes": text})
    assert fs_cfg.tiers[0].max_bytes == value and fs_cfg.max_pending_store_bytes == value
    assert parse_config({"store": "cpu", "cpu_bytes": text}).tiers[0].cpu_bytes == value
    lm = parse_config({"store": "lmcache", "local_cpu_bytes": text}).tiers[0]
    assert lm.options().local_cpu_bytes == value


@pytest.mark.parametrize("key,cfg,fragments", [
    ("max_bytes", {**GOOD, "max_bytes": "lots"}, ["'lots'", "K, M, G", "1 MiB to 1 PiB"]),
    ("max_bytes", {**GOOD, "max_bytes": "512KiB"}, ["'512KiB'", str(1 << 20)]),  # parsed, then bounded
    ("max_bytes", {**GOOD, "max_bytes": "-1G"}, ["'-1G'"]),
    ("max_bytes", {**GOOD, "max_bytes": 1.5e9}, ["1500000000.0", "integer"]),
    ("max_bytes", {**GOOD, "max_bytes": True}, ["True"]),
    ("cpu_bytes", {"store": "cpu", "cpu_bytes": "8 gigs"}, ["'8 gigs'", "host memory"]),
    ("max_pending_store_bytes", {**GOOD, "max_pending_store_bytes": "1K"}, ["'1K'", str(1 << 20)]),
])
def test_bad_byte_sizes_name_key_value_and_fix(key, cfg, fragments):
    test_bad_config_names_key_value_and_fix(cfg, key, fragments)


def test_keys_every_tier_took_still_parse_on_stores_that_ignore_them():
    """Configs written when one flat model held every store's keys keep their meaning: a key a store
    never used is accepted there with no effect, once its value passes its own store's check."""
    from offload.store.options import CpuOptions, LMCacheOptions

    cpu = parse_config({"store": "cpu", "cpu_bytes": 1 << 30, "fsync": True, "file_mode": "0660",
                        "dir_mode": "0770", "orphan_tmp_age_s": 600, "reconcile_interval_s": 600,
                        "remote_timeout_s": 1}).tiers[0]
    assert cpu == CpuOptions(1 << 30)
    lm = parse_config({"store": "lmcache", "local_cpu_bytes": 1 << 26, "fsync": True}).tiers[0]
    assert lm == LMCacheOptions(1 << 26)
    assert parse_config({**GOOD, "remote_timeout_s": 5}).tiers[0] == parse_config(dict(GOOD)).tiers[0]
    for bad, key in (({"file_mode": "0666"}, "file_mode"), ({"remote_timeout_s": 0}, "remote_timeout_s"),
                     ({"fsync": "yes"}, "fsync")):
        with pytest.raises(ConfigError) as ei:
            parse_config({"store": "cpu", "cpu_bytes": 1 << 30, **bad})
        assert f"kv_connector_extra_config.{key}={bad[key]!r}" in str(ei.value), str(ei.value)


@pytest.mark.parametrize("cfg,line", [
    ({**GOOD, "cpu_bytes": 1 << 30}, "cpu_bytes: only for store 'cpu'; remove it, or set \"store\": \"cpu\""),
    ({**GOOD, "local_cpu_bytes": 1 << 30}, "local_cpu_bytes: only for store 'lmcache'"),
    ({"store": "cpu", "cpu_bytes": 1 << 30, "max_bytes": 1 << 30}, "max_bytes: only for store 'fs'"),
    ({"store": "lmcache", "local_cpu_bytes": 1 << 26, "direct_reads": True}, "direct_reads: only for store 'fs'"),
    ({"store": "lmcache", "local_cpu_bytes": 1 << 26, "timeout_s": 1.0}, "timeout_s: unknown key"),
])
def test_a_key_of_another_store_is_refused_naming_its_store(cfg, line):
    with pytest.raises(ConfigError) as ei:
        parse_config(cfg)
    assert f"kv_connector_extra_config.{line}" in str(ei.value), str(ei.value)


def test_unknown_store_still_checks_the_other_keys():
    with pytest.raises(ConfigError) as ei:
        parse_config({"tiers": [{"store": "s3", "cpu_bytes": 5, "max_bytes": "lots", "bucket": 1}]})
    msg = str(ei.value)
    for frag in ("tiers[0].store='s3'", "tiers[0].cpu_bytes=5", "tiers[0].max_bytes='lots'", "tiers[0].bucket"):
        assert f"kv_connector_extra_config.{frag}" in msg, msg
    assert len(msg.strip().splitlines()) == 5
