"""The pairs' series in /metrics (weaver/weaving/pair_metrics.py), read from the counters
each side publishes in the pairs' directory: the one exporter of both launchers."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from weaver.weaving.pair_metrics import PairStatsCollector
from weaver.weaving.rendezvous import PairFiles
from weaver.weaving.series import WAIT_BUCKETS


@pytest.fixture
def files(tmp_path) -> PairFiles:
    return PairFiles(tmp_path)


def registry_of(files: PairFiles, role: str) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(PairStatsCollector(files, role, ("p1",)))
    return registry


def scrape(files: PairFiles, role: str) -> str:
    return generate_latest(registry_of(files, role)).decode()


def test_the_hot_side_exports_its_offload_counters_and_the_pair_state(files):
    assert 'weaver_pair_connected{pair="p1"} 0.0' in scrape(files, "hot")  # nothing yet
    counts = [0] * (len(WAIT_BUCKETS) + 1)
    counts[WAIT_BUCKETS.index(1e-3)] = 2
    counts[-1] = 1
    files.publish("p1", "hot.stats", {
        "hot": "h", "cold": "c", "remote_sequences": 3, "offloaded_tasks": 10,
        "fallback_tasks": 1, "attaches": 2, "resumes": 1, "connected": True,
        "remote_blocks_used": 5, "wait_counts": counts, "wait_sum_s": 7.5,
        "cold_budget_preemptions": 4})
    text = scrape(files, "hot")
    for line in ('weaver_offload_sequences_total{model="h"} 3.0',
                 'weaver_weaving_cold_budget_preemptions_total{cold="c",hot="h"} 4.0',
                 'weaver_offload_tasks_total{cold="c",hot="h"} 10.0',
                 'weaver_offload_fallbacks_total{model="h"} 1.0',
                 'weaver_pair_attaches_total{pair="p1"} 2.0',
                 'weaver_pair_resumes_total{pair="p1"} 1.0',
                 'weaver_pair_connected{pair="p1"} 1.0',
                 'weaver_remote_kv_blocks_used{cold="c",hot="h"} 5.0',
                 'weaver_offload_wait_seconds_bucket{cold="c",hot="h",le="0.00075"} 0.0',
                 'weaver_offload_wait_seconds_bucket{cold="c",hot="h",le="0.001"} 2.0',
                 'weaver_offload_wait_seconds_bucket{cold="c",hot="h",le="5.0"} 2.0',
                 'weaver_offload_wait_seconds_bucket{cold="c",hot="h",le="+Inf"} 3.0',
                 'weaver_offload_wait_seconds_count{cold="c",hot="h"} 3.0',
                 'weaver_offload_wait_seconds_sum{cold="c",hot="h"} 7.5'):
        assert line in text


def test_counters_keep_growing_across_a_restart_of_their_writer(files):
    registry = registry_of(files, "hot")

    def tasks() -> float | None:
        return registry.get_sample_value("weaver_offload_tasks_total", {"hot": "h", "cold": "c"})

    def publish(pid: int, total: int) -> None:
        files.path("p1", "hot.stats").write_text(
            f'{{"hot": "h", "cold": "c", "offloaded_tasks": {total}, "pid": {pid}}}')

    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) as successor:
        try:
            publish(os.getpid(), 25)
            assert tasks() == 25
            publish(os.getpid(), 20)  # a stale read of the same writer: no decrease
            assert tasks() == 25
            publish(successor.pid, 7)  # the hot engine restarted: it counts from 0
            assert tasks() == 32
            publish(successor.pid, 9)
            assert tasks() == 34
        finally:
            successor.kill()
    successor.wait()
    assert tasks() == 34  # its writer gone, the counter stays where it was
    assert registry.get_sample_value("weaver_pair_connected", {"pair": "p1"}) == 0


def test_a_file_left_by_a_writer_that_died_before_counts_for_nothing(files):
    """A new `vllm serve` of the hot model, started after its predecessor was killed,
    counts from 0: the predecessor's stats file is not its own."""
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    files.path("p1", "hot.stats").parent.mkdir(parents=True, exist_ok=True)
    files.path("p1", "hot.stats").write_text(
        f'{{"hot": "h", "cold": "c", "fallback_tasks": 1050, "pid": {int(done.stdout)}}}')
    registry = registry_of(files, "hot")
    assert registry.get_sample_value("weaver_offload_fallbacks_total", {"model": "h"}) is None
    files.publish("p1", "hot.stats", {"hot": "h", "cold": "c", "fallback_tasks": 0})
    assert registry.get_sample_value("weaver_offload_fallbacks_total", {"model": "h"}) == 0


def test_the_cold_side_exports_its_time_on_the_hot_models_tasks(files):
    files.publish("p1", "cold.stats", {"hot": "h", "cold": "c", "busy_at_poll_points_s": 0.5,
                                       "busy_by_idle_poller_s": 0.25})
    text = scrape(files, "cold")
    assert 'weaver_offload_cold_busy_seconds_total{cold="c",hot="h",where="poll_point"} 0.5' \
        in text
    assert 'weaver_offload_cold_busy_seconds_total{cold="c",hot="h",where="idle"} 0.25' in text


def test_registering_reads_no_file_and_makes_no_directory(tmp_path):
    files = PairFiles(tmp_path / "not-yet")
    text = scrape(files, "hot")
    assert not files.root.exists()  # the first publisher makes it
    assert 'weaver_pair_connected{pair="p1"} 0.0' in text


def test_a_hot_model_over_two_colds_exports_one_sample_per_model_and_one_per_pair(files):
    registry = CollectorRegistry()
    registry.register(PairStatsCollector(files, "hot", ("p1", "p2")))
    for pair, cold, tasks in (("p1", "c1", 4), ("p2", "c2", 6)):
        files.publish(pair, "hot.stats", {"hot": "h", "cold": cold, "remote_sequences": 2,
                                          "offloaded_tasks": tasks, "fallback_tasks": 1})
    text = generate_latest(registry).decode()
    assert text.count("weaver_offload_fallbacks_total{") == 1
    assert 'weaver_offload_fallbacks_total{model="h"} 2.0' in text
    assert 'weaver_offload_sequences_total{model="h"} 4.0' in text
    assert 'weaver_offload_tasks_total{cold="c1",hot="h"} 4.0' in text
    assert 'weaver_offload_tasks_total{cold="c2",hot="h"} 6.0' in text
