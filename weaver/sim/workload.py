"""The simulator's requests come from the benchmark's own workload code, never a copy of it.

Two sources, both yielding `TraceRequest`s:
- a config's `workload:` section becomes a `weaver.workloads.builder.WorkloadSpec` (the
  same trace loaders, filters, length scaling, arrival processes and seeds as
  `weaver bench`), with the config's per-model rates;
- a saved `weaver bench` run (`weaver.results.records.RunResult`) is replayed request by
  request: the measured send times, prompt and output lengths and model names.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from weaver.results.records import RequestStatus, RunResult
from weaver.workloads.builder import ModelLoad, WorkloadSpec, build_workload, load_rows
from weaver.workloads.lengths import scale_lengths
from weaver.workloads.traces import TraceRow
from weaver.workloads.types import TraceRequest


def workload_spec(workload, rates: dict[str, float], duration_s: float,
                  seed: int) -> WorkloadSpec:
    """The `WorkloadSpec` of a sim config's `workload:` section (`WorkloadConfig`) at these
    per-model rates: as many requests as the rates bring in `duration_s` on average."""
    models = [ModelLoad(name, rate) for name, rate in rates.items() if rate > 0]
    if not models:
        raise ValueError("every model has rate 0: give at least one model a rate > 0")
    num_requests = max(1, round(sum(rates.values()) * duration_s))
    return WorkloadSpec(
        models=models, trace=workload.trace, arrival=workload.arrival,
        burstiness=workload.burstiness, num_requests=num_requests,
        length_scale=workload.length_scale, max_model_len=workload.max_model_len,
        filter_name=workload.filter_name, seed=seed, traces_dir=workload.traces_dir)


@functools.lru_cache(maxsize=8)
def _rows(trace: str, filter_name: str | None, traces_dir: str | None) -> tuple[TraceRow, ...]:
    # Sweeps and planners build many workloads from one trace: read and filter it once.
    spec = WorkloadSpec(models=[ModelLoad("m", 1.0)], trace=trace, filter_name=filter_name,
                        traces_dir=traces_dir)
    return tuple(load_rows(spec))


def generate(spec: WorkloadSpec) -> list[TraceRequest]:
    """`build_workload` with the filtered trace rows cached across calls."""
    return build_workload(spec, _rows(spec.trace, spec.filter_name, spec.traces_dir))


def mean_lengths(workload) -> tuple[float, float]:
    """Mean (input, output) tokens of a `WorkloadConfig`'s requests: its filtered trace rows
    after length scaling (what the planner's capacity estimate needs)."""
    return _mean_lengths(workload.trace, workload.filter_name, workload.traces_dir,
                         workload.length_scale, workload.max_model_len)


@functools.lru_cache(maxsize=8)
def _mean_lengths(trace: str, filter_name: str | None, traces_dir: str | None,
                  length_scale: float, max_model_len: int | None) -> tuple[float, float]:
    rows = _rows(trace, filter_name, traces_dir)
    pairs = [scale_lengths(r.input_tokens, r.output_tokens, length_scale, max_model_len)
             for r in rows]
    return (sum(p[0] for p in pairs) / len(pairs), sum(p[1] for p in pairs) / len(pairs))


def replay_run(run: RunResult) -> list[TraceRequest]:
    """The requests a measured run actually put on the server, in the order they were sent.

    Arrival is the measured send time (later than the scheduled one when the client lagged);
    the prompt length is the server-reported one when known (the synthetic prompt only aims
    at the requested length); the output length is what the server generated for a request
    that finished, else the requested `max_tokens`. Requests never sent are left out: the
    server never saw them."""
    out = []
    for rec in run.records:
        if rec.status is RequestStatus.NOT_SENT or rec.sent_at_s is None:
            continue
        num_out = rec.num_output_tokens if rec.status is RequestStatus.OK else rec.output_tokens
        out.append(TraceRequest(rec.sent_at_s, rec.num_prompt_tokens or rec.input_tokens,
                                max(1, num_out), rec.model, rec.request_id))
    out.sort(key=lambda r: (r.arrival_s, r.request_id))
    if not out:
        raise ValueError(f"run {run.label!r} has no request that was sent; nothing to replay")
    return out


def models_of(requests: Sequence[TraceRequest]) -> list[str]:
    return sorted({r.model for r in requests})
