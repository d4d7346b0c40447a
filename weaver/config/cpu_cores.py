"""A model's `cpu_cores`: vLLM's VLLM_CPU_OMP_THREADS_BIND syntax, parsed, and the
engine's scheduler process pinned to those cores; and the front end (a gateway and its load
generator) pinned to cores of its own.

Why pin the scheduler too: vLLM binds only its worker's compute threads to the cores.
The EngineCore process (the scheduler) is left to the OS, and while its worker computes
it busy-waits on the result queue (``shm_broadcast.SpinCondition``: ``sched_yield`` for
1 s after each read). With every core busy the OS moves it onto a neighbour's core.
Measured here (2 cores, hot engine on core 0, cold on 1, hot load on): the hot
EngineCore spent 30-46 s on core 1 during one benchmark run, beside the cold worker's
56 s, so the cold model's TPOT paid for the hot model's scheduler.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

UNBOUND_VALUES = ("auto", "nobind")  # vLLM picks (auto) or binds nothing (nobind)


def parse_cpu_cores(value: str) -> frozenset[int] | None:
    """The cores named by `value` ('0', '0-3', '0,2', '0-1|2-3' for several ranks), or
    None for 'auto'/'nobind'. ValueError on anything else."""
    text = value.strip()
    if text in UNBOUND_VALUES:
        return None
    cores: set[int] = set()
    for part in text.replace("|", ",").split(","):
        bounds = part.strip().split("-")
        if len(bounds) not in (1, 2) or not all(b.strip().isdigit() for b in bounds):
            raise ValueError(
                f"cpu_cores {value!r}: {part.strip()!r} is not a core or a range "
                "(use e.g. '0', '0-3', '0,2', or 'auto'/'nobind')")
        low, high = int(bounds[0]), int(bounds[-1])
        if low > high:
            raise ValueError(f"cpu_cores {value!r}: range {part.strip()!r} runs backwards")
        cores.update(range(low, high + 1))
    return frozenset(cores)


def pin_process_threads(pid: int, cores: frozenset[int]) -> int:
    """Set the affinity of every thread of `pid` (sched_setaffinity on a pid moves only its
    main thread); threads it starts later inherit it. Returns how many were pinned."""
    pinned = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except ProcessLookupError:  # the thread ended meanwhile
            continue
        pinned += 1
    return pinned


def usable_cpu_cores(owner: str, cpu_cores: str) -> frozenset[int] | None:
    """The cores of `cpu_cores` (for `owner`, named in the error), checked against the
    machine's: before an engine starts, vLLM would fail later and less clearly. Not
    against this process's own affinity: a gateway pinned to one core still starts
    engines on others."""
    try:
        cores = parse_cpu_cores(cpu_cores)
    except ValueError as exc:
        raise ValueError(f"{owner}: {exc}") from None
    if cores is None:
        return None
    num_cores = os.cpu_count() or 1
    missing = sorted(core for core in cores if core >= num_cores)
    if missing:
        raise ValueError(f"{owner}: cpu_cores {cpu_cores!r} names cores {missing} that this "
                         f"machine does not have (it has 0-{num_cores - 1})")
    return cores


def own_cpu_cores(owner: str, cpu_cores: str) -> frozenset[int]:
    """The cores of `cpu_cores` (for `owner`, named in the error); ValueError unless they
    are named and this process may run on every one (it is about to pin itself there)."""
    cores = parse_cpu_cores(cpu_cores)
    allowed = os.sched_getaffinity(0)
    if not cores or not cores <= allowed:
        raise ValueError(f"{owner} {cpu_cores!r} names cores this process may not "
                         f"use (it may use {sorted(allowed)})")
    return cores


def pin_engine_processes(engine_name: str, pids: list[int], cores: frozenset[int]) -> None:
    """Pin an engine's scheduler processes (not its workers: vLLM binds each compute
    thread of those to one core itself) to the model's cores, and say so in the log."""
    for pid in pids:
        num_threads = pin_process_threads(pid, cores)
        logger.info("engine %s: scheduler process %d (%d threads) pinned to cores %s",
                    engine_name, pid, num_threads, sorted(cores))


def pin_frontend(owner: str, cpu_cores: str) -> frozenset[int] | None:
    """Pin this process, every thread of it, to `cpu_cores` (for `owner`, named in the
    error; None for 'auto'/'nobind': left to the OS). A `weaver serve` it starts afterwards
    inherits the cores, and its engines then pin themselves to their own `cpu_cores`.

    Why: on a CPU testbed each engine's cores stand for its GPU, and nothing but that
    engine (and the tasks it serves) runs on a GPU. Left to the OS, the gateway, which
    streams and detokenizes every token, and the load generator run on whichever core is
    free for a moment, the cold engine's too (measured: more so under weaving), inside
    the cold model's steps, where neither its TPOT budget's reading
    (weaver/weaving/cold_load.py) nor any GPU would see them."""
    if usable_cpu_cores(owner, cpu_cores) is None:
        return None
    cores = own_cpu_cores(owner, cpu_cores)
    num_threads = pin_process_threads(os.getpid(), cores)
    logger.info("%s: this process (%d threads) and what it starts pinned to cores %s",
                owner, num_threads, sorted(cores))
    return cores
