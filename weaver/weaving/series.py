"""The weaving counters' Prometheus series (name without `_total`, help, labels), as both
exporters publish them: the gateway under `weaver serve` (weaver/server/weaving.py) and
each server's own /metrics under plain `vllm serve` (weaver/weaving/plugin_metrics.py)."""

from __future__ import annotations

OFFLOAD_SEQUENCES = ("weaver_offload_sequences", "Hot sequences placed remotely", ("model",))
OFFLOAD_TASKS = ("weaver_offload_tasks", "Decode-attention tasks served remotely",
                 ("hot", "cold"))
OFFLOAD_FALLBACKS = (
    "weaver_offload_fallbacks",
    "Remote decode-attention tasks computed on the hot side because the cold side failed or "
    "timed out", ("model",))
COLD_BUSY = (
    "weaver_offload_cold_busy_seconds",
    "Cold side's time serving a hot model's attention tasks, by where: at poll points inside "
    "the cold model's own steps (its TPOT pays it) or by the idle poller between them",
    ("hot", "cold", "where"))
# offload_ratio auto (weaver/weaving/placement.py): the policy's state, per pair.
WEAVING_ACTIVE = (
    "weaver_weaving_active",
    "1 while an adaptive (offload_ratio auto) hot model may place new sequences remotely, 0 "
    "while weaving has stepped aside because it does not pay", ("hot", "cold"))
STEP_ASIDES = ("weaver_weaving_step_asides",
               "Times an adaptive hot model's weaving stepped aside", ("hot", "cold"))
COLD_TPOT_FACTOR = (
    "weaver_weaving_cold_tpot_factor",
    "The cold model's TPOT over its TPOT without the offloaded tasks, as the cold side "
    "measures it (the adaptive policy holds it to cold_tpot_budget)", ("hot", "cold"))


def placement_samples(placement: dict | None) -> tuple[float, float, float] | None:
    """(active, step asides, cold TPOT factor) from an adaptive placement's report; None
    for a fixed ratio (no report)."""
    if not placement:
        return None
    return (1.0 if placement.get("weaving_active") else 0.0,
            float(placement.get("step_asides") or 0),
            float(placement.get("cold_inflation") or 1.0))
