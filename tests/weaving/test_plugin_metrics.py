"""The pair's series in a plain `vllm serve`'s /metrics (weaver/weaving/plugin_metrics.py),
read from the counters each side publishes in the rendezvous directory."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from weaver.weaving import rendezvous
from weaver.weaving.plugin_metrics import PairStatsCollector


@pytest.fixture(autouse=True)
def runtime_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(rendezvous.RUNTIME_DIR_ENV, str(tmp_path))


def scrape(role: str) -> str:
    registry = CollectorRegistry()
    registry.register(PairStatsCollector(role, ("p1",)))
    return generate_latest(registry).decode()


def test_the_hot_server_exports_its_offload_counters_and_the_pair_state():
    assert 'weaver_pair_connected{pair="p1"} 0.0' in scrape("hot")  # nothing published yet
    rendezvous.publish("p1", "hot.stats", {
        "hot": "h", "remote_sequences": 3, "offloaded_tasks": 10, "fallback_tasks": 1,
        "attaches": 2, "connected": True})
    text = scrape("hot")
    for line in ('weaver_offload_sequences_total{model="h"} 3.0',
                 'weaver_offload_tasks_total{cold="p1",hot="h"} 10.0',
                 'weaver_offload_fallbacks_total{model="h"} 1.0',
                 'weaver_pair_attaches_total{pair="p1"} 2.0',
                 'weaver_pair_connected{pair="p1"} 1.0'):
        assert line in text


def test_the_cold_server_exports_its_time_on_the_hot_models_tasks():
    rendezvous.publish("p1", "cold.stats", {"hot": "h", "cold": "c",
                                            "busy_at_poll_points_s": 0.5,
                                            "busy_by_idle_poller_s": 0.25})
    text = scrape("cold")
    assert 'weaver_offload_cold_busy_seconds_total{cold="c",hot="h",where="poll_point"} 0.5' \
        in text
    assert 'weaver_offload_cold_busy_seconds_total{cold="c",hot="h",where="idle"} 0.25' in text


def test_registering_reads_no_file_and_makes_no_directory(tmp_path, monkeypatch):
    runtime = tmp_path / "not-yet"
    monkeypatch.setenv(rendezvous.RUNTIME_DIR_ENV, str(runtime))
    registry = CollectorRegistry()
    registry.register(PairStatsCollector("hot", ("p1",)))
    assert not runtime.exists()  # the first publisher makes it
    assert 'weaver_pair_connected{pair="p1"} 0.0' in generate_latest(registry).decode()
