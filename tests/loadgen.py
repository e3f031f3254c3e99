"""A small asyncio load generator for a vLLM OpenAI server, with client aborts.

`vllm bench serve` is a real client, but it returns only texts and cannot hang
up on purpose. This one sends prompts as token ids to `/v1/completions`, keeps
up to `concurrency` requests in flight, and returns per request the generated
token ids (`return_token_ids`), vLLM's `usage` and `kv_transfer_params` (where
each offload tier reports the tokens it restored for that request), or, for a
request the client was told to abandon, that it hung up and when. Hanging up
closes the TCP connection, which is what vLLM sees when a user closes a tab:
the server aborts the request (`finished_reason="abort"` in its metrics).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    max_tokens: int
    # Streaming requests can be abandoned after their n-th token; any request
    # can be abandoned after a delay (seconds from its send). None: read to the end.
    stream: bool = False
    cancel_after_tokens: int | None = None
    cancel_after_s: float | None = None
    tag: str = ""  # free text for the caller (e.g. "warm", "load", "abort")


@dataclass
class Result:
    index: int
    request: Request
    request_id: str = ""  # sent as X-Request-Id: vLLM names the request after it
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    aborted: bool = False  # the client hung up before the end
    error: str | None = None  # HTTP status or exception: a failed request
    start_s: float = 0.0
    ttft_s: float | None = None
    end_s: float = 0.0

    @property
    def complete(self) -> bool:
        return not self.aborted and self.error is None and self.finish_reason is not None

    def restored_tokens(self) -> int:
        """Tokens the offload tiers restored for this request, by its own report."""
        params = self.kv_transfer_params or {}
        return sum(v.get("restored_tokens", 0) for k, v in params.items() if k.startswith("kvoffload:"))

    def vllm_sub_block_hit(self) -> bool:
        """Whether, by our connector's report, vLLM's own prefix cache started or resumed this request
        inside a block (offload/connector/scheduler.py, `request_finished`)."""
        params = self.kv_transfer_params or {}
        return any(v.get("vllm_sub_block_hit") for k, v in params.items() if k.startswith("kvoffload:"))


class _HangUp(Exception):
    pass


@dataclass
class LoadReport:
    results: list[Result]
    peak_in_flight: int
    wall_s: float

    @property
    def failed(self) -> list[Result]:
        return [r for r in self.results if r.error is not None]

    @property
    def aborted(self) -> list[Result]:
        return [r for r in self.results if r.aborted]


def _body(req: Request) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "tiny", "prompt": req.prompt, "max_tokens": req.max_tokens,
                            "temperature": 0, "ignore_eos": True, "return_token_ids": True,
                            "stream": req.stream}
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def _one(session: aiohttp.ClientSession, url: str, i: int, req: Request, t0: float) -> Result:
    res = Result(i, req, f"lg{uuid.uuid4().hex[:16]}", start_s=time.monotonic() - t0)
    resp = None
    try:
        resp = await session.post(url, json=_body(req), headers={"X-Request-Id": res.request_id})
        if resp.status != 200:
            res.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
            return res
        if not req.stream:
            out = await resp.json()
            choice = out["choices"][0]
            res.token_ids = list(choice.get("token_ids") or [])
            res.text = choice.get("text") or ""
            res.finish_reason = choice.get("finish_reason")
            res.usage = out.get("usage")
            res.kv_transfer_params = out.get("kv_transfer_params")
            return res
        buf = b""
        async for raw in resp.content:
            buf += raw
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    return res
                msg = json.loads(data)
                if msg.get("error"):
                    res.error = f"stream error: {msg['error']}"
                    return res
                if msg.get("usage"):
                    res.usage = msg["usage"]
                for choice in msg.get("choices") or ():
                    res.token_ids += list(choice.get("token_ids") or [])
                    res.text += choice.get("text") or ""
                    if choice.get("finish_reason"):
                        res.finish_reason = choice["finish_reason"]
                    if res.ttft_s is None and choice.get("token_ids"):
                        res.ttft_s = time.monotonic() - t0 - res.start_s
                if req.cancel_after_tokens is not None and len(res.token_ids) >= req.cancel_after_tokens \
                        and res.finish_reason is None:
                    raise _HangUp
        if res.finish_reason is None:
            res.error = "stream ended without a finish reason"
        return res
    except (_HangUp, asyncio.CancelledError):
        res.aborted = True
        if resp is not None:
            resp.close()  # drop the connection: the server sees the client go away
        return res
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError, KeyError) as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    finally:
        res.end_s = time.monotonic() - t0
        if resp is not None:
            resp.release()


async def _send(session: aiohttp.ClientSession, url: str, i: int, req: Request, t0: float) -> Result:
    """One request, hung up on after `req.cancel_after_s` if it has not ended by then."""
    task = asyncio.ensure_future(_one(session, url, i, req, t0))
    if req.cancel_after_s is None:
        return await task
    done, _ = await asyncio.wait({task}, timeout=req.cancel_after_s)
    if not done:
        task.cancel()
    return await task


async def _run(base: str, reqs: list[Request], concurrency: int, timeout_s: float) -> LoadReport:
    url = f"{base}/v1/completions"
    sem = asyncio.Semaphore(concurrency)
    in_flight = 0
    peak = 0
    t0 = time.monotonic()
    # One connection per request in flight: no pipelining, and a hang-up closes only its own.
    conn = aiohttp.TCPConnector(limit=concurrency, force_close=True)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:

        async def guarded(i: int, req: Request) -> Result:
            nonlocal in_flight, peak
            async with sem:
                in_flight += 1
                peak = max(peak, in_flight)
                try:
                    return await _send(session, url, i, req, t0)
                finally:
                    in_flight -= 1

        results = await asyncio.gather(*(guarded(i, r) for i, r in enumerate(reqs)))
    return LoadReport(list(results), peak, time.monotonic() - t0)


def run_load(base: str, reqs: list[Request], concurrency: int, timeout_s: float = 900) -> LoadReport:
    """Send every request, at most `concurrency` at a time; results in request order."""
    return asyncio.run(_run(base, reqs, concurrency, timeout_s))


# A client: given the results of its requests so far (in order), its next request, or None when done.
# Clients that depend on their answers (a conversation's next turn is the previous prompt, the answer
# the client received and a new message) cannot be a list of requests made up front.
Client = Callable[[list[Result]], "Request | None"]


async def _run_clients(base: str, clients: list[Client], timeout_s: float) -> LoadReport:
    url = f"{base}/v1/completions"
    results: list[Result] = []
    in_flight = peak = 0
    t0 = time.monotonic()
    conn = aiohttp.TCPConnector(limit=len(clients), force_close=True)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:

        async def drive(client: Client) -> None:
            nonlocal in_flight, peak
            mine: list[Result] = []
            while (req := client(mine)) is not None:
                i = len(results)
                results.append(Result(i, req))  # its place, in order of sending
                in_flight += 1
                peak = max(peak, in_flight)
                try:
                    res = await _send(session, url, i, req, t0)
                finally:
                    in_flight -= 1
                results[i] = res
                mine.append(res)

        await asyncio.gather(*(drive(c) for c in clients))
    return LoadReport(results, peak, time.monotonic() - t0)


def run_clients(base: str, clients: list[Client], timeout_s: float = 900) -> LoadReport:
    """Run every client at once, each one request at a time; results in order of sending."""
    return asyncio.run(_run_clients(base, clients, timeout_s))

