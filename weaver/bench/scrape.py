"""Gauges of a server's /metrics sampled while a run sends its load.

A goodput point says whether a deployment kept up; the gauges say why: how many sequences
ran, how full each KV pool was, how many waited (`weaver_num_running`,
`weaver_kv_cache_usage`, `weaver_remote_kv_blocks_used`, ...). The scraper polls /metrics
from a thread every interval while the load generator runs and keeps each gauge's samples
per label set; the run stores them (`RunResult.scraped`) with times from the run's start.
A scrape that fails (the server busy past the timeout, an engine restarting) is counted and
skipped, never fatal to the run whose load it observes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence

import httpx
from prometheus_client.parser import text_string_to_metric_families

logger = logging.getLogger(__name__)

SCRAPE_TIMEOUT_S = 2.0


def series_key(name: str, labels: dict[str, str]) -> str:
    """`name{label="value",...}` with the labels sorted, as Prometheus prints a series."""
    inside = ",".join(f'{key}="{value}"' for key, value in sorted(labels.items()))
    return f"{name}{{{inside}}}" if inside else name


def gauge_samples(metrics_text: str, names: Iterable[str]) -> dict[str, float]:
    """The samples of the gauges `names` in a /metrics text, by series key."""
    wanted = set(names)
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        if family.name in wanted and family.type == "gauge":
            for sample in family.samples:
                found[series_key(sample.name, sample.labels)] = sample.value
    return found


class GaugeScraper:
    """Samples the gauges `names` of `base_url`/metrics every `interval_s` seconds from a
    thread, from `start()` until `stop()` (or the `with` block's end)."""

    def __init__(self, base_url: str, names: Sequence[str], interval_s: float = 1.0,
                 headers: dict[str, str] | None = None) -> None:
        if not names:
            raise ValueError("name at least one gauge to scrape")
        if not interval_s > 0:
            raise ValueError(f"--scrape-interval-s must be > 0, got {interval_s}")
        root = base_url.rstrip("/")
        self.url = (root[: -len("/v1")] if root.endswith("/v1") else root) + "/metrics"
        self.names = tuple(names)
        self.interval_s = interval_s
        self.headers = dict(headers or {})
        self.samples: dict[str, list[tuple[float, float]]] = {}  # key -> [(unix s, value)]
        self.failed_scrapes = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> GaugeScraper:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="gauge-scraper", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.failed_scrapes:
            logger.warning("%d scrapes of %s failed (skipped)", self.failed_scrapes, self.url)

    def _loop(self) -> None:
        with httpx.Client(timeout=SCRAPE_TIMEOUT_S, headers=self.headers) as client:
            while True:
                began = time.time()
                try:
                    response = client.get(self.url)
                    response.raise_for_status()
                    for key, value in gauge_samples(response.text, self.names).items():
                        self.samples.setdefault(key, []).append((began, value))
                except (httpx.HTTPError, ValueError) as error:
                    self.failed_scrapes += 1
                    logger.debug("scrape of %s failed: %s", self.url, error)
                if self._stop.wait(max(0.0, self.interval_s - (time.time() - began))):
                    return

    def series(self, since_unix: float) -> dict[str, list[tuple[float, float]]]:
        """Every series with its times in seconds from `since_unix` (the run's start)."""
        return {key: [(round(t - since_unix, 3), value) for t, value in points]
                for key, points in sorted(self.samples.items())}


def window_mean(points: Sequence[tuple[float, float]], start_s: float,
                end_s: float) -> float | None:
    """The mean of a series' samples taken in [start_s, end_s]; None when none was."""
    values = [value for t, value in points if start_s <= t <= end_s]
    return sum(values) / len(values) if values else None
