"""What each request of the soak came to, from the load generator's record.

- ok: streamed to the end;
- clean: the client was told: an HTTP error with an OpenAI error body (429 and 503 with
  Retry-After), or an error event in its stream;
- no_retry_after: a 429 or 503 without Retry-After (told, but not when to come back);
- server_down: connection refused while the whole server was stopped for a restart (sent
  between its SIGTERM and its next /health 200): nobody listened, which is what a restart
  without a second replica means; counted apart, neither clean nor lost;
- lost: anything else (a dropped connection, a stream cut without a word, a hang past the
  client timeout, connection refused while the server was meant to be up);
- not_sent: its arrival fell after the load's deadline.
Pure: no engines, no HTTP.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Iterable, Sequence

OUTCOMES = ("ok", "clean", "no_retry_after", "server_down", "lost", "not_sent")
# weaver/bench/loadgen.py's message for an answer that is not 200.
_HTTP_ERROR = re.compile(r"^RuntimeError: HTTP (\d{3})( \(Retry-After: [^)]*\))?: (.*)$", re.S)
_STREAM_ERROR = "RuntimeError: server error in stream"
_CONNECT_ERROR = "ConnectError"
RETRY_STATUSES = (429, 503)  # the gateway's answers that say when to retry

Window = tuple[float, float]  # [from, to] in seconds since the load started


def classify(error: str | None, sent_at_s: float | None = None,
             down: Sequence[Window] = ()) -> str:
    """One of OUTCOMES but not_sent, for a request that was sent (error None: ok)."""
    if error is None:
        return "ok"
    http = _HTTP_ERROR.match(error)
    if http is not None:
        if '"error"' not in http.group(3):
            return "lost"  # not an OpenAI error body: not an answer a client can read
        if int(http.group(1)) in RETRY_STATUSES and http.group(2) is None:
            return "no_retry_after"
        return "clean"
    if error.startswith(_STREAM_ERROR):
        return "clean"
    if error.startswith(_CONNECT_ERROR) and sent_at_s is not None and in_any(sent_at_s, down):
        return "server_down"
    return "lost"


def in_any(at_s: float, windows: Iterable[Window]) -> bool:
    return any(start <= at_s <= end for start, end in windows)


def outcome_of(record, down: Sequence[Window] = ()) -> str:
    """A RequestRecord's outcome (an unfinished one, cancelled at the deadline, is lost)."""
    if record.sent_at_s is None:
        return "not_sent"
    if record.status.value not in ("ok", "error"):
        return "lost"
    return classify(record.error, record.sent_at_s, down)


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"n": 0, "p50_s": None, "p99_s": None}
    ordered = sorted(values)
    return {"n": len(values), "p50_s": statistics.median(ordered),
            "p99_s": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]}


def summarize(records: list, recoveries: Sequence[Window], down: Sequence[Window]) -> dict:
    """Outcome counts, failure reasons, and the latency of ok requests that overlapped a
    recovery window (an engine killed -> back) against those that did not."""
    outcomes = dict.fromkeys(OUTCOMES, 0)
    reasons: dict[str, int] = {}
    during, outside = [], []
    for record in records:
        kind = outcome_of(record, down)
        outcomes[kind] += 1
        if record.error:
            reason = record.error.split(":", 2)[-1].strip()[:100]
            reasons[reason] = reasons.get(reason, 0) + 1
        if kind != "ok" or record.e2e_s is None:
            continue
        end = record.sent_at_s + record.e2e_s
        overlaps = any(start <= end and record.sent_at_s <= back for start, back in recoveries)
        (during if overlaps else outside).append(record.e2e_s)
    return {"outcomes": outcomes, "failure_reasons": reasons,
            "latency_during_recovery": percentiles(during),
            "latency_outside_recovery": percentiles(outside)}


def outcomes_per_minute(sent_and_kinds: Iterable[tuple[float, str]]) -> list[dict[str, int]]:
    """Outcome counts by the minute a request was sent in (index = minute), for the plot."""
    minutes: list[dict[str, int]] = []
    for sent_at_s, kind in sent_and_kinds:
        minute = int(sent_at_s // 60)
        while len(minutes) <= minute:
            minutes.append(dict.fromkeys(OUTCOMES, 0))
        minutes[minute][kind] += 1
    return minutes
