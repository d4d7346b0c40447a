"""Async load generator for an OpenAI-compatible `/v1/completions` endpoint.

Sends each `TraceRequest` at its arrival time (open loop, as vLLM's
benchmarks/benchmark_serving.py does), streams the answer and records per request the send
time, TTFT, the gap between streamed chunks (ITL), E2E and the output token count. A run is
bounded by its request count and by an optional deadline after which outstanding requests
are cancelled and recorded as unfinished (or not sent).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from weaver.bench.prompts import synthetic_prompt
from weaver.results.records import RequestRecord, RequestStatus
from weaver.workloads.types import TraceRequest

logger = logging.getLogger(__name__)

_MAX_ERROR_CHARS = 500
_LATE_WARNING_S = 0.1


@dataclass
class LoadGenConfig:
    base_url: str  # e.g. http://127.0.0.1:8000 (with or without a trailing /v1)
    api_key: str | None = None  # sent as `Authorization: Bearer ...`
    max_concurrency: int | None = None  # None: no cap (pure open loop)
    duration_s: float | None = None  # deadline from the run's start; None: none
    request_timeout_s: float = 600.0
    # vLLM's extras make every request generate exactly output_tokens tokens; a strict
    # OpenAI server rejects unknown fields, so they can be turned off.
    send_vllm_extras: bool = True
    temperature: float = 0.0
    show_progress: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)
    # Varies the prompt texts, not their lengths (weaver.bench.prompts): runs that send the
    # same requests to one server take different salts, so no run hits the prefix cache
    # another one filled.
    prompt_salt: int = 0
    # Gauges of the server's /metrics sampled during the run (weaver.bench.scrape), every
    # scrape_interval_s seconds; none: no scraping.
    scrape_metrics: tuple[str, ...] = ()
    scrape_interval_s: float = 1.0

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"--url {self.base_url!r} must start with http:// or https://")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError(f"--duration-s must be > 0 seconds, got {self.duration_s}")
        if not self.request_timeout_s > 0:
            raise ValueError(f"request timeout must be > 0 s, got {self.request_timeout_s}")
        if not self.scrape_interval_s > 0:
            raise ValueError(f"--scrape-interval-s must be > 0, got {self.scrape_interval_s}")
        self.scrape_metrics = tuple(self.scrape_metrics)

    @property
    def completions_url(self) -> str:
        base = self.base_url.rstrip("/")
        return (base if base.endswith("/v1") else base + "/v1") + "/completions"

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["api_key"] = "***" if self.api_key else None  # never write secrets to results
        return data


@dataclass
class LoadGenOutcome:
    records: list[RequestRecord]
    started_at_unix: float
    duration_s: float  # wall time from the start to the last request's end (or deadline)


def build_payload(request: TraceRequest, config: LoadGenConfig) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "model": request.model,
        "prompt": synthetic_prompt(request.input_tokens, request.request_id,
                                   config.prompt_salt),
        "max_tokens": request.output_tokens,
        "temperature": config.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if config.send_vllm_extras:
        payload.update(ignore_eos=True, min_tokens=request.output_tokens)
    payload.update(config.extra_body)
    return payload


class _Tracker:
    """Mutable timings of one request while it runs; frozen into a RequestRecord at the end
    (also when cancelled, so partial timings survive the deadline)."""

    def __init__(self, request: TraceRequest) -> None:
        self.request = request
        self.sent_at: float | None = None  # perf_counter
        self.first_at: float | None = None
        self.last_at: float | None = None
        self.end_at: float | None = None
        self.itl: list[float] = []
        self.num_chunks = 0
        self.usage_completion: int | None = None
        self.usage_prompt: int | None = None
        self.status = RequestStatus.NOT_SENT
        self.error: str | None = None

    def on_text_chunk(self, now: float) -> None:
        if self.first_at is None:
            self.first_at = now
        if self.last_at is not None:
            self.itl.append(now - self.last_at)
        self.last_at = now
        self.num_chunks += 1

    def to_record(self, start: float) -> RequestRecord:
        sent = self.sent_at
        e2e = None
        if self.status is RequestStatus.OK and sent is not None and self.end_at is not None:
            e2e = self.end_at - sent
        return RequestRecord(
            request_id=self.request.request_id,
            model=self.request.model,
            input_tokens=self.request.input_tokens,
            output_tokens=self.request.output_tokens,
            scheduled_at_s=self.request.arrival_s,
            sent_at_s=None if sent is None else sent - start,
            ttft_s=None if sent is None or self.first_at is None else self.first_at - sent,
            e2e_s=e2e,
            itl_s=self.itl,
            num_output_tokens=(
                self.usage_completion if self.usage_completion is not None else self.num_chunks
            ),
            num_prompt_tokens=self.usage_prompt,
            status=self.status,
            error=self.error,
        )


async def _stream_one(
    client: httpx.AsyncClient, tracker: _Tracker, config: LoadGenConfig
) -> None:
    payload = build_payload(tracker.request, config)
    tracker.sent_at = time.perf_counter()
    tracker.status = RequestStatus.UNFINISHED
    async with client.stream("POST", config.completions_url, json=payload) as response:
        if response.status_code != 200:
            body = (await response.aread()).decode("utf-8", "replace")
            # Retry-After kept: a 429 or 503 without it tells the client nothing about when
            # to come back (benchmarks/soak.py counts those apart).
            retry_after = response.headers.get("retry-after")
            retry = "" if retry_after is None else f" (Retry-After: {retry_after})"
            raise RuntimeError(f"HTTP {response.status_code}{retry}: {body[:_MAX_ERROR_CHARS]}")
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue  # SSE comments, blank keep-alives
            data = line[len("data:") :].strip()
            if data == "[DONE]":
                break
            _on_event(tracker, json.loads(data), time.perf_counter())
    tracker.end_at = time.perf_counter()
    if tracker.num_chunks == 0:
        raise RuntimeError("the stream ended without any generated text")
    tracker.status = RequestStatus.OK


def _on_event(tracker: _Tracker, event: dict[str, Any], now: float) -> None:
    if "error" in event:
        raise RuntimeError(f"server error in stream: {str(event['error'])[:_MAX_ERROR_CHARS]}")
    # Only chunks that carry text are token events: a trailing usage-only chunk or an
    # empty finish chunk would otherwise add a spurious inter-token gap.
    if any(choice.get("text") for choice in event.get("choices") or []):
        tracker.on_text_chunk(now)
    usage = event.get("usage")
    if usage:
        tracker.usage_completion = usage.get("completion_tokens", tracker.usage_completion)
        tracker.usage_prompt = usage.get("prompt_tokens", tracker.usage_prompt)


async def _run_one(
    client: httpx.AsyncClient,
    tracker: _Tracker,
    config: LoadGenConfig,
    start: float,
    limiter: asyncio.Semaphore | None,
) -> None:
    delay = start + tracker.request.arrival_s - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    try:
        if limiter is None:
            await _stream_one(client, tracker, config)
        else:
            async with limiter:
                await _stream_one(client, tracker, config)
    except asyncio.CancelledError:
        raise  # the deadline: the tracker keeps NOT_SENT or UNFINISHED
    except Exception as exc:
        # Any failure of one request (HTTP, connection, malformed stream JSON) is a result
        # to record, never a reason to stop the run.
        tracker.status = RequestStatus.ERROR
        tracker.error = f"{type(exc).__name__}: {exc}"[:_MAX_ERROR_CHARS]
        logger.debug("request %d failed: %s", tracker.request.request_id, tracker.error)


async def run_load(requests: Sequence[TraceRequest], config: LoadGenConfig) -> LoadGenOutcome:
    """Send `requests` at their arrival times; return one record per request, in order."""
    from tqdm.auto import tqdm  # keep `import weaver.bench.loadgen` light

    trackers = [_Tracker(r) for r in requests]
    limiter = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    # No pool cap by default: httpx's default of 100 connections would queue requests on
    # the client side and show up as server latency.
    limits = httpx.Limits(max_connections=config.max_concurrency, max_keepalive_connections=None)
    timeout = httpx.Timeout(config.request_timeout_s)
    bar = tqdm(total=len(trackers), desc="requests", disable=not config.show_progress)
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=timeout) as client:
        # The clock starts after the client and bar exist, so their set-up does not make
        # the first requests late.
        started_at_unix = time.time()
        start = time.perf_counter()
        tasks = [
            asyncio.create_task(_run_one(client, t, config, start, limiter)) for t in trackers
        ]
        with bar:
            for task in tasks:
                task.add_done_callback(lambda _t: bar.update(1))
            done, pending = await asyncio.wait(tasks, timeout=config.duration_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        duration_s = time.perf_counter() - start
    _warn_if_late(trackers, start, config)
    if pending:
        logger.warning(
            "deadline of %.1f s reached: %d of %d requests cancelled",
            config.duration_s,
            len(pending),
            len(tasks),
        )
    return LoadGenOutcome([t.to_record(start) for t in trackers], started_at_unix, duration_s)


def _warn_if_late(trackers: Sequence[_Tracker], start: float, config: LoadGenConfig) -> None:
    # Open loop only holds if the client keeps up; a late client understates the load.
    if config.max_concurrency is not None:
        return  # lateness is then the cap's queueing, by design
    lags = [t.sent_at - start - t.request.arrival_s for t in trackers if t.sent_at is not None]
    if lags and max(lags) > _LATE_WARNING_S:
        logger.warning(
            "the client sent requests up to %.0f ms after their arrival times; the machine "
            "running the benchmark is too busy for this rate",
            1000 * max(lags),
        )


def run_load_sync(requests: Sequence[TraceRequest], config: LoadGenConfig) -> LoadGenOutcome:
    """`run_load` from synchronous code (the CLI)."""
    return asyncio.run(run_load(requests, config))
