"""The client harness tests/ and bench/ share (harness/client.py): Prometheus text through
prometheus_client's parser, sums of samples, medians, polling with a deadline, a free port; and the
OpenMP layout the session gives the engines it starts (conftest.py)."""

from __future__ import annotations

import json
import math
import os
import re
import socket
import subprocess
import sys

import pytest

from conftest import SESSION_CORES
from harness.client import free_port, median, metric_by_label, metric_sum, parse_metrics, wait_until

# The shapes vLLM's /metrics has: a colon in the name, a counter's _total and _created, a histogram,
# a label value with an escaped quote, a gauge without labels.
EXPOSITION = """\
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="tiny"} 1280.0
vllm:prompt_tokens_created{engine="0",model_name="tiny"} 1.7e+09
# HELP kvoffload_restored_tokens_total Prompt tokens restored from the tier.
# TYPE kvoffload_restored_tokens_total counter
kvoffload_restored_tokens_total{connector="OffloadConnector",tier="cpu",model_name="a \\"b\\""} 512.0
kvoffload_restored_tokens_total{connector="OffloadConnector",tier="fs",model_name="a \\"b\\""} 256.0
# HELP kvoffload_load_seconds Time to restore one request's hit.
# TYPE kvoffload_load_seconds histogram
kvoffload_load_seconds_bucket{le="0.1",tier="cpu"} 3.0
kvoffload_load_seconds_bucket{le="+Inf",tier="cpu"} 4.0
kvoffload_load_seconds_count{tier="cpu"} 4.0
kvoffload_load_seconds_sum{tier="cpu"} 0.5
# HELP process_open_fds Number of open file descriptors.
# TYPE process_open_fds gauge
process_open_fds 17.0
"""


def test_parse_metrics_keeps_exported_names_labels_and_values():
    s = parse_metrics(EXPOSITION)
    assert ("vllm:prompt_tokens_total", {"engine": "0", "model_name": "tiny"}, 1280.0) in s
    assert ("process_open_fds", {}, 17.0) in s
    assert {lab["model_name"] for n, lab, _ in s if n == "kvoffload_restored_tokens_total"} == {'a "b"'}
    assert metric_sum(s, "kvoffload_load_seconds_bucket", le="+Inf") == 4.0
    assert metric_sum(s, "kvoffload_load_seconds_sum") == 0.5
    assert len(s) == 9


def test_metric_sum_and_by_label():
    s = parse_metrics(EXPOSITION)
    assert metric_sum(s, "kvoffload_restored_tokens_total") == 768.0
    assert metric_sum(s, "kvoffload_restored_tokens_total", tier="fs") == 256.0
    assert metric_sum(s, "kvoffload_restored_tokens_total", tier="disk") == 0.0
    assert metric_by_label(s, "kvoffload_restored_tokens_total", "tier") == {"cpu": 512.0, "fs": 256.0}
    assert metric_by_label(s, "process_open_fds", "tier") == {"": 17.0}


def test_parse_metrics_rejects_a_malformed_line():
    with pytest.raises(ValueError):
        parse_metrics('kvoffload_lookups_total{tier="cpu" 1.0\n')


def test_median_skips_none_and_is_nan_on_nothing():
    assert median([3.0, None, 1.0, 2.0]) == 2.0
    assert median([4.0, 1.0]) == 2.5
    assert math.isnan(median([])) and math.isnan(median([None]))


def test_wait_until_returns_the_first_truthy_value():
    calls = []

    def pred():
        calls.append(1)
        return len(calls) >= 3 and ["done"]

    assert wait_until(pred, 5, "three calls", interval_s=0.001) == ["done"]
    assert len(calls) == 3


def test_wait_until_times_out_naming_what_it_waited_for():
    with pytest.raises(TimeoutError, match=re.escape("the moon: not within 0.05 s")):
        wait_until(lambda: False, 0.05, "the moon", interval_s=0.01)


def test_wait_until_passes_a_predicates_error_on():
    def pred():
        raise RuntimeError("the server exited")

    with pytest.raises(RuntimeError, match="the server exited"):
        wait_until(pred, 5, "never")


def test_free_port_can_be_bound():
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_the_session_and_the_processes_it_starts_keep_every_core():
    """OpenMP binds the thread that loads it to its first place, and whatever that thread starts
    inherits the binding. Under the session's engine settings, this process, a process that loads
    both OpenMP runtimes of the environment (torch's, sentencepiece's) and one that process starts
    may all run on every core the session was given: engines in parallel use them all."""
    child = ("import os, subprocess, sys, json, sentencepiece, torch\n"
             "torch.ones(64, 64) @ torch.ones(64, 64)\n"
             "grand = subprocess.run([sys.executable, '-c', 'import os; print(sorted(os.sched_getaffinity(0)))'],"
             " capture_output=True, text=True, check=True).stdout\n"
             "print(json.dumps([sorted(os.sched_getaffinity(0)), json.loads(grand)]))\n")
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, check=True, timeout=120)
    own, grand = json.loads(out.stdout.splitlines()[-1])
    assert os.sched_getaffinity(0) == SESSION_CORES
    assert set(own) == set(grand) == SESSION_CORES, (own, grand, sorted(SESSION_CORES))
