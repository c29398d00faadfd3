"""Load generator for any OpenAI-compatible server (ours, vLLM's): a workload's requests, streamed, timed.

``run_bench`` builds the same requests ``kvbalance simulate`` would (``workloads.presets.build_requests``:
lengths, arrival times at ``rate``), turns each synthetic prompt into token ids inside the server's
vocabulary (a seeded hash of the synthetic ids, so prompts that share a prefix in the workload share it on
the wire too), sends streaming ``/v1/completions`` with ``ignore_eos`` and the request's ``max_tokens`` at
its arrival time, and records send, first-chunk, per-token and finish times on the ``Request`` objects.
A 429 is retried after its ``Retry-After`` (capped at ``max_retry_wait_s``, at most ``max_retries_429``
times; latencies keep counting from the first send, so waiting shows in TTFT) and counted as
``retries_429``. The summary is ``metrics.summary.summarize`` over them: the same keys as a simulation's.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvbalance.request import Request, RequestState

DEFAULT_VOCAB = 32_000
_MIX_1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX_2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def wire_token_ids(synthetic_ids, seed: int, vocab_size: int, low: int = 0) -> list[int]:
    """Map synthetic ids to ids in [low, vocab_size): a seeded splitmix64 hash, so equal ids stay equal."""
    if vocab_size <= low:
        raise ValueError(f"vocab_size: must be > {low}, got {vocab_size}")
    x = np.asarray(synthetic_ids, dtype=np.int64).astype(np.uint64)
    with np.errstate(over="ignore"):
        x = x + np.uint64(seed & 0xFFFFFFFF) * _GOLDEN
        x = (x ^ (x >> np.uint64(30))) * _MIX_1
        x = (x ^ (x >> np.uint64(27))) * _MIX_2
        x = x ^ (x >> np.uint64(31))
    return (x % np.uint64(vocab_size - low) + np.uint64(low)).astype(np.int64).tolist()


@dataclass
class ServerInfo:
    model: str | None
    vocab_size: int | None
    max_model_len: int | None


async def _server_info(client, base_url: str) -> ServerInfo:
    """Read the first model card of ``/v1/models`` (vLLM and we both give ``max_model_len``)."""
    try:
        r = await client.get(f"{base_url}/v1/models")
        r.raise_for_status()
        card = (r.json().get("data") or [{}])[0]
    except Exception:
        return ServerInfo(None, None, None)
    return ServerInfo(card.get("id"), card.get("vocab_size"), card.get("max_model_len"))


@dataclass
class RetryPolicy:
    """How the bench answers a 429: wait ``Retry-After`` (at most ``max_wait_s``), up to ``max_retries``."""

    max_retries: int = 3
    max_wait_s: float = 10.0
    retries: int = 0  # 429s retried so far, over the run


class _Overloaded(Exception):
    def __init__(self, retry_after_s: float, message: str) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


def _retry_after_s(value: str | None) -> float:
    try:
        return max(0.0, float(value)) if value is not None else 1.0
    except ValueError:  # an HTTP date: not worth parsing for a load generator
        return 1.0


async def _one(
    client, url: str, req: Request, payload: dict, t0: float, timeout_s: float, retry: RetryPolicy
) -> None:
    """Send one streaming completion at the request's arrival time and fill its timestamps."""
    delay = t0 + req.arrival_s - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    req.first_scheduled_s = time.perf_counter() - t0
    try:
        await asyncio.wait_for(_with_retries(client, url, req, payload, t0, retry), timeout_s)
    except asyncio.TimeoutError:
        req.state = RequestState.ABORTED
        req.reject_reason = f"timeout after {timeout_s:g} s"
        req.finish_s = time.perf_counter() - t0
    except Exception as exc:  # connection refused or reset, malformed stream, error event
        req.state = RequestState.REJECTED
        req.reject_reason = f"error: {type(exc).__name__}: {exc}"
        req.finish_s = time.perf_counter() - t0


