"""Time decode attention as an offloaded task costs the cold side (`weaver profile --engine`).

A served task differs from a kernel call timed in a loop in two ways, both measured here:
- it goes through the channel: the cold side reads and checks the task's metadata and
  block table from the region, runs the executor, and publishes the completion
  (`OffloadReceiver.poll`, the code a poll point runs);
- its K/V come from memory, not from the cache: each layer's task reads that layer's own
  pool, and between two tasks both engines stream their weights through the shared last
  level cache. On the benchmark machine a task of 1024 tokens took 0.39 ms warm and
  0.70 ms with the cache flushed before it (benchmarks/README.md).

So each timed task reads its own layer's pool, and a buffer larger than the last-level
cache is streamed before every task (untimed). The hot side and the cold side are the same
process here; the doorbells are written but nobody sleeps on them, so no wake-up latency
is included (the simulator's poll wait model holds that part).
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from weaver.offload.layout import HotAttentionShape, RegionLayout
from weaver.offload.naming import DEFAULT_SHM_DIR, region_name
from weaver.offload.protocol import OffloadTask
from weaver.offload.receiver import OffloadReceiver
from weaver.offload.sender import OffloadSender
from weaver.offload.shm import ShmRegion

# Streamed before every timed task. Larger than the last-level cache of the CPUs we profile
# on (32 MiB L3 on the benchmark machine), so the task's K/V are not left in it.
DEFAULT_FLUSH_BYTES = 128 << 20


@dataclass(frozen=True)
class TaskTiming:
    """One attention point: the batch's sequence lengths and the all-layer task time."""

    seq_lens: tuple[int, ...]
    all_layers_s: float  # min over repeats of the sum of one task per layer
    per_task_s: tuple[float, ...]  # the layers' task times of that fastest repeat


def time_offloaded_attention(
    shape: HotAttentionShape,
    batches: Sequence[Sequence[int]],
    executor: Callable[[OffloadTask], None],
    *,
    num_repeats: int = 5,
    flush_bytes: int = DEFAULT_FLUSH_BYTES,
    shm_dir: str = DEFAULT_SHM_DIR,
    seed: int = 0,
) -> list[TaskTiming]:
    """For each batch (a list of sequence lengths), the time the cold side spends serving
    one decode-attention task per layer of `shape`, through a real region and channel."""
    if num_repeats < 1:
        raise ValueError(f"num_repeats must be >= 1, got {num_repeats}")
    if flush_bytes < 0:
        raise ValueError(f"flush_bytes must be >= 0, got {flush_bytes}")
    flush = torch.zeros(max(flush_bytes // 8, 1), dtype=torch.int64)
    return [_time_batch(shape, list(lens), executor, num_repeats, flush, shm_dir, seed)
            for lens in batches]


def _time_batch(shape: HotAttentionShape, lens: list[int],
                executor: Callable[[OffloadTask], None], num_repeats: int,
                flush: torch.Tensor, shm_dir: str, seed: int) -> TaskTiming:
    if not lens or min(lens) < 1:
        raise ValueError(f"a batch needs sequences of >= 1 token, got {lens}")
    blocks = [-(-n // shape.block_size) for n in lens]
    layout = RegionLayout(shape, num_remote_blocks=sum(blocks), max_seqs_per_task=len(lens),
                          max_blocks_per_seq=max(blocks))
    name = region_name("weaver-task-timing", str(os.getpid()), uuid.uuid4().hex[:8])
    with ShmRegion.create(layout, name, shm_dir=shm_dir) as owner:
        receiver = OffloadReceiver(owner, executor)
        sender = OffloadSender(ShmRegion.attach(layout, name, shm_dir=shm_dir))
        try:
            best = _time_layers(shape, lens, blocks, receiver, sender, num_repeats, flush,
                                seed)
        finally:
            sender.close()
            receiver.close()  # also unlinks the region
    return TaskTiming(tuple(lens), sum(best), best)


def _time_layers(shape: HotAttentionShape, lens: list[int], blocks: list[int],
                 receiver: OffloadReceiver, sender: OffloadSender, num_repeats: int,
                 flush: torch.Tensor, seed: int) -> tuple[float, ...]:
    gen = torch.Generator().manual_seed(seed)
    for layer in range(shape.num_layers):
        pool = sender.kv_layer(layer)
        pool.copy_(torch.randn(pool.shape, generator=gen).to(pool.dtype))
    q = torch.randn(len(lens), shape.num_q_heads, shape.head_size,
                    generator=gen).to(sender.kv_layer(0).dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    table = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
    first = 0
    for i, n in enumerate(blocks):
        table[i, :n] = torch.arange(first, first + n, dtype=torch.int32)
        first += n
    best: tuple[float, ...] | None = None
    for repeat in range(num_repeats + 1):  # the first is a warm-up
        times = []
        for layer in range(shape.num_layers):
            flush.add_(1)  # read and write it all: evicts the last task's K/V
            ticket = sender.submit(layer, q, seq_lens, table, scale=shape.head_size ** -0.5)
            start = time.perf_counter()
            served = receiver.poll()
            times.append(time.perf_counter() - start)
            if not served:
                raise RuntimeError(f"the task of layer {layer} was not served by poll()")
            sender.wait(ticket, timeout_s=60.0)  # raises if the executor failed
        if repeat and (best is None or sum(times) < sum(best)):
            best = tuple(times)
    assert best is not None  # num_repeats >= 1
    return best
