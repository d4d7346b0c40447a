"""The JSON schema of benchmark results, with load and save.

A results file holds one `BenchResult`: the exact command, machine info and one or more
`RunResult`s (one per deployment and rate: a sweep or a comparison is one file). Every
number in a summary can be recomputed from the per-request records it stores, and plots are
drawn from these files only (house style: experiments write JSON, plots read it).
"""

from __future__ import annotations

import os
import platform
import socket
import sys
from datetime import datetime, timezone
from enum import Enum
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, ValidationError

SCHEMA_VERSION = 1
ALL_MODELS = "__all__"  # summary key aggregating every model of a run


class RequestStatus(str, Enum):
    OK = "ok"  # streamed to the end
    ERROR = "error"  # HTTP error, bad stream, or connection failure
    UNFINISHED = "unfinished"  # sent, then cancelled at the deadline
    NOT_SENT = "not_sent"  # its arrival time fell after the deadline


class RequestRecord(BaseModel):
    """What the load generator saw for one request; times in seconds, relative to the run's
    start for `*_at_s`, durations otherwise."""

    request_id: int
    model: str
    input_tokens: int  # requested prompt length (the synthetic prompt aims at it)
    output_tokens: int  # requested max_tokens
    scheduled_at_s: float  # the arrival time from the workload
    sent_at_s: float | None = None  # when the HTTP request went out (later under a cap)
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = Field(default_factory=list)  # gaps between streamed chunks
    num_output_tokens: int = 0  # server usage if reported, else chunks with text
    num_prompt_tokens: int | None = None  # server usage, when reported
    status: RequestStatus = RequestStatus.NOT_SENT
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        """(E2E - TTFT) / (n_out - 1): mean time per output token after the first."""
        if self.status is not RequestStatus.OK or self.num_output_tokens < 2:
            return None
        assert self.e2e_s is not None and self.ttft_s is not None
        return (self.e2e_s - self.ttft_s) / (self.num_output_tokens - 1)


class LatencyStats(BaseModel):
    num: int
    mean: float
    percentiles: dict[str, float]  # "p50" -> seconds

    def p(self, percentile: float) -> float:
        key = percentile_key(percentile)
        if key not in self.percentiles:
            raise ValueError(
                f"percentile {percentile} was not computed; have {sorted(self.percentiles)}"
            )
        return self.percentiles[key]


class ModelSummary(BaseModel):
    num_requests: int
    num_ok: int
    num_errors: int
    num_unfinished: int
    num_not_sent: int
    duration_s: float
    request_throughput: float  # finished requests / duration
    output_token_throughput: float  # output tokens of finished requests / duration
    ttft: LatencyStats | None = None
    tpot: LatencyStats | None = None
    itl: LatencyStats | None = None
    e2e: LatencyStats | None = None

    @property
    def failed_fraction(self) -> float:
        failed = self.num_requests - self.num_ok
        return failed / self.num_requests if self.num_requests else 0.0


class SloSummary(BaseModel):
    """MuxServe SLO attainment, Splitwise slowdowns and the TTFT+TPOT SLO's attainment
    (weaver/results/goodput.py) for one model of a run."""

    attainment: dict[str, float]  # SLO scale ("5") -> fraction of requests within it
    slowdown: dict[str, float]  # "p50" -> E2E / isolated E2E
    slo: dict[str, float | None] = Field(default_factory=dict)  # {"ttft_ms", "tpot_ms"}
    slo_attainment: float | None = None  # share of submitted requests meeting `slo`
    good_requests_per_s: float | None = None  # those requests per second of the run
    good_tokens_per_s: float | None = None


class RunResult(BaseModel):
    label: str  # the deployment's name
    base_url: str
    rate: float | None  # offered total rate, req/s (None: trace replay at its own speed)
    started_at: str
    duration_s: float
    workload: dict[str, Any]
    loadgen: dict[str, Any]
    records: list[RequestRecord]
    summary: dict[str, ModelSummary]  # per model, plus ALL_MODELS
    slo: dict[str, SloSummary] = Field(default_factory=dict)
    # The isolated latencies the SLO numbers were computed against (IsolatedEstimate dumps).
    isolated: dict[str, dict[str, float]] = Field(default_factory=dict)
    roles: dict[str, str] = Field(default_factory=dict)  # model -> "hot" / "cold", if known
    # Gauges of the server's /metrics sampled during the run (weaver/bench/scrape.py):
    # 'name{labels}' -> [(seconds from the run's start, value)].
    scraped: dict[str, list[tuple[float, float]]] = Field(default_factory=dict)

    @property
    def last_arrival_s(self) -> float:
        """When the run's last request was due, from its start: the end of its load."""
        return max(r.scheduled_at_s for r in self.records)


class BenchResult(BaseModel):
    schema_version: int = SCHEMA_VERSION
    command: list[str]
    created_at: str
    machine: dict[str, Any]
    runs: list[RunResult] = Field(default_factory=list)


def percentile_key(percentile: float) -> str:
    return f"p{percentile:g}"


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def machine_info() -> dict[str, Any]:
    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "num_cpus": os.cpu_count() or 0,
    }


def new_result(command: list[str] | None = None) -> BenchResult:
    return BenchResult(
        command=list(sys.argv if command is None else command),
        created_at=utc_now(),
        machine=machine_info(),
    )


def save_result(result: BenchResult, path: str | os.PathLike[str]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(result.model_dump_json(indent=1), encoding="utf-8")
    return path


def load_result(path: str | os.PathLike[str]) -> BenchResult:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"results file {path} does not exist")
    try:
        result = BenchResult.model_validate_json(path.read_text(encoding="utf-8"))
    except ValidationError as exc:
        raise ValueError(f"{path} is not a Weaver bench results file: {exc}") from None
    if result.schema_version != SCHEMA_VERSION:
        raise ValueError(
            f"{path} has schema version {result.schema_version}; this Weaver reads "
            f"{SCHEMA_VERSION}. Re-run the benchmark with this version."
        )
    return result
