"""Loaders for the request traces the Weaver paper evaluates on.

- Azure LLM inference trace 2023 (Splitwise, Patel et al. ISCA 2024), `conv` and `code`
  splits: columns TIMESTAMP, ContextTokens, GeneratedTokens, CRLF line endings. They are
  read in place from `shared/traces` (see shared/traces/README.md), never copied.
- BurstGPT (Wang et al. KDD 2025): columns Timestamp (seconds from day start), Model,
  Request tokens, Response tokens, Total tokens, Log Type. Not shipped here: the loader
  takes a path to a file the user fetched.

Loaders return `TraceRow`s (timestamps relative to the first row, the trace's own model tag);
filters live in `filters.py` and turning rows into `TraceRequest`s in `builder.py`.
"""

from __future__ import annotations

import csv
import logging
import os
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

logger = logging.getLogger(__name__)

TRACES_DIR_ENV = "WEAVER_TRACES_DIR"
AZURE_FILES = {
    "azure-conv": "AzureLLMInferenceTrace_conv.csv",
    "azure-code": "AzureLLMInferenceTrace_code.csv",
}
_AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_BURSTGPT_COLUMNS = ("Timestamp", "Model", "Request tokens", "Response tokens")


@dataclass(frozen=True)
class TraceRow:
    """One request of a trace, before any filter, sampling or scaling."""

    timestamp_s: float  # seconds after the trace's first row
    input_tokens: int
    output_tokens: int
    trace_model: str = ""  # the trace's own model tag (BurstGPT: "ChatGPT" or "GPT-4")


def repo_root() -> Path:
    # weaver/workloads/traces.py -> the checkout that holds the `weaver` package.
    return Path(__file__).resolve().parents[2]


def resolve_traces_dir(traces_dir: str | os.PathLike[str] | None = None) -> Path:
    """The folder with the Azure CSVs: the argument, else $WEAVER_TRACES_DIR, else
    `<repo>/../shared/traces` (where every checkout of this project finds shared/)."""
    if traces_dir is not None:
        path = Path(traces_dir)
    elif os.environ.get(TRACES_DIR_ENV):
        path = Path(os.environ[TRACES_DIR_ENV])
    else:
        path = repo_root().parent / "shared" / "traces"
    if not path.is_dir():
        raise ValueError(
            f"trace folder {path} does not exist; pass the folder that holds "
            f"{AZURE_FILES['azure-conv']} or set ${TRACES_DIR_ENV}"
        )
    return path


def _parse_azure_timestamp(text: str) -> float:
    # `YYYY-MM-DD HH:MM:SS.fffffff`: 7 fractional digits, which strptime's %f (6 max) rejects.
    whole, _, fraction = text.strip().partition(".")
    # UTC so that no local DST change can bend the gaps.
    base = datetime.strptime(whole, "%Y-%m-%d %H:%M:%S").replace(tzinfo=timezone.utc)
    base = base.timestamp()
    return base + (float("0." + fraction) if fraction else 0.0)


def _check_columns(path: Path, header: list[str] | None, required: tuple[str, ...]) -> None:
    missing = [name for name in required if name not in (header or [])]
    if missing:
        raise ValueError(
            f"{path}: missing column(s) {missing}; expected a header with {list(required)}, "
            f"found {header}"
        )


def _read_rows(path: Path) -> tuple[list[str] | None, list[dict[str, str]]]:
    if not path.is_file():
        raise ValueError(f"trace file {path} does not exist; check the path")
    # newline="" lets the csv module handle the CRLF endings of the Azure files.
    with path.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
        return (list(reader.fieldnames) if reader.fieldnames else None), rows


def _to_int(path: Path, line: int, column: str, text: str) -> int:
    try:
        return int(float(text))
    except ValueError:
        raise ValueError(f"{path}:{line}: column {column!r} is not a number: {text!r}") from None


def load_azure(
    kind: str = "azure-conv", traces_dir: str | os.PathLike[str] | None = None
) -> list[TraceRow]:
    """All rows of one Azure 2023 trace (`azure-conv` or `azure-code`), in file order."""
    if kind not in AZURE_FILES:
        raise ValueError(f"unknown Azure trace {kind!r}; choose one of {sorted(AZURE_FILES)}")
    path = resolve_traces_dir(traces_dir) / AZURE_FILES[kind]
    return load_azure_file(path)


def load_azure_file(path: str | os.PathLike[str]) -> list[TraceRow]:
    path = Path(path)
    header, raw = _read_rows(path)
    _check_columns(path, header, _AZURE_COLUMNS)
    rows: list[TraceRow] = []
    start_s: float | None = None
    for line, item in enumerate(raw, start=2):
        stamp = _parse_azure_timestamp(item["TIMESTAMP"])
        start_s = stamp if start_s is None else start_s
        rows.append(
            TraceRow(
                timestamp_s=stamp - start_s,
                input_tokens=_to_int(path, line, "ContextTokens", item["ContextTokens"]),
                output_tokens=_to_int(path, line, "GeneratedTokens", item["GeneratedTokens"]),
            )
        )
    logger.debug("loaded %d rows from %s", len(rows), path)
    return rows


def load_burstgpt(path: str | os.PathLike[str]) -> list[TraceRow]:
    """All rows of a BurstGPT CSV (e.g. `BurstGPT_without_fails_2.csv`), in file order.

    Timestamps are made relative to the first row; the `Model` column is kept as
    `trace_model` so that `filters.burstgpt_filter` can keep the GPT-4 rows as Weaver does.
    """
    path = Path(path)
    header, raw = _read_rows(path)
    _check_columns(path, header, _BURSTGPT_COLUMNS)
    rows: list[TraceRow] = []
    start_s: float | None = None
    for line, item in enumerate(raw, start=2):
        try:
            stamp = float(item["Timestamp"])
        except ValueError:
            raise ValueError(
                f"{path}:{line}: Timestamp {item['Timestamp']!r} is not a number of seconds"
            ) from None
        start_s = stamp if start_s is None else start_s
        rows.append(
            TraceRow(
                timestamp_s=stamp - start_s,
                input_tokens=_to_int(path, line, "Request tokens", item["Request tokens"]),
                output_tokens=_to_int(path, line, "Response tokens", item["Response tokens"]),
                trace_model=item["Model"].strip(),
            )
        )
    logger.debug("loaded %d rows from %s", len(rows), path)
    return rows


def load_trace(name: str, traces_dir: str | os.PathLike[str] | None = None) -> list[TraceRow]:
    """`azure-conv`, `azure-code` or `burstgpt:PATH` (the CLI's --trace value)."""
    if name in AZURE_FILES:
        return load_azure(name, traces_dir)
    if name.startswith("burstgpt:"):
        return load_burstgpt(name.removeprefix("burstgpt:"))
    raise ValueError(
        f"unknown trace {name!r}; use azure-conv, azure-code or burstgpt:PATH/TO/BurstGPT.csv"
    )
