"""Per-engine scheduler statistics for the gateway's `model`-labelled series.

vLLM's own Prometheus logger keeps one set of `vllm:*` series per process (a second
AsyncLLM unregisters the first one's), so a multi-model gateway cannot label them by
model. This recorder is appended to each engine's `StatLoggerManager` (vLLM calls
`record` after every engine step with that engine's `SchedulerStats`) and keeps the
latest values per engine; the gateway turns them into `weaver_*{model=...}` series.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any

from weaver.patches import engine_stat_logger

logger = logging.getLogger(__name__)


@dataclass
class EngineStatsRecorder:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    peak_running: int = 0  # most requests in one batch since the engine started

    def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
               engine_idx: int = 0) -> None:
        if scheduler_stats is None:
            return
        self.num_running = scheduler_stats.num_running_reqs
        self.num_waiting = scheduler_stats.num_waiting_reqs
        self.kv_cache_usage = scheduler_stats.kv_cache_usage
        self.peak_running = max(self.peak_running, self.num_running)

    # The rest of vLLM's StatLoggerBase interface: nothing to do for these events.
    def record_sleep_state(self, *args: Any, **kwargs: Any) -> None: ...

    def record_admission_rejection(self, reason: str) -> None: ...

    def log(self) -> None: ...

    def log_engine_initialized(self) -> None: ...

    def snapshot(self) -> dict[str, float]:
        return asdict(self)


def attach_stats_recorder(client: Any) -> EngineStatsRecorder | None:
    recorder = EngineStatsRecorder()
    if not engine_stat_logger.attach(client, recorder):
        logger.warning("engine has no stat logger manager (stats disabled): no per-model "
                       "running/waiting series for it")
        return None
    return recorder
