"""Loaders for the request traces the Weaver paper evaluates on.

- Azure LLM inference trace 2023 (Splitwise, Patel et al. ISCA 2024), `conv` and `code`
  splits: columns TIMESTAMP, ContextTokens, GeneratedTokens, CRLF line endings. Shipped
  with Weaver (`weaver/workloads/data/`, CC-BY 4.0: provenance and attribution in its
  README.md), checked against their sha256 when read; another folder of the same files
  can be given instead (`traces_dir`, $WEAVER_TRACES_DIR).
- BurstGPT (Wang et al. KDD 2025): columns Timestamp (seconds from day start), Model,
  Request tokens, Response tokens, Total tokens, Log Type. Not shipped here: the loader
  takes a path to a file the user fetched.

- Uniform lengths, `uniform:IN_LO-IN_HI:OUT_LO-OUT_HI` (e.g. `uniform:16-48:64-160`): no
  file; rows of uniformly drawn prompt and output lengths, for workloads the traces lack
  (the Weaver paper's long-output experiment, Sec. 5.3, scaled to a small model).

Loaders return `TraceRow`s (timestamps relative to the first row, the trace's own model tag);
filters live in `filters.py` and turning rows into `TraceRequest`s in `builder.py`.
"""

from __future__ import annotations

import csv
import hashlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TypeVar

logger = logging.getLogger(__name__)

TRACES_DIR_ENV = "WEAVER_TRACES_DIR"
AZURE_FILES = {
    "azure-conv": "AzureLLMInferenceTrace_conv.csv",
    "azure-code": "AzureLLMInferenceTrace_code.csv",
}
# The shipped copies, byte for byte as published (weaver/workloads/data/README.md).
SHIPPED_TRACES_DIR = Path(__file__).resolve().parent / "data"
AZURE_SHA256 = {
    "AzureLLMInferenceTrace_conv.csv":
        "2f1e5b666d4e3055fdbba98598ce2ec307767b9064e03e2fa46676dbcc7d0bf8",
    "AzureLLMInferenceTrace_code.csv":
        "54e9a6d2a4bd06ba1e060304b900abbc74cbea53de96506e60fe5bb4f2277fb6",
}
T = TypeVar("T")


@dataclass(frozen=True)
class TraceRow:
    """One request of a trace, before any filter, sampling or scaling."""

    timestamp_s: float  # seconds after the trace's first row
    input_tokens: int
    output_tokens: int
    trace_model: str = ""  # the trace's own model tag (BurstGPT: "ChatGPT" or "GPT-4")


def resolve_traces_dir(traces_dir: str | os.PathLike[str] | None = None) -> Path:
    """The folder with the Azure CSVs: the argument, else $WEAVER_TRACES_DIR, else the
    copies shipped with Weaver."""
    if traces_dir is not None:
        path = Path(traces_dir)
    elif os.environ.get(TRACES_DIR_ENV):
        path = Path(os.environ[TRACES_DIR_ENV])
    else:
        path = SHIPPED_TRACES_DIR
    if not path.is_dir():
        raise ValueError(
            f"trace folder {path} does not exist; pass the folder that holds "
            f"{AZURE_FILES['azure-conv']} or set ${TRACES_DIR_ENV}"
        )
    return path


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


@dataclass(frozen=True)
class _Schema:
    """Where a trace keeps the fields of a `TraceRow`, and how its timestamps read."""

    timestamp: str
    input_tokens: str
    output_tokens: str
    model: str | None
    parse_timestamp: Callable[[str], float]

    @property
    def columns(self) -> tuple[str, ...]:
        names = (self.timestamp, self.input_tokens, self.output_tokens, self.model)
        return tuple(name for name in names if name)


def _parse_azure_timestamp(text: str) -> float:
    # `YYYY-MM-DD HH:MM:SS.fffffff`: 7 fractional digits, which strptime's %f (6 max) rejects.
    whole, _, fraction = text.strip().partition(".")
    # UTC so that no local DST change can bend the gaps.
    base = datetime.strptime(whole, "%Y-%m-%d %H:%M:%S").replace(tzinfo=timezone.utc)
    return base.timestamp() + (float("0." + fraction) if fraction else 0.0)


def _to_int(text: str) -> int:
    return int(float(text))


_AZURE_SCHEMA = _Schema(
    "TIMESTAMP", "ContextTokens", "GeneratedTokens", None, _parse_azure_timestamp
)
# BurstGPT's Timestamp is already in seconds (from 0:00:00 of the trace's first day).
_BURSTGPT_SCHEMA = _Schema("Timestamp", "Request tokens", "Response tokens", "Model", float)


def _field(
    path: Path, line: int, item: dict[str, str], column: str, parse: Callable[[str], T]
) -> T:
    try:
        return parse(item[column])
    except ValueError:
        raise ValueError(
            f"{path}:{line}: column {column!r} holds {item[column]!r}, which is not readable "
            "(a number, or for Azure a YYYY-MM-DD HH:MM:SS.fffffff time)"
        ) from None


