"""A deployment's colocated groups in the serve lifecycle (`Colocation`): each engine's
`weaver.mux` block, their turn tables' counters in /metrics, and the tables removed when
the server stops.

The engines write the counters (weaver/mux/table.py); this collector reads them at each
scrape, so a scrape never waits on an engine.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from weaver.config.deployment import Deployment
from weaver.mux.table import GroupLayout, TurnTable, remove_table, table_path
from weaver.mux.turns import Mode
from weaver.server.features import ServeFeature
from weaver.vllm_ext.additional_config import mux_section
from weaver.vllm_ext.mux_gate import MuxMembership
from weaver.weaving.plan import default_shm_prefix


def mux_table_key(group: str) -> str:
    # The gateway's prefix keeps two servers of one deployment on a machine apart.
    return f"{default_shm_prefix()}-{group}"


def group_layouts(deployment: Deployment) -> list[GroupLayout]:
    return [GroupLayout(mux_table_key(g.name), tuple(g.models),
                        tuple(g.weight(m) for m in g.models), Mode(g.mode), g.skip_limit)
            for g in deployment.mux]


def mux_block(deployment: Deployment, model: str) -> dict | None:
    """The `weaver.mux` block of a colocated model's engine (weaver/vllm_ext/mux_gate.py)."""
    for group, layout in zip(deployment.mux, group_layouts(deployment), strict=True):
        if model in group.models:
            return MuxMembership(layout, model).to_dict()
    return None


class MuxTurnsCollector(Collector):
    """weaver_mux_* series, labelled by model and group."""

    def __init__(self, deployment: Deployment) -> None:
        self.groups = list(zip((g.name for g in deployment.mux), group_layouts(deployment),
                               strict=True))
        self._tables: dict[str, TurnTable] = {}

    def _table(self, name: str, layout: GroupLayout) -> TurnTable | None:
        if name not in self._tables:
            if not table_path(layout.group).exists():
                return None  # no engine of the group has started yet
            self._tables[name] = TurnTable.open(layout)
        return self._tables[name]

    def describe(self) -> Iterator:
        yield from self._families().values()

    def collect(self) -> Iterator:
        families = self._families()
        for name, layout in self.groups:
            table = self._table(name, layout)
            if table is None:
                continue
            for counters in table.counters():
                labels = [counters.name, name]
                families["steps"].add_metric([*labels, "prefill"], counters.num_prefill_steps)
                families["steps"].add_metric([*labels, "decode"], counters.num_decode_steps)
                families["overlapped"].add_metric(labels, counters.num_overlapped)
                families["wait"].add_metric(labels, counters.wait_s)
                families["served"].add_metric(labels, counters.served_s)
                families["reclaimed"].add_metric(labels, counters.num_reclaimed)
        yield from families.values()

    @staticmethod
    def _families() -> dict[str, CounterMetricFamily]:
        labels = ["model", "group"]
        return {
            "steps": CounterMetricFamily("weaver_mux_steps", "Steps the model's engine ran "
                                         "in its colocated group, by kind",
                                         labels=[*labels, "kind"]),
            "overlapped": CounterMetricFamily(
                "weaver_mux_overlapped_steps", "Steps started beside another model's step "
                "(spatial-temporal mode: a prefill beside a decode)", labels=labels),
            "wait": CounterMetricFamily("weaver_mux_turn_wait_seconds", "Time the model's "
                                        "steps waited for their turn", labels=labels),
            "served": CounterMetricFamily("weaver_mux_step_seconds", "Time the model's "
                                          "steps held their turn", labels=labels),
            "reclaimed": CounterMetricFamily(
                "weaver_mux_reclaimed_turns", "Turns taken back from the model's engine "
                "after it died during a step", labels=labels),
        }

    def close(self) -> None:
        for table in self._tables.values():
            table.close()
        self._tables.clear()


def remove_turn_tables(deployment: Deployment) -> None:
    for layout in group_layouts(deployment):
        remove_table(layout.group)


class Colocation(ServeFeature):
    """The deployment's colocated groups (MuxServe, Mux-Temporal)."""

    def __init__(self, deployment: Deployment) -> None:
        self.deployment = deployment

    def engine_section(self, model: str) -> dict[str, Any]:
        block = mux_block(self.deployment, model)
        return mux_section(block) if block is not None else {}

    def set_up(self, stack: contextlib.AsyncExitStack, registry: CollectorRegistry) -> None:
        if not self.deployment.mux:
            return
        collector = MuxTurnsCollector(self.deployment)
        registry.register(collector)
        stack.callback(remove_turn_tables, self.deployment)
        stack.callback(collector.close)
