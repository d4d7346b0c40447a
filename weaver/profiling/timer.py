"""The one timer of Weaver's measurements: time a callable many times, on any device.

Every profile goes through it: the cold model's operators (split planning), vLLM's engine
steps and kernels (``weaver profile --engine``), the random-weight layer stack
(``weaver profile``) and the host's copy bandwidth. It is device-agnostic: asynchronous
devices pass ``synchronize`` (e.g. ``torch.cuda.synchronize``) so that a sample covers the
work itself and not only its launch.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class TimingStats:
    mean_s: float
    p50_s: float  # the median: robust to the odd preempted or page-faulting run
    min_s: float
    max_s: float
    num_samples: int


def measure(
    fn: Callable[[], object],
    *,
    num_warmup: int = 3,
    num_iters: int = 20,
    synchronize: Callable[[], None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> TimingStats:
    """Run ``fn`` ``num_warmup`` times untimed (caches, lazy init, autotuning), then time
    ``num_iters`` runs one by one, each bracketed by ``synchronize`` when given."""
    if num_warmup < 0:
        raise ValueError(f"num_warmup={num_warmup} must be >= 0")
    if num_iters < 1:
        raise ValueError(f"num_iters={num_iters} must be >= 1 to get a sample")
    sync = synchronize or _no_sync
    for _ in range(num_warmup):
        fn()
    sync()
    samples = []
    for _ in range(num_iters):
        start = clock()
        fn()
        sync()
        samples.append(clock() - start)
    return TimingStats(
        mean_s=statistics.fmean(samples),
        p50_s=statistics.median(samples),
        min_s=min(samples),
        max_s=max(samples),
        num_samples=len(samples),
    )


def best_time(fn: Callable[[], object], num_repeats: int) -> float:
    """The fastest of `num_repeats` timed runs after one warm-up (as ``timeit`` advises:
    on a shared machine noise only ever adds time)."""
    return measure(fn, num_warmup=1, num_iters=num_repeats).min_s


def copy_bandwidth(num_bytes: int = 64 << 20) -> float:
    """Bytes per second of a host memcpy (the CPU transport's link is shared memory)."""
    import torch

    src = torch.empty(num_bytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    return num_bytes / best_time(lambda: dst.copy_(src), 3)


def _no_sync() -> None:
    """Synchronous devices (CPU) need no barrier."""
