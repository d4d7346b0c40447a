"""One benchmark run: send a workload to one deployment and summarise what came back."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from typing import Any

from weaver.bench.loadgen import LoadGenConfig, run_load_sync
from weaver.bench.scrape import GaugeScraper
from weaver.results.goodput import Slo
from weaver.results.metrics import IsolatedEstimate, by_model, slo_summary, summarize
from weaver.results.records import ALL_MODELS, RunResult
from weaver.workloads.types import TraceRequest

logger = logging.getLogger(__name__)


def run_benchmark(
    label: str,
    requests: Sequence[TraceRequest],
    config: LoadGenConfig,
    *,
    rate: float | None = None,
    workload: Mapping[str, Any] | None = None,
    isolated: Mapping[str, IsolatedEstimate] | None = None,
    slo: Slo | None = None,
    roles: Mapping[str, str] | None = None,
) -> RunResult:
    """Run `requests` against `config.base_url` and return records plus summaries; SLO
    numbers are added where `isolated` estimates or an `slo` are given."""
    if not requests:
        raise ValueError("the workload is empty; raise --num-requests")
    missing = sorted({r.model for r in requests} - set(isolated or {}))
    if isolated is not None and missing:
        # Checked before sending: failing after a long run would throw its records away.
        raise ValueError(f"no isolated latency estimate for model(s) {missing}")
    logger.info("run %s: %d requests to %s", label, len(requests), config.base_url)
    if config.scrape_metrics:
        headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else None
        with GaugeScraper(config.base_url, config.scrape_metrics, config.scrape_interval_s,
                          headers) as scraper:
            outcome = run_load_sync(requests, config)
        scraped = scraper.series(since_unix=outcome.started_at_unix)
    else:
        outcome, scraped = run_load_sync(requests, config), {}
    duration_s = max(outcome.duration_s, 1e-9)
    records = outcome.records
    slo_summaries = {}
    if isolated is not None or slo is not None:
        for model, mine in by_model(records).items():
            slo_summaries[model] = slo_summary(mine, duration_s, isolated, slo)
        slo_summaries[ALL_MODELS] = slo_summary(records, duration_s, isolated, slo)
    started = datetime.fromtimestamp(outcome.started_at_unix, timezone.utc)
    return RunResult(
        label=label,
        base_url=config.base_url,
        rate=rate,
        started_at=started.isoformat(timespec="seconds"),
        duration_s=duration_s,
        workload=dict(workload or {}),
        loadgen=config.to_json(),
        records=records,
        summary=summarize(records, duration_s),
        slo=slo_summaries,
        isolated={m: est.model_dump() for m, est in (isolated or {}).items()},
        roles=dict(roles or {}),
        scraped=scraped,
    )


def with_base_url(config: LoadGenConfig, base_url: str) -> LoadGenConfig:
    return dataclasses.replace(config, base_url=base_url)
