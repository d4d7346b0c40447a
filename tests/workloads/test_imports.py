"""Workloads and bench import without vLLM, torch or CuPy (house rule for bookkeeping)."""

from __future__ import annotations

import subprocess
import sys

MODULES = [
    "weaver.workloads.builder",
    "weaver.workloads.traces",
    "weaver.bench.loadgen",
    "weaver.results.metrics",
    "weaver.bench.plots",
    "weaver.bench.compare",
    "weaver.cli.bench",
]


def test_imports_stay_light():
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in MODULES)
        + "heavy = [m for m in ('vllm', 'torch', 'cupy', 'matplotlib') if m in sys.modules]\n"
        + "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
