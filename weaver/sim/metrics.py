"""Per-request outputs (TTFT, TPOT, E2E) and per-model summaries, as plain JSON-able dicts.

TPOT follows vLLM's benchmark_serving: (E2E - TTFT) / (output tokens - 1). Whether a
request meets the SLO, and the attainment, are decided by weaver/results/goodput.py on the
records as `weaver bench` would have measured them (`bench_record`), so a simulated run and
a measured one are judged by one function.
"""

from __future__ import annotations

import numpy as np

from weaver.results.goodput import Slo, attainment, meets_slo
from weaver.results.metrics import summarize as bench_summarize
from weaver.results.records import ModelSummary, RequestRecord, RequestStatus
from weaver.sim.instance import SimRequest


def request_record(req: SimRequest) -> dict:
    trace = req.trace
    rec = {
        "request_id": trace.request_id, "model": trace.model, "arrival_s": trace.arrival_s,
        "input_tokens": trace.input_tokens, "output_tokens": trace.output_tokens,
        "instance": req.instance, "is_remote": req.is_remote,
        "num_preemptions": req.num_preemptions, "is_rejected": req.is_rejected,
        "ttft_s": None, "tpot_s": None, "e2e_s": None,
    }
    if req.finish_s is not None and not req.is_rejected:
        rec["ttft_s"] = req.first_token_s - trace.arrival_s
        rec["e2e_s"] = req.finish_s - trace.arrival_s
        if trace.output_tokens > 1:
            rec["tpot_s"] = (req.finish_s - req.first_token_s) / (trace.output_tokens - 1)
        else:
            rec["tpot_s"] = 0.0
    return rec


def _percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    arr = np.asarray(values)
    return {"mean": float(arr.mean()), "p50": float(np.percentile(arr, 50)),
            "p90": float(np.percentile(arr, 90)), "p99": float(np.percentile(arr, 99))}


def summarize(records: list[dict], slo: Slo, num_submitted: dict[str, int],
              window: tuple[float, float] | None = None) -> dict:
    """Per-model and overall summaries over a measurement `window` (default: first to
    last arrival), the period during which load is offered:

    - `output_tokens_per_s`: tokens generated inside the window per second of it (a
      request's tokens are spread evenly between its first token and its finish); the
      steady-state throughput, low only when the system falls behind;
    - `throughput_rps`: requests arriving in the window that completed (by the end of
      the simulation), per second of the window: the served rate;
    - `goodput_rps`: those of them that met the SLO, per second (<= throughput);
    - `slo_attainment`: the share of all submitted requests that met the SLO
      (unfinished ones miss it)."""
    if window is None and records:
        window = (min(r["arrival_s"] for r in records), max(r["arrival_s"] for r in records))
    by_model: dict[str, list[dict]] = {m: [] for m in num_submitted}
    for rec in records:
        by_model.setdefault(rec["model"], []).append(rec)
    summary = {name: _summarize_one(recs, slo, num_submitted.get(name, len(recs)), window)
               for name, recs in sorted(by_model.items())}
    summary["_all"] = _summarize_one(records, slo, sum(num_submitted.values()), window)
    return summary


def tokens_by(rec: dict, t: float) -> float:
    """Output tokens a completed request had produced by time t (linear between tokens)."""
    first = rec["arrival_s"] + rec["ttft_s"]
    finish = rec["arrival_s"] + rec["e2e_s"]
    if t < first:
        return 0.0
    if t >= finish or finish <= first:
        return float(rec["output_tokens"])
    return 1.0 + (rec["output_tokens"] - 1) * (t - first) / (finish - first)


def _summarize_one(records: list[dict], slo: Slo, num_submitted: int,
                   window: tuple[float, float] | None) -> dict:
    done = [r for r in records if r["e2e_s"] is not None]
    # Judged as `weaver bench` records them, converted once (the planner runs many sims).
    benched = [bench_record(r) for r in records]
    good = [r for r, measured in zip(records, benched, strict=True) if meets_slo(measured, slo)]
    start, end = window or (0.0, 0.0)
    if end <= start:  # one instant of arrivals: measure up to the last completion
        end = max((r["arrival_s"] + r["e2e_s"] for r in done), default=start)
    span = max(end - start, 1e-9)
    served = [r for r in done if start <= r["arrival_s"] <= end]
    tokens = sum(tokens_by(r, end) - tokens_by(r, start) for r in done)
    return {
        "num_submitted": num_submitted,
        "num_completed": len(done),
        "num_rejected": sum(r["is_rejected"] for r in records),
        "num_preemptions": sum(r["num_preemptions"] for r in records),
        "num_remote": sum(r["is_remote"] for r in done),
        "window_s": span,
        "output_tokens_per_s": tokens / span,
        "throughput_rps": len(served) / span,
        "goodput_rps": sum(start <= r["arrival_s"] <= end for r in good) / span,
        "slo_attainment": attainment(benched, slo, num_submitted) if num_submitted else None,
        "ttft_s": _percentiles([r["ttft_s"] for r in done]),
        "tpot_s": _percentiles([r["tpot_s"] for r in done if r["output_tokens"] > 1]),
        "e2e_s": _percentiles([r["e2e_s"] for r in done]),
    }


def bench_record(rec: dict) -> RequestRecord:
    """A simulated request as `weaver bench` records a measured one, so both are summarised
    by `weaver.results.metrics.summarize`. The simulated client sends at the arrival time
    and sees every token as it is generated; it streams no per-token gaps (`itl_s`)."""
    if rec["is_rejected"]:
        status = RequestStatus.ERROR
    elif rec["e2e_s"] is None:
        status = RequestStatus.UNFINISHED
    else:
        status = RequestStatus.OK
    is_ok = status is RequestStatus.OK
    return RequestRecord(
        request_id=rec["request_id"], model=rec["model"], input_tokens=rec["input_tokens"],
        output_tokens=rec["output_tokens"], scheduled_at_s=rec["arrival_s"],
        sent_at_s=rec["arrival_s"], ttft_s=rec["ttft_s"], e2e_s=rec["e2e_s"],
        num_output_tokens=rec["output_tokens"] if is_ok else 0,
        num_prompt_tokens=rec["input_tokens"], status=status,
        error="rejected: needs more KV blocks than the server has" if rec["is_rejected"]
        else None)


def bench_duration_s(records: list[RequestRecord]) -> float:
    """The run's duration as the load generator measures it: from its start (time 0) to
    the end of the last request (weaver/bench/loadgen.py `run_load`)."""
    ends = [r.sent_at_s + r.e2e_s for r in records
            if r.sent_at_s is not None and r.e2e_s is not None]
    return max(ends + [r.sent_at_s or 0.0 for r in records] + [1e-9])


def bench_summary(records: list[RequestRecord]) -> dict[str, ModelSummary]:
    """Per-model summaries of simulated requests by the benchmark's own function."""
    return bench_summarize(records, bench_duration_s(records))
