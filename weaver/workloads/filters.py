"""The papers' row filters, as named predicates over `TraceRow`.

Each mirrors the Weaver artifact's digest script (github.com/gswxp2/weaver, commit 2644f41),
(weaver/workloads/data/README.md); the paper's text ("longer than 2048 dropped") differs
slightly, and the artifact's rule is the one that reproduces its reported means.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from weaver.workloads.traces import TraceRow

RowFilter = Callable[[TraceRow], bool]

# Weaver's `digest_azure.py` and `digest_burst.py` both keep input + output < 2000.
MAX_TOTAL_TOKENS = 2000
# `digest_burst.py` drops responses of 3 tokens or fewer (failed or trivial answers).
MIN_BURSTGPT_RESPONSE_TOKENS = 4
BURSTGPT_MODEL = "GPT-4"


def weaver_azure_filter(row: TraceRow) -> bool:
    """Keep a row iff input + output < 2000 tokens (Azure-Conv: 16,461 rows, 749.5/232.4)."""
    return row.input_tokens + row.output_tokens < MAX_TOTAL_TOKENS


def burstgpt_filter(row: TraceRow) -> bool:
    """Keep GPT-4 rows with Request + Response < 2000 and Response > 3 (paper: 575/340)."""
    return (
        row.trace_model == BURSTGPT_MODEL
        and row.input_tokens + row.output_tokens < MAX_TOTAL_TOKENS
        and row.output_tokens >= MIN_BURSTGPT_RESPONSE_TOKENS
    )


def keep_all(row: TraceRow) -> bool:
    return True


FILTERS: dict[str, RowFilter] = {
    "weaver-azure": weaver_azure_filter,
    "burstgpt": burstgpt_filter,
    "none": keep_all,
}


def default_filter_name(trace: str) -> str:
    """The filter the Weaver paper applies to a trace given as the CLI's --trace value (a
    uniform trace's lengths are as asked: none)."""
    if trace.startswith("uniform:"):
        return "none"
    return "burstgpt" if trace.startswith("burstgpt:") else "weaver-azure"


def get_filter(name: str) -> RowFilter:
    if name not in FILTERS:
        raise ValueError(f"unknown filter {name!r}; choose one of {sorted(FILTERS)}")
    return FILTERS[name]


def apply_filter(rows: Iterable[TraceRow], row_filter: RowFilter) -> list[TraceRow]:
    return [row for row in rows if row_filter(row)]
