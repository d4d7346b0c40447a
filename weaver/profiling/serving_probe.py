"""Measure the serving path for `weaver profile --calibrate-serving`: decode and prefill
points seen by a streaming client of a real `weaver serve`.

One model, one dedicated engine pinned to one core (`cpu_cores`, as the benchmark
deployments pin theirs), driven over HTTP by the load generator; this module imports no
vLLM. Decode points: b requests sent at once (fixed prompt and output lengths, ignore_eos
as the load generator sends them), for each batch size of a `ServingPlan`. Prefill points:
one request at a time on the idle server, its TTFT. The fit is pure Python in
`weaver.profiling.serving_calibration`.

Where the gateway, the engines' frontends and this client run matters: on the two-core
benchmark machine every core also runs an engine, so their work takes time from the
engines. By default they are pinned to the engine's core, so their whole cost shows up in
the measured step times; `serve_cores=None` leaves them unpinned instead (on an otherwise
idle machine they then run beside the engine, and the overhead measured is only what
cannot overlap: IPC latency and the like).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from weaver.bench.loadgen import LoadGenConfig, run_load_sync
from weaver.bench.server_process import weaver_server
from weaver.config.cpu_cores import usable_cpu_cores
from weaver.config.deployment import parse_deployment
from weaver.profiling.serving_calibration import (
    ServingDecodePoint,
    ServingPlan,
    ServingPrefillPoint,
)
from weaver.results.records import RequestRecord, RequestStatus
from weaver.workloads.types import TraceRequest

logger = logging.getLogger(__name__)

API_NAME = "probe"  # the deployment's only model
GIB = 1 << 30
MIN_KV_GIB = 0.25  # as the cold model of benchmarks/deployments/dedicated.yaml
FIRST_REQUEST_ID = 1000  # every request gets its own id: prompts share no prefix

Point = ServingDecodePoint | ServingPrefillPoint
OnPoint = Callable[[Point, str], None]


@dataclass(frozen=True)
class DecodeObservation:
    point: ServingDecodePoint
    num_full_batch: int  # requests whose whole decode ran with the whole batch
    median_tpot_all_s: float  # over all b requests, for comparison


@dataclass
class ServingPoints:
    decode: list[ServingDecodePoint]
    prefill: list[ServingPrefillPoint]
    deployment_path: Path
    log_path: Path


def deployment_dict(model: str, cpu_cores: str, plan: ServingPlan,
                    kv_bytes_per_token: int) -> dict:
    """A one-model deployment like benchmarks/deployments/dedicated.yaml, with KV for the
    plan's largest batch (x1.5, and no less than the cold model's 0.25 GiB there)."""
    block_bytes = plan.block_size * kv_bytes_per_token
    need_gib = 1.5 * (plan.kv_blocks() + 1) * block_bytes / GIB  # + vLLM's null block
    return {
        "models": [{
            "name": API_NAME, "model": model, "role": "dedicated",
            "kv_cache_gib": max(MIN_KV_GIB, math.ceil(need_gib * 64) / 64),
            "max_model_len": plan.max_model_len, "block_size": plan.block_size,
            "max_num_seqs": max(64, max(plan.batch_sizes)), "cpu_cores": cpu_cores,
        }],
        "weaving": [],
    }


def write_deployment(path: Path, data: dict) -> Path:
    parse_deployment(data, str(path))  # the server would refuse it anyway; say so first
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def decode_observation(records: Sequence[RequestRecord], batch_size: int) -> DecodeObservation:
    """The decode point of b requests sent together.

    They may not all reach the engine in its first step: the first few are prefilled, and
    the rest join a step later, in a step that also prefills them (seconds for a large
    batch). The early requests' TPOT includes that prefill; the requests of the last group
    (first token within half a step of the latest one) decoded every step with the whole
    batch, so the point is the median TPOT of those. Context per request averages
    prompt + 1 ... prompt + n - 1 attended tokens: prompt + n / 2."""
    _require_ok(records)
    if len(records) != batch_size:
        raise ValueError(f"batch {batch_size}: got {len(records)} records")
    tpots = [r.tpot_s for r in records]
    if any(t is None for t in tpots):
        raise RuntimeError(f"batch {batch_size}: a request streamed fewer than 2 tokens")
    firsts = [r.sent_at_s + r.ttft_s for r in records]
    latest, margin = max(firsts), 0.5 * min(tpots)
    full = [t for t, first in zip(tpots, firsts, strict=True) if first >= latest - margin]
    context = sum(_prompt_tokens(r) + r.num_output_tokens / 2 for r in records)
    point = ServingDecodePoint(batch_size, context, statistics.median(full))
    return DecodeObservation(point, len(full), statistics.median(tpots))


def prefill_point(record: RequestRecord) -> ServingPrefillPoint:
    _require_ok([record])
    return ServingPrefillPoint(_prompt_tokens(record), record.ttft_s)


def measure_serving_points(model: str, cpu_cores: str, plan: ServingPlan, kv_bytes_per_token: int,
                           work_dir: Path, serve_cores: set[int] | None,
                           on_point: OnPoint,
                           deployment: tuple[Path, str] | None = None) -> ServingPoints:
    """Start `weaver serve` for `model` on `cpu_cores`, warm it up, measure the plan's points
    (each reported to `on_point` with a remark as it comes); the server is gone after.

    `deployment` = (file, API name): serve that deployment as it is instead (its engines
    pinned by their own cpu_cores, every other model idle) and measure the named model,
    so that the points hold what that deployment's other engines cost the measured one."""
    work_dir.mkdir(parents=True, exist_ok=True)
    if deployment is None:
        config = write_deployment(work_dir / "serving_probe.yaml",
                                  deployment_dict(model, cpu_cores, plan, kv_bytes_per_token))
        api_name = API_NAME
    else:
        config, api_name = deployment
    log_path = work_dir / "serving_probe.log"
    prefill: list[ServingPrefillPoint] = []
    with _probed_server(config, log_path, api_name, serve_cores) as client:
        # Warm-up: kernels of a lone and of a batched step, the longest prompt, the gateway.
        client.send([client.one(16, 4)])
        client.send([client.one(max(plan.prefill_prompt_tokens), plan.prefill_output_tokens)])
        client.send([client.one(16, 4) for _ in range(min(4, max(plan.batch_sizes)))])
        for _ in range(plan.prefill_repeats):
            for n in plan.prefill_prompt_tokens:
                record = client.send([client.one(n, plan.prefill_output_tokens)])[0]
                point = prefill_point(record)
                prefill.append(point)
                on_point(point, "alone on the idle server")
        decode = _decode_points(client, plan, on_point)
    return ServingPoints(decode, prefill, config, log_path)


