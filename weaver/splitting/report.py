"""A readable table of a profile and its split plan (what `weaver plan-split` prints)."""

from __future__ import annotations

from weaver.splitting.algorithm import SplitPlan, longest_chunk_s
from weaver.splitting.profile import SplitProfile, Statistic

_STOP_REASONS = {
    "below_threshold": "W is under the threshold",
    "within_slack": "no splittable chunk is longer than the slack K - N",
    "exhausted": "no operator can be split further (dimension limit or overhead)",
}


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.1f}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        first = cells[0].ljust(widths[0])
        rest = (cell.rjust(width) for cell, width in zip(cells[1:], widths[1:], strict=True))
        return "  ".join([first, *rest])

    return [line(header), line(["-" * w for w in widths]), *(line(row) for row in rows)]


def format_report(profile: SplitProfile, plan: SplitPlan, statistic: Statistic = "mean") -> str:
    """Profiled times, the chunks chosen per operator, and W before/after, as text.

    "W share" is the operator's part of the unsplit W, ``n_i T_i**2 / sum_j n_j T_j**2``:
    the quadratic weight that makes long operators the ones worth splitting.
    """
    specs = profile.operator_specs(statistic)
    timings = {op.name: op for op in [*profile.layer_ops, profile.lm_head]}
    sum_squares = sum(s.num_instances * s.time_s**2 for s in specs)
    cold_step_s = sum(s.num_instances * s.time_s for s in specs)
    rows = []
    for spec in specs:
        timing = timings[spec.name]
        num_chunks = plan.chunks_for(spec.name)
        longest = longest_chunk_s(spec, num_chunks, plan.overhead_s)
        rows.append(
            [
                spec.name,
                str(spec.num_instances),
                _us(timing.mean_s),
                _us(timing.p50_s),
                str(timing.num_samples),
                f"{spec.num_instances * spec.time_s**2 / sum_squares:.1%}",
                str(spec.split_dim_size),
                str(num_chunks),
                _us(longest),
            ]
        )
    header = ["operator", "per step", "mean us", "p50 us", "samples", "W share", "split dim"]
    header += ["chunks", "chunk us"]
    hot = profile.hot
    lines = [
        f"Cold model {profile.model} on {profile.device}, {profile.num_layers} layers"
        + (f" ({profile.notes})" if profile.notes else ""),
        f"Hot side: local attention K = {_us(hot.local_attention_s)} us, remote attention "
        f"N = {_us(hot.remote_attention_s)} us, slack K - N = {_us(plan.slack_s)} us, "
        f"iteration {_us(hot.step_s)} us",
        f"Operator times: {statistic}; split overhead {_us(plan.overhead_s)} us per extra chunk",
        "",
        *_table(header, rows),
        "",
        f"Expected wait W:       {_us(plan.wait_before_s)} us -> {_us(plan.wait_after_s)} us "
        f"(threshold {_us(plan.threshold_s)} us = {plan.threshold_s / hot.step_s:.1%} "
        "of the hot iteration)",
        f"p99 wait, 1 in flight: {_us(plan.wait_p99_before_s)} us -> "
        f"{_us(plan.wait_p99_after_s)} us",
        f"Longest chunk:         {_us(plan.max_chunk_before_s)} us -> "
        f"{_us(plan.max_chunk_after_s)} us",
        f"Expected hot stall:    {_us(plan.stall_before_s)} us -> {_us(plan.stall_after_s)} us "
        "per task",
        f"Cold overhead:         {_us(plan.total_overhead_s)} us per decode step "
        f"({plan.total_overhead_s / cold_step_s:.2%} of {_us(cold_step_s)} us)",
        f"Stopped because {_STOP_REASONS[plan.stop_reason.value]} after {len(plan.steps)} step(s).",
    ]
    lines += [
        f"  {step.name}: {step.chunks_before} -> {step.chunks_after} chunks, "
        f"W {_us(step.wait_after_s)} us" + ("" if step.is_accepted else " (rejected)")
        for step in plan.steps
    ]
    return "\n".join(lines)
