"""The weaving pairs' Prometheus series (name without `_total`, help, labels), as the one
exporter (weaver/weaving/pair_metrics.py) publishes them: in the gateway's /metrics under
`weaver serve`, in each server's own under plain `vllm serve`."""

from __future__ import annotations

OFFLOAD_SEQUENCES = ("weaver_offload_sequences", "Hot sequences placed remotely", ("model",))
OFFLOAD_TASKS = ("weaver_offload_tasks", "Decode-attention tasks served remotely",
                 ("hot", "cold"))
OFFLOAD_FALLBACKS = (
    "weaver_offload_fallbacks",
    "Remote decode-attention tasks computed on the hot side because the cold side failed or "
    "timed out", ("model",))
OFFLOAD_WAIT = ("weaver_offload_wait_seconds",
                "Hot side's wait for a remote attention task (publish to output)",
                ("hot", "cold"))
# Fine below 10 ms, where operator splitting moves the offload wait (benchmarks/split_wait.py
# reads p50/p99 from these buckets).
WAIT_BUCKETS = (5e-5, 1e-4, 1.5e-4, 2e-4, 2.5e-4, 3e-4, 4e-4, 5e-4, 6e-4, 7.5e-4, 1e-3, 1.25e-3,
                1.5e-3, 2e-3, 2.5e-3, 3e-3, 4e-3, 5e-3, 6e-3, 7.5e-3, 1e-2, 1.5e-2, 2.5e-2,
                5e-2, 0.1, 0.5, 1.0, 5.0)
REMOTE_BLOCKS = ("weaver_remote_kv_blocks_used", "Remote KV blocks held by running hot sequences",
                 ("hot", "cold"))
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
COLD_BUDGET_PREEMPTIONS = (
    "weaver_weaving_cold_budget_preemptions",
    "Remote sequences an adaptive hot model preempted (to recompute them later) because the "
    "cold model's TPOT was over its budget", ("hot", "cold"))
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