async def _with_retries(client, url: str, req: Request, payload: dict, t0: float, retry: RetryPolicy) -> None:
    for attempt in range(retry.max_retries + 1):
        try:
            await _stream(client, url, req, payload, t0, last_try=attempt == retry.max_retries)
            return
        except _Overloaded as busy:
            retry.retries += 1
            await asyncio.sleep(min(busy.retry_after_s, retry.max_wait_s))


async def _stream(client, url: str, req: Request, payload: dict, t0: float, last_try: bool = True) -> None:
    count, usage_tokens = 0, None
    async with client.stream("POST", url, json=payload) as resp:
        if resp.status_code != 200:
            body = (await resp.aread()).decode("utf-8", "replace")
            try:
                message = json.loads(body)["error"]["message"]
            except Exception:
                message = body[:200]
            if resp.status_code == 429 and not last_try:
                raise _Overloaded(_retry_after_s(resp.headers.get("retry-after")), message)
            req.state = RequestState.REJECTED
            req.reject_reason = f"http {resp.status_code}: {message}"
            req.finish_s = time.perf_counter() - t0
            return
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            now = time.perf_counter() - t0
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(chunk["error"].get("message", "server error"))
            if chunk.get("usage"):
                usage_tokens = chunk["usage"].get("completion_tokens")
            for choice in chunk.get("choices") or []:
                ids = choice.get("token_ids")
                n = len(ids) if ids is not None else (1 if choice.get("text") else 0)
                if n and req.first_token_s is None:
                    req.first_token_s = now
                req.token_times_s.extend([now] * n)
                count += n
    if usage_tokens is not None and usage_tokens != count:
        count = usage_tokens  # a server that sends several tokens per text chunk without token_ids
    req.output_token_ids = [0] * count  # placeholders: the summary only counts them
    req.finish_s = time.perf_counter() - t0
    req.state = RequestState.FINISHED
    req.finish_reason = "length"


async def _scrape(client, base_url: str) -> dict[str, float]:
    """Our server's Prometheus samples (empty for servers without a kvbalance /metrics)."""
    from kvbalance.server.metrics import parse_prometheus_text

    try:
        r = await client.get(f"{base_url}/metrics")
        return parse_prometheus_text(r.text) if r.status_code == 200 else {}
    except Exception:
        return {}


def run_bench(
    base_url: str,
    num_requests: int = 100,
    rate: float = math.inf,
    workload: str = "sharegpt",
    seed: int = 0,
    model: str | None = None,
    max_context: int = 2048,
    out_dir: str | Path | None = None,
    *,
    vocab_size: int | None = None,
    timeout_s: float = 600.0,
    request_timeout_s: float | None = None,
    show_progress: bool = True,
    max_retries_429: int = 3,
    max_retry_wait_s: float = 10.0,
    api_key: str | None = None,
) -> dict[str, Any]:
    """Benchmark ``base_url`` with ``num_requests`` requests of ``workload`` arriving at ``rate`` req/s.

    ``max_context`` caps prompt + output (lowered to the server's ``max_model_len`` when it reports one);
    ``vocab_size`` defaults to the server's (else 32000). ``timeout_s`` bounds the whole run; requests
    still unanswered then count as aborted. ``api_key`` is sent as ``Authorization: Bearer`` on every
    request. Writes ``summary.json`` and ``requests.csv`` to ``out_dir``.
    """
    if not isinstance(num_requests, int) or isinstance(num_requests, bool) or num_requests < 1:
        raise ValueError(f"num_requests: must be an int >= 1, got {num_requests!r}")
    if not rate > 0:
        raise ValueError(f"rate: must be > 0 (inf = all at once), got {rate}")
    if not timeout_s > 0:
        raise ValueError(f"timeout: must be > 0, got {timeout_s}")
    if isinstance(max_retries_429, bool) or not isinstance(max_retries_429, int) or max_retries_429 < 0:
        raise ValueError(f"max_retries_429: must be an int >= 0, got {max_retries_429!r}")
    if not max_retry_wait_s >= 0:
        raise ValueError(f"max_retry_wait_s: must be >= 0, got {max_retry_wait_s}")
    return asyncio.run(
        _bench(
            base_url.rstrip("/"),
            num_requests,
            rate,
            workload,
            seed,
            model,
            max_context,
            out_dir,
            vocab_size,
            timeout_s,
            request_timeout_s or timeout_s,
            show_progress,
            RetryPolicy(max_retries_429, max_retry_wait_s),
            api_key,
        )
    )


