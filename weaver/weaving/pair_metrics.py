"""The weaving pairs' series in /metrics, read from the files the pairs' sides publish.

The counters live in the engines' processes (the hot scheduler's HotLink, the cold worker's
ColdLink: weaver/weaving/pair_link.py), which publish them every second in the pairs'
directory (weaver/weaving/rendezvous.py); this collector reads them at each scrape. It is
the one exporter of both launchers: registered in the gateway's registry under `weaver
serve` (weaver/server/weaving.py), in the front end's under plain `vllm serve` (the registry
vLLM's /metrics serves with a single API server), where `cold` is the pair name on the hot
side and the cold model's name on the cold side.

Only a living writer's file is read: a file left by a process that died before this
collector saw it (a plain `vllm serve` started after its predecessor was killed) counts
for nothing. A side that restarts while the collector runs counts from 0 again; its totals
are added to what its predecessor (another process id in the file) had reached, and while
no writer lives the last totals stay, so every counter only grows.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from prometheus_client import REGISTRY
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.registry import Collector

from weaver.weaving import series
from weaver.weaving.rendezvous import PairFiles

logger = logging.getLogger(__name__)

_registered: set[tuple[str, str, tuple[str, ...]]] = set()
# The totals in a side's stats file that export as counters.
HOT_TOTALS = ("remote_sequences", "offloaded_tasks", "fallback_tasks", "attaches",
              "resumes", "step_asides", "wait_sum_s", "cold_budget_preemptions")
COLD_TOTALS = ("busy_at_poll_points_s", "busy_by_idle_poller_s")


class MonotoneTotals:
    """Running totals of one writer, kept growing across its restarts: when the writer's
    process id changes, what the old one had reached becomes the base of the new one's."""

    def __init__(self) -> None:
        self._pid: object = None
        self._base: dict[str, float] = {}
        self._last: dict[str, float] = {}
        self.labels: tuple[str, str] | None = None  # (hot, cold) of the last stats read

    def update(self, pid: object, totals: dict[str, float]) -> dict[str, float]:
        if pid != self._pid and self._pid is not None:
            for key, value in self._last.items():
                self._base[key] = self._base.get(key, 0.0) + value
            self._last = {}
        self._pid = pid
        for key, value in totals.items():
            self._last[key] = max(value, self._last.get(key, 0.0))  # a stale read: no decrease
        return self.current()

    def current(self) -> dict[str, float]:
        """The totals so far (what the last writer reached, on its predecessors' base)."""
        return {key: self._base.get(key, 0.0) + value for key, value in self._last.items()}