class _ProbeClient:
    """Requests to one model of the probed server: numbered ones of given lengths, sent
    together and required to stream to their end."""

    def __init__(self, base_url: str, api_name: str, log_path: Path) -> None:
        self._base_url = base_url
        self._api_name = api_name
        self._log_path = log_path
        self._ids = iter(range(FIRST_REQUEST_ID, 1 << 62))

    def one(self, prompt: int, output: int) -> TraceRequest:
        return TraceRequest(0.0, prompt, output, self._api_name, next(self._ids))

    def send(self, requests: list[TraceRequest]) -> list[RequestRecord]:
        """All `requests` at once; every one must stream to its end."""
        outcome = run_load_sync(requests, LoadGenConfig(self._base_url, show_progress=False))
        bad = [r for r in outcome.records if r.status is not RequestStatus.OK]
        if bad:
            raise RuntimeError(f"{len(bad)} of {len(requests)} requests failed "
                               f"({bad[0].error}); server log: {self._log_path}")
        return outcome.records


@contextlib.contextmanager
def _probed_server(config: Path, log_path: Path, api_name: str,
                   serve_cores: set[int] | None) -> Iterator[_ProbeClient]:
    """`weaver serve config` (this process and the server on serve_cores), until the block
    ends; a client of its model `api_name`."""
    started = time.monotonic()
    with _pinned(serve_cores), weaver_server(config, log_path) as server:
        logger.info("weaver serve ready in %.0f s; warming up", time.monotonic() - started)
        yield _ProbeClient(server.base_url, api_name, log_path)


def _decode_points(client: _ProbeClient, plan: ServingPlan,
                   on_point: OnPoint) -> list[ServingDecodePoint]:
    """The plan's decode points: b requests at once per batch size, `decode_repeats` times.
    Repeats outermost: a slow drift of the machine touches every batch size alike."""
    decode = []
    for repeat in range(plan.decode_repeats):
        for b in plan.batch_sizes:
            records = client.send([client.one(plan.prompt_tokens, plan.output_tokens)
                                   for _ in range(b)])
            seen = decode_observation(records, b)
            decode.append(seen.point)
            on_point(seen.point, f"repeat {repeat + 1}/{plan.decode_repeats}, "
                     f"{seen.num_full_batch} of {b} decoded with the whole batch; "
                     f"median of all {seen.median_tpot_all_s * 1e3:.1f} ms")
    return decode


def measure_woven_points(deployment_path: Path, hot_model: str, plan: ServingPlan,
                         log_path: Path, serve_cores: set[int] | None,
                         on_point: OnPoint) -> list[ServingDecodePoint]:
    """Serve a weaving deployment as its file says (engines pinned by their cpu_cores) and
    measure decode points of its hot model, `hot_model` (API name), with every other model
    idle: b requests at once for each of the plan's batch sizes, `decode_repeats` times
    (repeats outermost). The hot scheduler places each request local or remote; the
    caller knows where from the pair's offload ratio."""
    with _probed_server(deployment_path, log_path, hot_model, serve_cores) as client:
        # Warm-up: a lone and a batched step, local and remote sequences both.
        client.send([client.one(16, 4)])
        client.send([client.one(plan.prompt_tokens, 4)
                     for _ in range(min(4, max(plan.batch_sizes)))])
        return _decode_points(client, plan, on_point)


def parse_serve_cores(value: str, engine_cores: str) -> set[int] | None:
    """'engine' (the engine's cores), 'all' (unpinned: None) or a list like '0,1' or '0-1'."""
    if value == "all":
        return None
    if value == "engine":
        value = engine_cores
    try:
        cores = usable_cpu_cores("--serve-cores", value)
    except ValueError as exc:
        raise ValueError(f"{exc} ('engine' and 'all' work too)") from None
    if cores is None:  # 'auto'/'nobind' name no cores: as 'all'
        return None
    return set(cores)


@contextlib.contextmanager
def _pinned(cores: set[int] | None) -> Iterator[None]:
    """This process, and the server it starts (children inherit it), on `cores`. The
    engine's compute threads are pinned by its deployment's cpu_cores regardless."""
    if cores is None:
        yield
        return
    saved = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, saved)


def _require_ok(records: Sequence[RequestRecord]) -> None:
    for r in records:
        if r.status is not RequestStatus.OK or r.ttft_s is None or r.sent_at_s is None:
            raise RuntimeError(f"request {r.request_id} did not complete: {r.status.value} "
                               f"{r.error or ''}".strip())


def _prompt_tokens(record: RequestRecord) -> int:
    # The server's count: synthetic prompts come out a few tokens off the requested length.
    return record.num_prompt_tokens or record.input_tokens