async def _bench(
    base_url,
    num_requests,
    rate,
    workload,
    seed,
    model,
    max_context,
    out_dir,
    vocab_size,
    timeout_s,
    req_timeout_s,
    show,
    retry,
    api_key=None,
) -> dict[str, Any]:
    import httpx

    from kvbalance.metrics.summary import summarize, write_requests_csv, write_summary_json
    from kvbalance.workloads.presets import build_requests

    limits = httpx.Limits(max_connections=num_requests, max_keepalive_connections=num_requests)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    timeout = httpx.Timeout(req_timeout_s, connect=10.0)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers) as client:
        info = await _server_info(client, base_url)
        model = model or info.model
        if model is None:
            raise ValueError(f"model: {base_url}/v1/models did not name a model; pass one")
        vocab = vocab_size or info.vocab_size or DEFAULT_VOCAB
        if info.max_model_len:
            max_context = min(max_context, int(info.max_model_len))
        requests = build_requests(workload, num_requests, rate, seed, max_context)
        before = await _scrape(client, base_url)
        low = min(100, vocab // 10)  # keep clear of the special ids at the bottom of most vocabularies
        url = f"{base_url}/v1/completions"
        tasks = []
        t0 = time.perf_counter() + 0.01
        for req in requests:
            ids = wire_token_ids(req.prompt_token_ids[0 : req.num_prompt_tokens], seed, vocab, low)
            payload = {
                "model": model,
                "prompt": ids,
                "max_tokens": req.max_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            tasks.append(asyncio.ensure_future(_one(client, url, req, payload, t0, req_timeout_s, retry)))
        await _wait(tasks, timeout_s, show, num_requests)
        for req, task in zip(requests, tasks):
            if not task.done() or task.cancelled():
                req.state = RequestState.ABORTED
                req.reject_reason = f"bench timeout after {timeout_s:g} s"
        after = await _scrape(client, base_url)

    def delta(name: str) -> int | None:
        return int(after[name] - before.get(name, 0.0)) if name in after else None

    summary = summarize(
        requests,
        kv_capacity_tokens=int(after.get("kvbalance_kv_capacity_tokens", 0)),
        prefix_hit_tokens=delta("kvbalance_prefix_hit_tokens_total"),
        prompt_tokens_total=delta("kvbalance_prompt_tokens_total"),
        preemptions=delta("kvbalance_preemptions_total"),
        extra={
            "base_url": base_url,
            "model": model,
            "workload": workload,
            "rate": None if math.isinf(rate) else rate,
            "seed": seed,
            "max_context": max_context,
            "failures": sorted({r.reject_reason for r in requests if r.reject_reason}),
            "retries_429": retry.retries,
        },
    )
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        write_summary_json(out / "summary.json", summary)
        write_requests_csv(out / "requests.csv", requests)
    return summary


async def _wait(tasks: list[asyncio.Future], timeout_s: float, show: bool, total: int) -> None:
    """Wait for the tasks (cancelling the rest after ``timeout_s``), with a rich progress bar."""
    deadline = time.perf_counter() + timeout_s
    pending = set(tasks)

    async def drain(advance) -> None:
        nonlocal pending
        while pending:
            left = deadline - time.perf_counter()
            if left <= 0:
                break
            done, pending = await asyncio.wait(pending, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            advance(len(done))
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)

    if not show:
        await drain(lambda n: None)
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("bench"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, transient=True) as bar:
        task = bar.add_task("requests", total=total)
        await drain(lambda n: bar.advance(task, n))
