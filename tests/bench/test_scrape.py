"""Gauges scraped from a server's /metrics during a run (weaver/bench/scrape.py): parsing,
the window mean, a run against the fake server that stores them, and a server without
/metrics that costs the run nothing."""

from __future__ import annotations

import argparse
import logging

from bench_fake_server import FakeBehavior

from weaver.bench.loadgen import LoadGenConfig
from weaver.bench.runner import run_benchmark
from weaver.bench.scrape import GaugeScraper, gauge_samples, series_key, window_mean
from weaver.cli import bench
from weaver.results.records import load_result
from weaver.workloads.types import TraceRequest

METRICS = """# HELP weaver_num_running Sequences running
# TYPE weaver_num_running gauge
weaver_num_running{model="hot"} 5.0
weaver_num_running{model="cold"} 2.0
# TYPE weaver_offload_tasks counter
weaver_offload_tasks_total{cold="cold",hot="hot"} 9.0
# TYPE weaver_remote_kv_blocks_used gauge
weaver_remote_kv_blocks_used{hot="hot",cold="cold"} 40.0
"""


def test_gauges_are_read_per_label_set_and_counters_ignored():
    found = gauge_samples(METRICS, ["weaver_num_running", "weaver_remote_kv_blocks_used",
                                    "weaver_offload_tasks"])
    assert found == {
        'weaver_num_running{model="cold"}': 2.0,
        'weaver_num_running{model="hot"}': 5.0,
        'weaver_remote_kv_blocks_used{cold="cold",hot="hot"}': 40.0,  # labels sorted
    }
    assert series_key("up", {}) == "up"


def test_window_mean_takes_the_samples_inside_the_window():
    points = [(0.5, 1.0), (1.0, 3.0), (2.0, 5.0), (9.0, 100.0)]
    assert window_mean(points, 0.0, 2.0) == 3.0
    assert window_mean(points, 3.0, 4.0) is None


def _requests(num: int, rate: float) -> list[TraceRequest]:
    return [TraceRequest((i + 1) / rate, 4, 6, "m", i) for i in range(num)]


def test_a_run_keeps_the_gauges_it_scraped(fake_server):
    # 2 slots, 0.1 s a request, 40 requests at 40 req/s: the slots are full and a queue
    # waits through most of the 1 s of arrivals.
    server = fake_server(FakeBehavior(ttft_s=0.05, itl_s=0.01, num_slots=2))
    config = LoadGenConfig(server.url, show_progress=False, scrape_interval_s=0.05,
                           scrape_metrics=("fake_streaming", "fake_waiting"))
    run = run_benchmark("fake", _requests(40, 40.0), config, rate=40.0)
    assert set(run.scraped) == {'fake_streaming{model="m"}', "fake_waiting"}
    streaming = run.scraped['fake_streaming{model="m"}']
    assert len(streaming) >= 5 and all(0 <= value <= 2 for _, value in streaming)
    assert max(value for _, value in streaming) == 2
    assert max(value for _, value in run.scraped["fake_waiting"]) >= 5
    times = [t for t, _ in streaming]
    assert times == sorted(times) and times[-1] <= run.duration_s + 1.0
    assert list(run.loadgen["scrape_metrics"]) == ["fake_streaming", "fake_waiting"]


def test_failed_scrapes_are_counted_and_the_run_goes_on(fake_server, caplog):
    server = fake_server(FakeBehavior(ttft_s=0.01, itl_s=0.01))
    # A port nothing listens on: every scrape fails, the load still goes to the fake.
    scraper = GaugeScraper("http://127.0.0.1:9", ["up"], interval_s=0.02)
    with caplog.at_level(logging.WARNING), scraper:
        run = run_benchmark("fake", _requests(5, 50.0),
                            LoadGenConfig(server.url, show_progress=False), rate=50.0)
    assert scraper.failed_scrapes >= 1 and "scrapes of http://127.0.0.1:9/metrics" in caplog.text
    assert scraper.samples == {} and run.scraped == {}
    assert all(r.status.value == "ok" for r in run.records)


def test_cli_scrapes_and_prints_the_means(fake_server, tmp_path, capsys, monkeypatch):
    server = fake_server(FakeBehavior(ttft_s=0.02, itl_s=0.005, num_slots=4))
    out = tmp_path / "r.json"
    argv = ["bench", "run", "--url", f"{server.url}/v1", "--rate", "40", "--model", "m",
            "--num-requests", "20", "--length-scale", "0.01", "--max-model-len", "16",
            "--no-progress", "--scrape-metric", "fake_streaming", "--scrape-metric",
            "fake_waiting", "--scrape-interval-s", "0.05", "--out", str(out)]
    monkeypatch.setattr("sys.argv", ["weaver", *argv])
    parser = argparse.ArgumentParser(prog="weaver")
    bench.register(parser.add_subparsers())
    args = parser.parse_args(argv)
    assert args.handler(args) == 0
    printed = capsys.readouterr().out
    assert 'fake_streaming{model="m"}' in printed and "(while the requests arrived)" in printed
    (run,) = load_result(out).runs
    assert run.scraped['fake_streaming{model="m"}']  # kept in the results file
    args = parser.parse_args(["bench", "summary", str(out)])
    assert args.handler(args) == 0
    assert "fake_waiting" in capsys.readouterr().out
    args = parser.parse_args(["bench", "plot", str(out), "--out-dir", str(tmp_path / "png")])
    assert args.handler(args) == 0
    assert (tmp_path / "png" / "scraped.png").stat().st_size > 0