def _load_csv(path: str | os.PathLike[str], schema: _Schema) -> list[TraceRow]:
    """Rows in file order, timestamps made relative to the first row."""
    path = Path(path)
    header, raw = _read_rows(path)
    _check_columns(path, header, schema.columns)
    rows: list[TraceRow] = []
    start_s: float | None = None
    for line, item in enumerate(raw, start=2):
        stamp = _field(path, line, item, schema.timestamp, schema.parse_timestamp)
        start_s = stamp if start_s is None else start_s
        rows.append(
            TraceRow(
                timestamp_s=stamp - start_s,
                input_tokens=_field(path, line, item, schema.input_tokens, _to_int),
                output_tokens=_field(path, line, item, schema.output_tokens, _to_int),
                trace_model=item[schema.model].strip() if schema.model else "",
            )
        )
    logger.debug("loaded %d rows from %s", len(rows), path)
    return rows


def load_azure(
    kind: str = "azure-conv", traces_dir: str | os.PathLike[str] | None = None
) -> list[TraceRow]:
    """All rows of one Azure 2023 trace (`azure-conv` or `azure-code`), in file order."""
    if kind not in AZURE_FILES:
        raise ValueError(f"unknown Azure trace {kind!r}; choose one of {sorted(AZURE_FILES)}")
    return load_azure_file(trace_file(kind, traces_dir))


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def check_shipped_trace(path: Path) -> None:
    """A shipped trace must be the published file (a damaged install would otherwise
    benchmark on other lengths without a word)."""
    if path.parent != SHIPPED_TRACES_DIR or path.name not in AZURE_SHA256:
        return
    found = file_sha256(path)
    if found != AZURE_SHA256[path.name]:
        raise ValueError(f"{path} is not the published trace (sha256 {found}, expected "
                         f"{AZURE_SHA256[path.name]}); reinstall Weaver")


def load_azure_file(path: str | os.PathLike[str]) -> list[TraceRow]:
    check_shipped_trace(Path(path).resolve())
    return _load_csv(path, _AZURE_SCHEMA)


def load_burstgpt(path: str | os.PathLike[str]) -> list[TraceRow]:
    """All rows of a BurstGPT CSV (e.g. `BurstGPT_without_fails_2.csv`), in file order.

    The `Model` column is kept as `trace_model` so that `filters.burstgpt_filter` can keep
    the GPT-4 rows as Weaver does.
    """
    return _load_csv(path, _BURSTGPT_SCHEMA)


UNIFORM_PREFIX = "uniform:"
UNIFORM_ROWS = 1000  # rows of a uniform trace (a workload samples its requests from them)


def uniform_rows(name: str) -> list[TraceRow]:
    """`uniform:IN_LO-IN_HI:OUT_LO-OUT_HI`: rows of lengths drawn uniformly (inclusive)
    from a fixed seed, so one name always means the same rows."""
    import numpy as np

    try:
        spans = [tuple(int(x) for x in part.split("-")) for part in
                 name.removeprefix(UNIFORM_PREFIX).split(":")]
        (in_lo, in_hi), (out_lo, out_hi) = spans
    except ValueError:
        raise ValueError(f"--trace {name!r}: use uniform:IN_LO-IN_HI:OUT_LO-OUT_HI, e.g. "
                         "uniform:16-48:64-160") from None
    if not (1 <= in_lo <= in_hi and 1 <= out_lo <= out_hi):
        raise ValueError(f"--trace {name!r}: lengths must be >= 1 with LO <= HI")
    rng = np.random.default_rng(0)
    inputs = rng.integers(in_lo, in_hi + 1, UNIFORM_ROWS)
    outputs = rng.integers(out_lo, out_hi + 1, UNIFORM_ROWS)
    return [TraceRow(0.0, int(i), int(o)) for i, o in zip(inputs, outputs, strict=True)]


def trace_file(name: str, traces_dir: str | os.PathLike[str] | None = None) -> Path:
    """The file a --trace value reads (recorded with a benchmark's results; a uniform
    trace has none: its name is returned as a path that is no file)."""
    if name.startswith(UNIFORM_PREFIX):
        return Path(name)
    if name in AZURE_FILES:
        return resolve_traces_dir(traces_dir) / AZURE_FILES[name]
    if name.startswith("burstgpt:"):
        return Path(name.removeprefix("burstgpt:"))
    raise ValueError(
        f"unknown trace {name!r}; use azure-conv, azure-code, burstgpt:PATH/TO/BurstGPT.csv "
        "or uniform:IN_LO-IN_HI:OUT_LO-OUT_HI"
    )


def load_trace(name: str, traces_dir: str | os.PathLike[str] | None = None) -> list[TraceRow]:
    """`azure-conv`, `azure-code`, `burstgpt:PATH` or `uniform:...` (the CLI's --trace)."""
    if name.startswith(UNIFORM_PREFIX):
        return uniform_rows(name)
    path = trace_file(name, traces_dir)
    return load_azure_file(path) if name in AZURE_FILES else load_burstgpt(path)
