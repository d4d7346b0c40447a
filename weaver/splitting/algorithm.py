"""Algorithm 1 of the Weaver paper (§4.2): split the cold model's long operators.

The expected wait ``W`` of an offloaded task grows with the square of the cold operator
times (see :mod:`weaver.splitting.queueing`), so the greedy splits the operator whose
chunks are longest, re-evaluates ``W`` and repeats while

* ``W`` is above the threshold (by default 5 % of the hot iteration time), and
* the longest chunk still exceeds the slack ``K - N`` (hot local attention minus remote
  attention): a chunk shorter than the slack never blocks the hot side
  (:func:`~weaver.splitting.queueing.expected_stall` is zero for it).

Doubling, not +1: every chunk of an operator is equally long (up to one row of the split
dimension), so "split the longest chunk in two" hits all chunks of that operator in turn
and the longest chunk only shrinks once all of them are split: that is ``k -> 2k``. One
step of the greedy is therefore one doubling. Power-of-two chunk counts also divide the
hidden, intermediate and vocabulary sizes of common models evenly, and the search needs
``log2`` steps per operator instead of a linear number.

Cost of a split: running an operator of time ``T`` as ``k`` chunks costs
``k * (T / k) + (k - 1) * overhead``: each extra chunk adds one kernel launch and one poll.
The overhead is spread evenly over the chunks, so the chunk times sum to exactly that.
With overhead a split can make ``W`` larger (tiny chunks padded with overhead); the
planner rejects such a split and retires the operator, so the plan's ``W`` never exceeds
the unsplit ``W``.

Termination: an operator takes at most ``split_dim_size // min_chunk_size`` chunks, every
accepted step raises one chunk count, and a rejected step retires an operator.
"""

from __future__ import annotations

import heapq
import json
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from enum import Enum
from pathlib import Path
from typing import Any

from weaver.splitting.queueing import (
    expected_stall,
    expected_wait,
    queueing_delay,
    residual_quantile,
)

logger = logging.getLogger(__name__)

PLAN_SCHEMA_VERSION = 1
# Paper §4.2: split until W is under 5 % of the hot iteration time. Here, not in profile.py,
# so that callers without pydantic (the GPU microbenchmark's image) can read it.
DEFAULT_THRESHOLD_FRAC = 0.05


@dataclass(frozen=True)
class OperatorSpec:
    """One kind of cold operator, as the splitter sees it."""

    name: str  # e.g. "gate_up"; the key of the plan
    time_s: float  # one unsplit run of one instance, seconds
    split_dim_size: int  # size of the dimension cut into chunks (output features, vocab, ...)
    num_instances: int = 1  # runs per cold decode step (num_layers for per-layer operators)
    min_chunk_size: int = 1  # smallest chunk along the split dimension (e.g. a GEMM tile)

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("an operator needs a non-empty name")
        if not math.isfinite(self.time_s) or self.time_s < 0:
            raise ValueError(f"operator {self.name!r}: time_s={self.time_s!r} must be >= 0")
        for label in ("split_dim_size", "num_instances", "min_chunk_size"):
            value = getattr(self, label)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"operator {self.name!r}: {label}={value!r} must be an int >= 1")

    @property
    def max_chunks(self) -> int:
        """The most chunks this operator can take without a chunk under min_chunk_size."""
        return max(1, self.split_dim_size // self.min_chunk_size)


@dataclass(frozen=True)
class SplitConfig:
    """What Algorithm 1 needs besides the operators. Times in seconds."""

    threshold_s: float  # stop once W is at most this (5 % of the hot iteration by default)
    local_attention_s: float  # K: the hot side's own attention for its local sequences
    remote_attention_s: float  # N: one offloaded attention task on the cold device
    overhead_s: float = 0.0  # cost of one extra chunk (launch + poll)
    arrival_rate: float = 0.0  # 1 / M, tasks per second; 0 means tasks never queue

    def __post_init__(self) -> None:
        for label in ("threshold_s", "local_attention_s", "remote_attention_s", "overhead_s"):
            value = getattr(self, label)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{label}={value!r} must be a finite number of seconds >= 0")
        # Validates arrival_rate and rejects an unstable queue (rho >= 1) up front.
        queueing_delay(self.arrival_rate, self.remote_attention_s)

    @property
    def slack_s(self) -> float:
        """``K - N``: how long a task may wait before the hot side blocks."""
        return self.local_attention_s - self.remote_attention_s


class StopReason(str, Enum):
    BELOW_THRESHOLD = "below_threshold"  # W <= threshold
    WITHIN_SLACK = "within_slack"  # every splittable chunk is at most K - N
    EXHAUSTED = "exhausted"  # no operator can be split further (dimension or overhead)


@dataclass(frozen=True)
class SplitStep:
    """One step of the greedy, kept so a report can show how W came down."""

    name: str
    chunks_before: int
    chunks_after: int
    wait_after_s: float  # W had the step been applied
    is_accepted: bool  # False: the overhead made W larger, the operator was retired


@dataclass(frozen=True)
class SplitPlan:
    """Chunks per operator name, and what they buy. JSON round trip via to_json/from_json."""

    chunks: dict[str, int]
    wait_before_s: float
    wait_after_s: float
    # Exact p99 of the wait for one outstanding task (the residual quantile, no queueing).
    wait_p99_before_s: float
    wait_p99_after_s: float
    # Expected hot-side blocking per task, E[max(0, R + N - K)], for one outstanding task.
    stall_before_s: float
    stall_after_s: float
    max_chunk_before_s: float
    max_chunk_after_s: float
    total_overhead_s: float  # extra cold time per decode step: sum n_i (k_i - 1) overhead
    threshold_s: float
    slack_s: float
    overhead_s: float
    stop_reason: StopReason
    steps: list[SplitStep] = field(default_factory=list)

    def chunks_for(self, name: str) -> int:
        """Chunks for ``name``; 1 (unsplit) for an operator the plan does not list."""
        return self.chunks.get(name, 1)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["stop_reason"] = self.stop_reason.value
        data["schema_version"] = PLAN_SCHEMA_VERSION
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SplitPlan:
        version = data.get("schema_version")
        if version != PLAN_SCHEMA_VERSION:
            raise ValueError(
                f"split plan schema_version {version!r} is not {PLAN_SCHEMA_VERSION}: "
                "re-run `weaver plan-split` with this version of Weaver"
            )
        names = [f.name for f in fields(cls)]
        missing = [n for n in names if n not in data]
        if missing:
            raise ValueError(f"split plan lacks {missing}: it was not written by SplitPlan")
        chunks = data["chunks"]
        if not isinstance(chunks, Mapping) or not all(
            isinstance(k, int) and not isinstance(k, bool) and k >= 1 for k in chunks.values()
        ):
            raise ValueError("split plan 'chunks' must map operator names to ints >= 1")
        try:
            stop_reason = StopReason(data["stop_reason"])
        except ValueError as exc:
            choices = [r.value for r in StopReason]
            raise ValueError(f"stop_reason must be one of {choices}") from exc
        try:
            steps = [SplitStep(**step) for step in data["steps"]]
        except TypeError as exc:
            raise ValueError(f"split plan has a malformed step: {exc}") from exc
        values = {n: data[n] for n in names}
        values.update(chunks=dict(chunks), stop_reason=stop_reason, steps=steps)
        return cls(**values)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str) -> SplitPlan:
        return cls.from_dict(json.loads(text))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | Path) -> SplitPlan:
        return cls.from_json(Path(path).read_text())


