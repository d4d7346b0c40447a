"""The soak's verdict: 'pass', or 'fail: ' and every reason, read from the result and the
samples (pure: no engines). What fails a days-long run:

- a request lost (outcomes.py; `server_down` is not lost), or a 429/503 without Retry-After;
- an engine that did not come back after a kill, or a server after a restart; a role left
  unkilled although the run had a kill for every role; an engine or a weaving pair not `ok`
  at the end (a pair gets the run's last minutes to link again by itself);
- the gateway's RSS growing more than 5 % within one life of the server, from warm-up (its
  first recovered kill, else its first minute) to its end;
- a /dev/shm file or a socket file left by the server after any of its stops;
- the plain `vllm serve` phase, when it ran: a request lost, a server not back, a file left.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

MAX_RSS_GROWTH = 0.05  # of the gateway's RSS after warm-up, start to end of a life
RSS_WINDOW = 30  # samples (a minute at 2 s) whose median is a life's start or end


@dataclass
class Sample:
    at_s: float  # since the load started
    rss_mib: float  # the gateway's
    fds: int
    threads: int
    shm_mib: float  # /dev/shm the server's processes map
    socket_files: int  # vLLM's, under the soak's own VLLM_RPC_BASE_PATH
    life: int = 0  # which start of the server (0: the first, +1 per restart)
    shm_total_mib: float = 0.0  # all of /dev/shm, other users' files too


def rss_by_life(samples: list[Sample], kills: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per life of the gateway: its RSS after warm-up, a minute's median at each end (one
    sample may catch a request's transient buffers)."""
    lives = []
    for life in sorted({s.life for s in samples}):
        own = [s for s in samples if s.life == life]
        first, last = own[0].at_s, own[-1].at_s
        backs = [k["back_at_s"] for k in kills
                 if k["back_at_s"] is not None and first <= k["at_s"] <= last]
        warm_at = min(backs, default=min(first + 60.0, last))
        warm = [s.rss_mib for s in own if s.at_s >= warm_at]
        window = min(RSS_WINDOW, max(1, len(warm) // 2))
        lives.append({"life": life, "warm_from_s": warm_at,
                      "start_mib": statistics.median(warm[:window]) if warm else None,
                      "end_mib": statistics.median(warm[-window:]) if warm else None})
    return lives


def _rss_reasons(lives: list[dict[str, Any]]) -> list[str]:
    return [f"gateway RSS grew from {life['start_mib']:.0f} to {life['end_mib']:.0f} MiB after "
            f"warm-up (life {life['life']})" for life in lives
            if life["start_mib"] and life["end_mib"] > (1 + MAX_RSS_GROWTH) * life["start_mib"]]


def _request_reasons(outcomes: dict[str, int]) -> list[str]:
    reasons = []
    if outcomes.get("lost"):
        reasons.append(f"{outcomes['lost']} requests lost")
    if outcomes.get("no_retry_after"):
        reasons.append(f"{outcomes['no_retry_after']} 429/503 answers without Retry-After")
    return reasons


def _engine_reasons(result: dict[str, Any]) -> list[str]:
    reasons = []
    if any(k["back_at_s"] is None for k in result["kills"]):
        reasons.append("an engine did not come back")
    if result.get("roles_not_killed") and len(result["kills"]) >= result.get("num_roles", 0):
        reasons.append(f"roles never killed: {result['roles_not_killed']}")
    down = {n: e["status"] for n, e in result["health_at_end"].items() if e["status"] != "ok"}
    if down:
        reasons.append(f"not every engine in service at the end: {down}")
    pairs = {n: s for n, s in result.get("pairs_at_end", {}).items() if s != "ok"}
    if pairs:
        reasons.append(f"weaving pairs not ok at the end: {pairs}")
    if any(r["back_at_s"] is None for r in result.get("server_restarts", [])):
        reasons.append("the server did not come back after a restart")
    return reasons


def leftover_reasons(where: str, left: dict[str, Any]) -> list[str]:
    """`left` (watch.ShmLedger.left): what a stop left: /dev/shm files new since the start,
    socket files, processes still alive."""
    reasons = []
    if left.get("shm_files"):
        reasons.append(f"{where}: /dev/shm holds {left['shm_bytes']} bytes in "
                       f"{len(left['shm_files'])} files it did not hold before")
    if left.get("socket_files"):
        reasons.append(f"{where}: {left['socket_files']} socket files left")
    if left.get("survivors"):
        reasons.append(f"{where}: {left['survivors']} of its processes outlived it")
    return reasons


def _plain_reasons(plain: dict[str, Any] | None) -> list[str]:
    if not plain:
        return []
    reasons = [f"plain vllm serve: {r}" for r in _request_reasons(plain["outcomes"])]
    if plain.get("not_back"):
        reasons.append(f"plain vllm serve: not serving again: {plain['not_back']}")
    return reasons + leftover_reasons("plain vllm serve", plain["left_after_stop"])


def verdict(result: dict[str, Any], samples: list[Sample]) -> tuple[str, list[dict[str, Any]]]:
    """'pass' or 'fail: reasons', and the per-life RSS comparison it read."""
    lives = rss_by_life(samples, result["kills"])
    reasons = [*_request_reasons(result["outcomes"]), *_engine_reasons(result),
               *_rss_reasons(lives)]
    for stop in result.get("left_after_restarts", []):
        reasons += leftover_reasons(f"after the restart at {stop['at_s']:.0f} s", stop)
    reasons += leftover_reasons("after the final stop", result["left_after_stop"])
    reasons += _plain_reasons(result.get("plain_vllm"))
    return ("pass" if not reasons else "fail: " + "; ".join(reasons)), lives
