"""A weaving pair's counters in the /metrics of a plain `vllm serve`, beside `vllm:*`.

The counters live in the engine's processes (the hot scheduler's HotLink, the cold worker's
ColdLink: weaver/weaving/pair_link.py), which publish them every second in the rendezvous
directory; this collector, registered in the front end's prometheus registry (the one
vLLM's /metrics serves with a single API server), reads them at each scrape. Series are
named as under `weaver serve` (weaver/server/weaving.py); `cold` is the pair name on the
hot side, the cold model's name on the cold side.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from weaver.weaving import rendezvous, series

logger = logging.getLogger(__name__)

_registered: set[tuple[str, tuple[str, ...]]] = set()


class PairStatsCollector(Collector):
    def __init__(self, role: str, pairs: tuple[str, ...]) -> None:
        self.role = role
        self.pairs = pairs

    def collect(self) -> Iterator:
        families = self._families()
        for pair in self.pairs:
            stats = rendezvous.read_even_if_dead(pair, f"{self.role}.stats")
            if self.role == "hot":
                self._add_hot(families, pair, stats)
            elif stats is not None:
                self._add_cold(families, stats)
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
            "attaches": CounterMetricFamily(
                "weaver_pair_attaches", "Regions of the cold engine this hot engine attached "
                "(one more each time the cold engine restarts)", labels=["pair"]),
            "connected": GaugeMetricFamily(
                "weaver_pair_connected", "1 while the pair's cold engine is attached and "
                "sequences may go remote", labels=["pair"]),
            "active": _gauge(series.WEAVING_ACTIVE),
            "asides": _counter(series.STEP_ASIDES),
            "factor": _gauge(series.COLD_TPOT_FACTOR),
        }

    @staticmethod
    def _add_hot(families: dict, pair: str, stats: dict | None) -> None:
        if stats is None:
            families["connected"].add_metric([pair], 0)
            return
        model = stats.get("hot", "")
        families["sequences"].add_metric([model], stats.get("remote_sequences", 0))
        families["tasks"].add_metric([model, pair], stats.get("offloaded_tasks", 0))
        families["fallbacks"].add_metric([model], stats.get("fallback_tasks", 0))
        families["attaches"].add_metric([pair], stats.get("attaches", 0))
        families["connected"].add_metric([pair], 1 if stats.get("connected") else 0)
        samples = series.placement_samples(stats.get("placement"))
        if samples is not None:
            for key, value in zip(("active", "asides", "factor"), samples, strict=True):
                families[key].add_metric([model, pair], value)

    @staticmethod
    def _add_cold(families: dict, stats: dict) -> None:
        labels, busy = [stats.get("hot", ""), stats.get("cold", "")], families["busy"]
        busy.add_metric([*labels, "poll_point"], stats.get("busy_at_poll_points_s", 0.0))
        busy.add_metric([*labels, "idle"], stats.get("busy_by_idle_poller_s", 0.0))


def _counter(spec: tuple[str, str, tuple[str, ...]]) -> CounterMetricFamily:
    name, documentation, labels = spec
    return CounterMetricFamily(name, documentation, labels=labels)


def _gauge(spec: tuple[str, str, tuple[str, ...]]) -> GaugeMetricFamily:
    name, documentation, labels = spec
    return GaugeMetricFamily(name, documentation, labels=labels)


def register_pair_collector(role: str, pairs: tuple[str, ...]) -> None:
    """Once per process and pair set (vLLM may build its config more than once)."""
    key = (role, pairs)
    if key in _registered:
        return
    REGISTRY.register(PairStatsCollector(role, pairs))
    _registered.add(key)
