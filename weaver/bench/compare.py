"""Run one workload against several deployments in turn and compare them.

Takes already-running endpoints as (label, base_url) pairs; starting the deployments
themselves belongs to the server side of Weaver, which calls this once they are up.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from weaver.bench.loadgen import LoadGenConfig
from weaver.bench.runner import run_benchmark, with_base_url
from weaver.results.goodput import Slo
from weaver.results.metrics import IsolatedEstimate
from weaver.results.records import RunResult
from weaver.workloads.types import TraceRequest

logger = logging.getLogger(__name__)


def parse_target(text: str) -> tuple[str, str]:
    """`LABEL=URL` (the CLI's --target value)."""
    label, sep, url = text.partition("=")
    if not sep or not label.strip() or not url.strip():
        raise ValueError(f"--target {text!r}: use LABEL=URL, e.g. weaver=http://127.0.0.1:8000")
    return label.strip(), url.strip()


def compare_deployments(
    targets: Sequence[tuple[str, str]],
    requests: Sequence[TraceRequest],
    config: LoadGenConfig,
    *,
    rate: float | None = None,
    workload: Mapping | None = None,
    isolated: Mapping[str, IsolatedEstimate] | None = None,
    slo: Slo | None = None,
) -> list[RunResult]:
    """The same requests, with the same arrival times, against each target in order."""
    labels = [label for label, _ in targets]
    if not targets:
        raise ValueError("compare needs at least one LABEL=URL target")
    if len(set(labels)) != len(labels):
        raise ValueError(f"target labels repeat in {labels}; give each deployment its own")
    runs = []
    for label, url in targets:
        logger.info("comparing: running %s at %s", label, url)
        runs.append(
            run_benchmark(
                label,
                requests,
                with_base_url(config, url),
                rate=rate,
                workload=workload,
                isolated=isolated,
                slo=slo,
            )
        )
    return runs
