"""Measure the offload channel between two real processes: round-trip latency per task
and the cost of an idle poll point. Results are plain dicts written as JSON by the CLI.

The cold side runs in a spawned process that owns the region and serves from its idle
poller (the path an idle cold engine takes), so the numbers include both doorbells.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import multiprocessing.synchronize as mp_sync
import os
import platform
import queue
import statistics
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict

import torch

from weaver.offload.layout import HotAttentionShape
from weaver.offload.naming import region_name
from weaver.offload.protocol import Executor, OffloadTask
from weaver.offload.receiver import OffloadReceiver
from weaver.offload.reference_attention import paged_decode_attention_reference
from weaver.offload.sender import OffloadSender
from weaver.offload.shm import ShmRegion
from weaver.profiling.probe_config import ProbeConfig
from weaver.weaving.cold import ColdWeaving

logger = logging.getLogger(__name__)


ExecutorFactory = Callable[[HotAttentionShape], Executor]


def reference_executor(shape: HotAttentionShape) -> Executor:
    """The pure-torch oracle as the cold side's executor."""

    def reference(task: OffloadTask) -> None:
        task.out.copy_(
            paged_decode_attention_reference(
                task.q, task.kv_layer, task.seq_lens, task.block_table, task.scale
            )
        )

    return reference


def noop_executor(shape: HotAttentionShape) -> Executor:
    """Serves a task without computing anything: the channel alone."""

    def noop(task: OffloadTask) -> None:
        return None

    return noop


def _cold_main(config: ProbeConfig, make_executor: ExecutorFactory, name: str,
               results: mp.Queue, stop: mp_sync.Event) -> None:
    region = ShmRegion.create(config.layout, name, shm_dir=config.shm_dir)
    receiver = OffloadReceiver(region, make_executor(config.shape))
    # The cold engine's own idle poller (one thread over its regions, under its step lock).
    cold = ColdWeaving({name: receiver})
    try:
        start = time.perf_counter()
        for _ in range(config.num_idle_polls):
            receiver.poll()
        idle_poll_ns = (time.perf_counter() - start) / config.num_idle_polls * 1e9
        cold.start_idle_poller()
        results.put({"idle_poll_ns": idle_poll_ns})
        stop.wait()
        cold.stop_idle_poller()  # join the idle thread so its counters are final
        results.put({"receiver_stats": {**asdict(receiver.stats),
                                        "num_idle_wakeups": cold.num_idle_wakeups}})
    finally:
        cold.close()


def _get_from(cold: mp.Process, results: mp.Queue, timeout_s: float) -> dict:
    """Next message of the cold process; RuntimeError at once if it died instead."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return results.get(timeout=0.2)
        except queue.Empty:
            if not cold.is_alive():
                raise RuntimeError(
                    f"probe cold process exited with code {cold.exitcode}; see its error above"
                ) from None
    raise RuntimeError(f"probe cold process sent nothing in {timeout_s:.0f}s")


def _percentiles(samples_us: list[float]) -> dict[str, float]:
    ordered = sorted(samples_us)

    def at(p: float) -> float:
        return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]

    return {
        "mean": statistics.fmean(ordered),
        "p50": at(50),
        "p90": at(90),
        "p99": at(99),
        "max": ordered[-1],
    }


def run_probe(config: ProbeConfig, make_executor: ExecutorFactory, *,
              show_progress: bool = True) -> dict:
    """Run the probe; returns the result dict (config, environment, latencies in µs).

    make_executor: builds the cold side's executor for the probe's shape, in the cold
    process (a module-level function or class: it crosses a spawn)."""
    from tqdm import tqdm

    layout = config.layout
    name = region_name(config.shm_prefix, f"probe{os.getpid()}", uuid.uuid4().hex[:8])
    ctx = mp.get_context("spawn")
    results: mp.Queue = ctx.Queue()
    stop = ctx.Event()
    cold = ctx.Process(target=_cold_main, args=(config, make_executor, name, results, stop),
                       daemon=True)
    cold.start()
    try:
        cold_info = _get_from(cold, results, timeout_s=300)
        sender = OffloadSender(ShmRegion.attach(layout, name, shm_dir=config.shm_dir, wait_s=60))
        gen = torch.Generator().manual_seed(config.seed)
        dtype = sender.kv_layer(0).dtype
        for layer in range(config.num_layers):
            sender.kv_layer(layer).copy_(torch.randn(layout.kv_layer_shape, generator=gen))
        q = torch.randn(layout.staging_shape, generator=gen).to(dtype)
        seq_lens = torch.full((config.num_seqs,), config.seq_len, dtype=torch.int32)
        table = torch.arange(layout.num_remote_blocks, dtype=torch.int32).view(
            config.num_seqs, layout.max_blocks_per_seq
        )
        round_trips_us: list[float] = []
        submits_us: list[float] = []  # validation + q/metadata copies + publish + doorbell
        totals_us: list[float] = []  # submit() called -> output visible
        num_spin_hits = 0
        total = config.num_warmup_tasks + config.num_tasks
        for i in tqdm(range(total), desc="offload tasks", disable=not show_progress):
            submit_start = time.perf_counter()
            ticket = sender.submit(
                i % config.num_layers, q, seq_lens, table, scale=config.head_size**-0.5
            )
            submit_s = time.perf_counter() - submit_start
            result = sender.wait_with_timing(ticket, timeout_s=60)
            if i >= config.num_warmup_tasks:
                submits_us.append(submit_s * 1e6)
                totals_us.append((submit_s + result.round_trip_s) * 1e6)
                round_trips_us.append(result.round_trip_s * 1e6)
                num_spin_hits += result.num_sleeps == 0
        sender.close()
        stop.set()
        receiver_info = _get_from(cold, results, timeout_s=60)
    finally:
        stop.set()
        cold.join(timeout=60)
        if cold.is_alive():
            cold.kill()
            cold.join()
    return {
        "config": asdict(config),
        "environment": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "machine": platform.machine(),
            "num_cpus": os.cpu_count(),
            "load_avg_1m": os.getloadavg()[0],
        },
        "region_bytes": layout.total_bytes,
        "round_trip_us": _percentiles(round_trips_us),
        "round_trip_samples_us": round_trips_us,
        "submit_us": _percentiles(submits_us),
        "total_us": _percentiles(totals_us),
        "fraction_answered_while_spinning": num_spin_hits / len(round_trips_us),
        "idle_poll_ns": cold_info["idle_poll_ns"],
        **receiver_info,
    }
