"""The soak's verdict (benchmarks/soak.py): what fails a days-long run, read from its
samples; the soak itself runs for minutes against a real server and is not in the suite."""

from __future__ import annotations

import pytest
from bench_scripts import load_benchmark


@pytest.fixture(scope="module")
def soak():
    return load_benchmark("soak")


def result(lost=0, back_at_s=50.0, shm=100, sockets=3):
    return {"outcomes": {"ok": 10, "clean": 2, "lost": lost, "not_sent": 0},
            "kills": [{"at_s": 20.0, "back_at_s": back_at_s}],
            "health_at_end": {"m": {"status": "ok", "restarts": 1}},
            "left_after_stop": {"shm_bytes_before": 100, "shm_bytes": shm,
                                "socket_files_before": 3, "socket_files": sockets}}


def samples(soak, rss_of):
    return [soak.Sample(at_s=2.0 * i, rss_mib=rss_of(2.0 * i), fds=20, threads=10,
                        shm_mib=1.0, socket_files=7) for i in range(200)]


def test_a_flat_run_passes_from_its_first_recovery_on(soak):
    # Before the first recovery the RSS climbs (warm-up); after it, flat.
    flat = samples(soak, lambda t: 600 + min(t, 50) * 4)
    verdict, rss = soak.verdict(result(), flat)
    assert verdict == "pass"
    assert rss["warm_from_s"] == 50.0 and rss["start_mib"] == rss["end_mib"] == 800


@pytest.mark.parametrize(("kw", "rss_of", "reason"), [
    ({}, lambda t: 800 + t / 2, "gateway RSS grew"),
    ({"lost": 1}, lambda t: 800, "1 requests lost"),
    ({"back_at_s": None}, lambda t: 800, "did not come back"),
    ({"shm": 4196}, lambda t: 800, "/dev/shm holds 4096 bytes more"),
    ({"sockets": 10}, lambda t: 800, "7 socket files more"),
])
def test_what_fails_a_soak_is_named(soak, kw, rss_of, reason):
    verdict, _ = soak.verdict(result(**kw), samples(soak, rss_of))
    assert verdict.startswith("fail: ") and reason in verdict, verdict
