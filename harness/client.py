"""The client side of the harness: a free port, a completion, /metrics through prometheus_client's
parser, sums of samples, medians and polling with a deadline."""

from __future__ import annotations

import json
import math
import socket
import statistics
import time
import urllib.request
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from prometheus_client.parser import text_string_to_metric_families

from offload.engine_run import Samples

__all__ = ["Samples", "complete", "free_port", "median", "metric_by_label", "metric_sum", "parse_metrics",
           "scrape", "wait_until"]

T = TypeVar("T")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the caller's server binds it next)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(pred: Callable[[], T], timeout_s: float, what: str, interval_s: float = 0.05) -> T:
    """Poll `pred` until it returns a truthy value, which is returned; TimeoutError naming `what`
    after `timeout_s`. An exception from `pred` propagates (a server that died is not waited for)."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s:g} s")
        time.sleep(interval_s)


def parse_metrics(text: str) -> Samples:
    """Every sample of a Prometheus text exposition, through prometheus_client's parser."""
    return [(s.name, dict(s.labels), float(s.value)) for fam in text_string_to_metric_families(text)
            for s in fam.samples]


def scrape(base: str, timeout_s: float = 60) -> Samples:
    """Every sample of the server's /metrics."""
    with urllib.request.urlopen(f"{base}/metrics", timeout=timeout_s) as r:
        return parse_metrics(r.read().decode())


def metric_sum(samples: Samples, name: str, **labels: str) -> float:
    """Sum of `name`'s samples whose labels include `labels`."""
    return sum(v for n, lab, v in samples if n == name and all(lab.get(k) == want for k, want in labels.items()))


def metric_by_label(samples: Samples, name: str, label: str) -> dict[str, float]:
    """`name`'s samples summed per value of `label` ("" where a sample lacks it)."""
    out: dict[str, float] = {}
    for n, lab, v in samples:
        if n == name:
            out[lab.get(label, "")] = out.get(lab.get(label, ""), 0.0) + v
    return out


def complete(base: str, prompt: list[int], max_tokens: int = 4, *, model: str = "tiny", timeout_s: float = 300,
             **body: Any) -> dict:
    """One greedy `/v1/completions` request of token ids; `body` adds fields (e.g. ignore_eos,
    return_token_ids, logprobs). Returns the response's JSON."""
    data = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       **body}).encode()
    req = urllib.request.Request(f"{base}/v1/completions", data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read())


def median(xs: Iterable[float | None]) -> float:
    """The median of the values that are not None; NaN when there are none."""
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else math.nan
