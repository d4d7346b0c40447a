"""The weaving counters' Prometheus series (name without `_total`, help, labels), as both
exporters publish them: the gateway under `weaver serve` (weaver/server/weaving.py) and
each server's own /metrics under plain `vllm serve` (weaver/vllm_ext/plugin_metrics.py)."""

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