def chunk_bounds(size: int, num_chunks: int) -> list[tuple[int, int]]:
    """``num_chunks`` contiguous [lo, hi) ranges covering ``range(size)`` whose sizes differ
    by at most one, the larger ones first: the cut :func:`chunk_times` assumes, and the one
    the engines (weaver/vllm_ext/layers.py) and the GPU benchmark apply."""
    if not 1 <= num_chunks <= size:
        raise ValueError(f"cannot cut a dimension of {size} into {num_chunks} non-empty chunks")
    base, num_larger = divmod(size, num_chunks)
    bounds, lo = [], 0
    for index in range(num_chunks):
        hi = lo + base + (1 if index < num_larger else 0)
        bounds.append((lo, hi))
        lo = hi
    return bounds


def group_bounds(work: list[int], num_chunks: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) ranges of requests, at most ``num_chunks`` of them, none
    empty, balanced by ``work`` (one positive number per request): how a split attention
    operator cuts a batch into groups of whole sequences (query tokens x context, what the
    kernel's time follows, as the work). Whole sequences, not parts of one sequence's
    context: a paged kernel that returns the normalised output without its log-sum-exp
    (vLLM's CPU kernel) gives partial results that cannot be merged exactly, while
    sequences are independent, so the groups give the very same rows."""
    num_reqs = len(work)
    if num_chunks < 1:
        raise ValueError(f"num_chunks must be >= 1, not {num_chunks}")
    if num_reqs == 0:
        return []
    if num_chunks >= num_reqs:
        return [(i, i + 1) for i in range(num_reqs)]
    # Greedy, front to back: close a group before the request that would take it past
    # its fair share of the work still to place (remaining work / groups left).
    cuts, remaining, group_work = [], sum(work), 0
    for i, w in enumerate(work):
        groups_left = num_chunks - len(cuts)
        if group_work and groups_left > 1 and (group_work + w) * groups_left > remaining:
            cuts.append(i)
            remaining -= group_work
            group_work = 0
        group_work += w
    bounds, start = [], 0
    for end in [*cuts, num_reqs]:
        bounds.append((start, end))
        start = end
    return bounds



def chunk_times(op: OperatorSpec, num_chunks: int, overhead_s: float = 0.0) -> list[float]:
    """Durations of the ``num_chunks`` chunks of one instance of ``op``.

    The split dimension is cut as evenly as possible (sizes differ by at most one row) and
    each chunk takes its share of ``time_s`` plus ``(k - 1) / k`` of the overhead, so the
    chunks sum to ``time_s + (k - 1) * overhead_s``.
    """
    if not 1 <= num_chunks <= op.max_chunks:
        raise ValueError(
            f"operator {op.name!r} takes 1..{op.max_chunks} chunks "
            f"(split_dim_size {op.split_dim_size} // min_chunk_size {op.min_chunk_size}), "
            f"not {num_chunks}"
        )
    base, num_larger = divmod(op.split_dim_size, num_chunks)
    padding = overhead_s * (num_chunks - 1) / num_chunks
    sizes = [base + 1] * num_larger + [base] * (num_chunks - num_larger)
    return [op.time_s * size / op.split_dim_size + padding for size in sizes]


def _timeline(
    ops: Sequence[OperatorSpec], chunks: Mapping[str, int], overhead_s: float
) -> tuple[list[float], list[int]]:
    """Every chunk time of one cold decode step, each with its operator's instance count."""
    times: list[float] = []
    counts: list[int] = []
    for op in ops:
        for t in chunk_times(op, chunks.get(op.name, 1), overhead_s):
            times.append(t)
            counts.append(op.num_instances)
    return times, counts


def plan_wait(ops: Sequence[OperatorSpec], chunks: Mapping[str, int], config: SplitConfig) -> float:
    """Expected wait W when the operators run with the given chunk counts."""
    times, counts = _timeline(ops, chunks, config.overhead_s)
    return expected_wait(
        times,
        counts,
        arrival_rate=config.arrival_rate,
        service_time=config.remote_attention_s,
    )


def longest_chunk_s(op: OperatorSpec, num_chunks: int, overhead_s: float = 0.0) -> float:
    """The longest of ``op``'s chunks: what a task may have to wait behind."""
    return chunk_times(op, num_chunks, overhead_s)[0]  # the larger chunks come first


def _validate_ops(ops: Sequence[OperatorSpec]) -> None:
    if not ops:
        raise ValueError("no operators to plan: the profile lists none")
    names = [op.name for op in ops]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"operator names must be unique, repeated: {duplicates}")


def plan_split(ops: Sequence[OperatorSpec], config: SplitConfig) -> SplitPlan:
    """Algorithm 1: double the chunks of the longest operator until W is low enough."""
    _validate_ops(ops)
    overhead = config.overhead_s
    chunks = {op.name: 1 for op in ops}
    wait = wait_before = plan_wait(ops, chunks, config)
    if queueing_delay(config.arrival_rate, config.remote_attention_s) > config.threshold_s:
        logger.warning(
            "queueing among offloaded tasks alone exceeds the %.3g s threshold; "
            "splitting cannot reach it",
            config.threshold_s,
        )
    # Max-heap on the longest chunk; the index breaks ties in the caller's order.
    heap = [
        (-longest_chunk_s(op, 1, overhead), i, op) for i, op in enumerate(ops) if op.max_chunks > 1
    ]
    heapq.heapify(heap)
    steps: list[SplitStep] = []
    while True:
        if wait <= config.threshold_s:
            reason = StopReason.BELOW_THRESHOLD
            break
        if not heap:
            reason = StopReason.EXHAUSTED
            break
        neg_longest, index, op = heapq.heappop(heap)
        if -neg_longest <= config.slack_s:
            reason = StopReason.WITHIN_SLACK
            break
        before = chunks[op.name]
        after = min(2 * before, op.max_chunks)
        trial = {**chunks, op.name: after}
        trial_wait = plan_wait(ops, trial, config)
        is_accepted = trial_wait < wait
        steps.append(SplitStep(op.name, before, after, trial_wait, is_accepted))
        if not is_accepted:
            logger.debug("%d chunks of %s do not lower W; retiring it", after, op.name)
            continue
        chunks, wait = trial, trial_wait
        if after < op.max_chunks:
            heapq.heappush(heap, (-longest_chunk_s(op, after, overhead), index, op))
    return _make_plan(ops, chunks, config, wait_before, wait, reason, steps)


def _make_plan(
    ops: Sequence[OperatorSpec],
    chunks: dict[str, int],
    config: SplitConfig,
    wait_before: float,
    wait_after: float,
    reason: StopReason,
    steps: list[SplitStep],
) -> SplitPlan:
    before_times, before_counts = _timeline(ops, {}, config.overhead_s)
    after_times, after_counts = _timeline(ops, chunks, config.overhead_s)
    return SplitPlan(
        chunks=chunks,
        wait_before_s=wait_before,
        wait_after_s=wait_after,
        wait_p99_before_s=residual_quantile(0.99, before_times, before_counts),
        wait_p99_after_s=residual_quantile(0.99, after_times, after_counts),
        stall_before_s=expected_stall(before_times, config.slack_s, before_counts),
        stall_after_s=expected_stall(after_times, config.slack_s, after_counts),
        max_chunk_before_s=max(before_times),
        max_chunk_after_s=max(after_times),
        total_overhead_s=sum(
            op.num_instances * (chunks[op.name] - 1) * config.overhead_s for op in ops
        ),
        threshold_s=config.threshold_s,
        slack_s=config.slack_s,
        overhead_s=config.overhead_s,
        stop_reason=reason,
        steps=steps,
    )