class PairStatsCollector(Collector):
    def __init__(self, files: PairFiles, role: str, pairs: tuple[str, ...]) -> None:
        self.files = files
        self.role = role
        self.pairs = pairs
        self._totals = {pair: MonotoneTotals() for pair in pairs}
        self._waits = {pair: MonotoneTotals() for pair in pairs}

    def collect(self) -> Iterator:
        families = self._families()
        # Series labelled by the hot model alone sum its pairs (a hot model weaving into
        # several colds has one pair each): one sample per model.
        per_model: dict[str, dict[str, float]] = {}
        for pair in self.pairs:
            stats = self.files.read(pair, f"{self.role}.stats")  # a living writer's only
            if self.role == "hot":
                self._add_hot(families, per_model, pair, stats)
            else:
                self._add_cold(families, pair, stats)
        for model, totals in per_model.items():
            families["sequences"].add_metric([model], totals["remote_sequences"])
            families["fallbacks"].add_metric([model], totals["fallback_tasks"])
        yield from families.values()

    def describe(self) -> Iterator:
        """The families without samples: what the registry asks when the collector is
        registered, answered without reading the pair's files."""
        yield from self._families().values()

    def _families(self) -> dict[str, CounterMetricFamily | GaugeMetricFamily]:
        if self.role != "hot":
            return {"busy": _counter(series.COLD_BUSY)}
        return {
            "sequences": _counter(series.OFFLOAD_SEQUENCES),
            "tasks": _counter(series.OFFLOAD_TASKS),
            "fallbacks": _counter(series.OFFLOAD_FALLBACKS),
            "wait": HistogramMetricFamily(*series.OFFLOAD_WAIT[:2],
                                          labels=series.OFFLOAD_WAIT[2]),
            "remote_blocks": _gauge(series.REMOTE_BLOCKS),
            "attaches": CounterMetricFamily(
                "weaver_pair_attaches", "Regions of the cold engine this hot engine attached "
                "(one more each time the cold engine restarts)", labels=["pair"]),
            "resumes": CounterMetricFamily(
                "weaver_pair_resumes", "Times offloading resumed after a late task had "
                "degraded the pair (its cold engine answering again)", labels=["pair"]),
            "connected": GaugeMetricFamily(
                "weaver_pair_connected", "1 while the pair's cold engine is attached and "
                "sequences may go remote", labels=["pair"]),
            "active": _gauge(series.WEAVING_ACTIVE),
            "asides": _counter(series.STEP_ASIDES),
            "shed": _counter(series.COLD_BUDGET_PREEMPTIONS),
            "factor": _gauge(series.COLD_TPOT_FACTOR),
        }

    def _add_hot(self, families: dict, per_model: dict[str, dict[str, float]], pair: str,
                 stats: dict | None) -> None:
        tracker = self._totals[pair]
        if stats is None:  # no living hot side: its counters as they were, not connected
            families["connected"].add_metric([pair], 0)
            if tracker.labels is not None:
                self._add_hot_totals(families, per_model, pair, tracker.labels,
                                     tracker.current())
            return
        samples = series.placement_samples(stats.get("placement"))
        raw = {key: float(stats.get(key) or 0) for key in HOT_TOTALS}
        raw["step_asides"] = samples[1] if samples is not None else 0.0
        totals = tracker.update(stats.get("pid"), raw)
        model, cold = tracker.labels = (stats.get("hot", ""), stats.get("cold", pair))
        self._add_hot_totals(families, per_model, pair, tracker.labels, totals)
        families["connected"].add_metric([pair], 1 if stats.get("connected") else 0)
        families["remote_blocks"].add_metric([model, cold], stats.get("remote_blocks_used", 0))
        counts = stats.get("wait_counts") or [0] * (len(series.WAIT_BUCKETS) + 1)
        waits = self._waits[pair].update(stats.get("pid"), dict(enumerate(map(float, counts))))
        cumulative, buckets = 0.0, []
        for index, bound in enumerate((*map(str, series.WAIT_BUCKETS), "+Inf")):
            cumulative += waits.get(index, 0.0)
            buckets.append((bound, cumulative))
        families["wait"].add_metric([model, cold], buckets, sum_value=totals["wait_sum_s"])
        if samples is not None:
            families["active"].add_metric([model, cold], samples[0])
            families["factor"].add_metric([model, cold], samples[2])

    @staticmethod
    def _add_hot_totals(families: dict, per_model: dict[str, dict[str, float]], pair: str,
                        labels: tuple[str, str], totals: dict[str, float]) -> None:
        model, cold = labels
        summed = per_model.setdefault(model, {"remote_sequences": 0.0, "fallback_tasks": 0.0})
        for key in summed:
            summed[key] += totals[key]
        families["tasks"].add_metric([model, cold], totals["offloaded_tasks"])
        families["attaches"].add_metric([pair], totals["attaches"])
        families["resumes"].add_metric([pair], totals["resumes"])
        families["asides"].add_metric([model, cold], totals["step_asides"])
        families["shed"].add_metric([model, cold], totals["cold_budget_preemptions"])

    def _add_cold(self, families: dict, pair: str, stats: dict | None) -> None:
        tracker = self._totals[pair]
        if stats is not None:
            tracker.update(stats.get("pid"),
                           {key: float(stats.get(key) or 0) for key in COLD_TOTALS})
            tracker.labels = (stats.get("hot", ""), stats.get("cold", ""))
        if tracker.labels is None:
            return
        totals, busy = tracker.current(), families["busy"]
        busy.add_metric([*tracker.labels, "poll_point"], totals["busy_at_poll_points_s"])
        busy.add_metric([*tracker.labels, "idle"], totals["busy_by_idle_poller_s"])


def _counter(spec: tuple[str, str, tuple[str, ...]]) -> CounterMetricFamily:
    name, documentation, labels = spec
    return CounterMetricFamily(name, documentation, labels=labels)


def _gauge(spec: tuple[str, str, tuple[str, ...]]) -> GaugeMetricFamily:
    name, documentation, labels = spec
    return GaugeMetricFamily(name, documentation, labels=labels)


def register_pair_collector(files: PairFiles, role: str, pairs: tuple[str, ...]) -> None:
    """In the process's default registry, once per directory, role and pair set (vLLM may
    build its config more than once)."""
    key = (str(files.root), role, pairs)
    if key in _registered:
        return
    REGISTRY.register(PairStatsCollector(files, role, pairs))
    _registered.add(key)
