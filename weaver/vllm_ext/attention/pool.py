"""The unified KV pool on the worker side: an engine's own KV in the pool's pages (a cold
engine's, or each engine's of a colocated group), and a hot engine's remote blocks there.

At KV-cache initialisation an engine whose ``additional_config`` carries a pool plan
(patches/kv_cache_allocation.py calls ``initialize_with_pool``):

- creates the pool when its tenant is the owner: one shared-memory segment of
  ``num_pages * page_bytes`` bytes, named by the plan, unlinked when the worker closes or
  exits; any other tenant maps the pool its host created (``attach_pool``);
- lets vLLM build its usual per-layer cache views over a buffer that is never touched, so it
  costs address space but no memory;
- hands every attention layer a `PoolAttentionRuntime`, which writes new K/V into the
  tenant's pages and runs attention over them (headwise.py), translating block ids through
  the shared page table the scheduler's allocator keeps (weaver/vllm_ext/block_pool.py).

vLLM's own views are then never read or written: the engine's attention (backend.py) goes
to the runtime instead. A hot engine's remote blocks in the pool are `RemotePoolKV`; the
cold side serves their offloaded tasks with `PoolTaskExecutor`.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import mmap
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any

import numpy as np
import torch

from weaver.kv.pool_plan import PoolPlan
from weaver.kv.shared_table import SharedPageTable
from weaver.offload.naming import DEFAULT_SHM_DIR
from weaver.offload.protocol import OffloadTask
from weaver.vllm_ext.attention.cpu_kernels import (
    key_value_caches,
    select_cpu_attn_isa,
    validate_cpu_attn_shape,
)
from weaver.vllm_ext.attention.headwise import (
    HeadwiseBatch,
    HeadwiseGeometry,
    HeadwiseSlots,
    page_view,
)
from weaver.vllm_ext.layers import attention_layers
from weaver.weaving.hot import RowGroup

logger = logging.getLogger(__name__)


class PoolAttentionRuntime:
    """One engine's tenant of the pool, as its attention layers use it."""

    def __init__(self, plan: PoolPlan, tenant: str, geometry: HeadwiseGeometry,
                 num_layers: int) -> None:
        self.plan = plan
        self.tenant = tenant
        self.geometry = geometry
        self.num_layers = num_layers
        self.first_block_id = plan.tenant(tenant).first_block_id
        # The owner tenant's engine (a weaving cold model) creates the pool and unlinks it;
        # an engine of a colocated group maps the pool its gateway created (weaver.kv.owner
        # HostedPool) and leaves it there for the group's other engines.
        self.creates_pool = plan.tenant(tenant).is_owner
        if self.creates_pool:
            self._shm = shared_memory.SharedMemory(name=plan.pool_name, create=True,
                                                   size=plan.pool_bytes)
        else:
            self._shm = attach_pool(plan)
        self.pages = page_view(torch.frombuffer(self._shm.buf, dtype=torch.uint8), geometry)
        self.caches = key_value_caches(self.pages)  # kept: the pages never move
        self._table: SharedPageTable | None = None
        self._page_table: torch.Tensor | None = None
        self._batch: tuple[Any, HeadwiseBatch] | None = None
        self._slots: tuple[torch.Tensor, int, HeadwiseSlots] | None = None
        self.num_steps = 0  # attention batches served from the pool
        self.num_kv_writes = 0  # layer-level K/V writes into the pool
        self.peak_live_blocks = 0  # the tenant's blocks with pages, at step starts
        # Resident memory that vLLM's own (unused) cache buffer and the pool's creation
        # added at KV initialisation: near 0 unless vLLM touched its buffer.
        self.vllm_buffer_rss_bytes: int | None = None
        self._threads_checked = False
        atexit.register(self.close)
        logger.info("unified KV pool %s %s: %d pages of %d bytes for tenant %s",
                    plan.pool_name, "created" if self.creates_pool else "mapped",
                    plan.num_pages, plan.page_bytes, tenant)

    def page_table(self) -> torch.Tensor:
        """The tenant's live page table (mapped once; the scheduler's allocator owns it and
        creates it after this worker's KV initialisation, before the first step)."""
        if self._page_table is None:
            self._table, self._page_table = attach_page_table(self.plan, self.tenant)
        return self._page_table

    def pages_for(self, geometry: HeadwiseGeometry) -> torch.Tensor:
        """The pool as another tenant's pages (the hot models' tasks run over them)."""
        return page_view(torch.frombuffer(self._shm.buf, dtype=torch.uint8), geometry)

    def write(self, layer: Any, layer_index: int, key: torch.Tensor, value: torch.Tensor,
              slot_mapping: torch.Tensor) -> None:
        cached = self._slots
        # Every layer of a step gets the same slot_mapping tensor; its version counter moves
        # with any in-place reuse of the buffer, so a stale translation never matches.
        if cached is None or cached[0] is not slot_mapping or cached[1] != slot_mapping._version:
            slots = HeadwiseSlots(self.geometry, self.num_layers, self.page_table(),
                                  slot_mapping, first_block_id=self.first_block_id,
                                  isa=layer.isa)
            cached = self._slots = (slot_mapping, slot_mapping._version, slots)
        num_tokens = cached[2].num_tokens
        cached[2].write_kv(self.pages, layer_index, key[:num_tokens], value[:num_tokens])
        self.num_kv_writes += 1

    def attend(self, impl: Any, layer: Any, layer_index: int, query: torch.Tensor,
               output: torch.Tensor, md: Any) -> torch.Tensor:
        if self._batch is None or self._batch[0] is not md:
            if not self._threads_checked:  # vLLM binds the worker's threads after KV init
                self._threads_checked = True
                self._warn_if_split_kv_may_differ()
            num_reqs = md.seq_lens.shape[0]
            batch = HeadwiseBatch(
                self.geometry, self.num_layers, self.page_table(),
                md.query_start_loc[: num_reqs + 1], md.seq_lens, md.block_table,
                first_block_id=self.first_block_id, causal=md.causal,
                sliding_window=impl.sliding_window, isa=layer.isa)
            self._batch = (md, batch)
            self.num_steps += 1
            self.peak_live_blocks = max(self.peak_live_blocks, self._num_live_blocks())
        num_tokens = md.num_actual_tokens
        self._batch[1].attention_over(self.caches, layer_index, query[:num_tokens],
                                      output[:num_tokens], scale=impl.scale,
                                      softcap=float(impl.logits_soft_cap or 0.0))
        return output

    def _warn_if_split_kv_may_differ(self) -> None:
        from vllm import envs

        if torch.get_num_threads() > 1 and envs.VLLM_CPU_ATTN_SPLIT_KV:
            logger.warning(
                "pool attention runs vLLM's kernel with %d threads and split-KV on: it may cut "
                "a short batch's contexts differently from a plain engine, so outputs can "
                "differ in the last bits (greedy tokens too, rarely); pin the engine to one "
                "core (VLLM_CPU_OMP_THREADS_BIND) or set VLLM_CPU_ATTN_SPLIT_KV=0 to match",
                torch.get_num_threads())

    def _num_live_blocks(self) -> int:
        return int((self.page_table()[:, 0] >= 0).sum())

    def stats(self) -> dict[str, Any]:
        return {"pool": self.plan.pool_name, "tenant": self.tenant,
                "attention_steps": self.num_steps, "kv_writes": self.num_kv_writes,
                "live_blocks": self._num_live_blocks(),
                "peak_live_blocks": self.peak_live_blocks,
                "vllm_buffer_rss_bytes": self.vllm_buffer_rss_bytes}

    def close(self) -> None:
        """Unlink the pool (once) when this engine created it; the mapping goes with the
        process."""
        if self._shm is None:
            return
        shm, self._shm = self._shm, None
        self._batch = self._slots = None
        if self._table is not None:
            self._page_table = None
            self._table.close()
        if self.creates_pool:
            with contextlib.suppress(FileNotFoundError):
                shm.unlink()
            logger.info("unified KV pool %s removed", self.plan.pool_name)


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class MappedPool:
    """A pool segment another process created, mapped read-write from its /dev/shm file
    (what shm_open opens on Linux) and never unlinked here. Not through SharedMemory: before
    Python 3.13 attaching one registers it with the resource tracker, which every engine of
    a `weaver serve` shares with the gateway; unregistering it again also dropped the
    creator's registration, and the creator's unlink then failed in the tracker (KeyError)."""

    def __init__(self, name: str) -> None:
        fd = os.open(os.path.join(DEFAULT_SHM_DIR, name), os.O_RDWR)
        try:
            self.size = os.fstat(fd).st_size
            self._mmap = mmap.mmap(fd, self.size)
        finally:
            os.close(fd)  # the mapping keeps the segment
        self.buf = memoryview(self._mmap)

    def close(self) -> None:
        """Unmap; BufferError while a view of it is alive (as SharedMemory.close)."""
        self.buf.release()
        self._mmap.close()


def attach_pool(plan: PoolPlan) -> MappedPool:
    """Map a pool another process created (its bytes), without ever unlinking it here."""
    try:
        shm = MappedPool(plan.pool_name)
    except FileNotFoundError:
        raise ValueError(
            f"unified KV pool {plan.pool_name!r} does not exist: the process that hosts it "
            "(the gateway, for a colocated group) creates it before the engines start; "
            "start the engines through weaver serve") from None
    if shm.size < plan.pool_bytes:
        raise ValueError(f"unified KV pool {plan.pool_name!r} has {shm.size} bytes, the plan "
                         f"{plan.pool_bytes}: it was created for another plan")
    return shm


def attach_page_table(plan: PoolPlan, tenant: str) -> tuple[SharedPageTable, torch.Tensor]:
    """Map the pool's page table (read-only) and view the tenant's rows as a tensor."""
    tenants = [(t.name, plan.max_blocks(t.name), t.shape.pages_per_block(plan.page_bytes))
               for t in plan.tenants]
    table = SharedPageTable.attach(SharedPageTable.layout_for(plan.table_name, tenants))
    with warnings.catch_warnings():  # a read-only mapping: torch warns, nobody writes
        warnings.simplefilter("ignore", UserWarning)
        return table, torch.from_numpy(table.table(tenant))


def hot_geometry(shape: Any) -> HeadwiseGeometry:
    """The head-wise geometry of a weaving plan's hot attention shape."""
    return HeadwiseGeometry(shape.num_q_heads, shape.num_kv_heads, shape.head_size,
                            shape.block_size, shape.torch_dtype)


class RemotePoolKV:
    """A hot worker's remote blocks in the cold device's unified pool: it writes their new
    K/V into the pool's pages and, for the rows the hot side computes itself (remote
    prefill; fallback when the cold side failed), runs attention over them. Block and slot
    ids are the hot tenant's (the remote range rebased to 0, as the channel sends them)."""

    def __init__(self, plan: Any) -> None:
        pool = plan.pool
        self.tenant = plan.hot
        self.geometry = hot_geometry(plan.shape)
        self.num_layers = plan.shape.num_layers
        self._shm = attach_pool(pool)
        self.pages = page_view(torch.frombuffer(self._shm.buf, dtype=torch.uint8),
                               self.geometry)
        self.caches = key_value_caches(self.pages)  # kept: the pages never move
        self._table, self.page_table = attach_page_table(pool, plan.hot)
        self._slots: tuple[torch.Tensor, HeadwiseSlots] | None = None
        self._batches: dict[int, tuple[Any, HeadwiseBatch]] = {}

    def write(self, ops: Any, key: torch.Tensor, value: torch.Tensor,
              slots: torch.Tensor) -> None:
        # The step's remote slots are one tensor for every layer (weaving.hot._SlotSplit).
        if self._slots is None or self._slots[0] is not slots:
            self._slots = (slots, HeadwiseSlots(self.geometry, self.num_layers,
                                                self.page_table, slots, isa=ops.layer.isa))
        self._slots[1].write_kv(self.pages, ops.layer_index, key, value)

    def attend(self, ops: Any, rows: RowGroup, query: torch.Tensor,
               output: torch.Tensor) -> None:
        cached = self._batches.get(id(rows))
        if cached is None or cached[0] is not rows:
            if len(self._batches) > 8:  # rows of earlier steps
                self._batches.clear()
            cached = (rows, HeadwiseBatch(
                self.geometry, self.num_layers, self.page_table, rows.query_start_loc,
                rows.seq_lens, rows.block_table, causal=rows.causal,
                sliding_window=ops.impl.sliding_window, isa=ops.layer.isa))
            self._batches[id(rows)] = cached
        sub_out = torch.empty_like(output[rows.tokens])
        cached[1].attention_over(self.caches, ops.layer_index, query[rows.tokens], sub_out,
                                 scale=ops.impl.scale,
                                 softcap=float(ops.impl.logits_soft_cap or 0.0))
        output[rows.tokens] = sub_out

    def close(self) -> None:
        """Unmap the pool and its page table (a restarted owner made new ones): the views
        go first, or the mapping cannot close."""
        if self._shm is None:
            return
        shm, self._shm = self._shm, None
        self._slots = None
        self._batches.clear()
        del self.pages, self.caches, self.page_table
        self._table.close()
        try:
            shm.close()
        except BufferError:  # a view still alive somewhere: the mapping goes with it
            logger.warning("unified KV pool %s: the old mapping is still viewed; it is "
                           "released when the last view is", self.tenant)


class PoolTaskExecutor:
    """The cold side's executor of a hot model's offloaded decode attention when the hot
    model's remote blocks live in a pool of pages: the unified pool the cold worker keeps
    its own KV in (`runtime`), or the loan pool the gateway hosts for the cold model's hot
    models (mapped here)."""

    def __init__(self, plan: Any, runtime: PoolAttentionRuntime | None = None) -> None:
        validate_cpu_attn_shape(plan.shape)
        self.geometry = hot_geometry(plan.shape)
        self._mapping: MappedPool | None = None
        if runtime is not None:
            self.pages = runtime.pages_for(self.geometry)
        else:
            # The mapping stays open as long as the executor (its pages are views of it);
            # the worker's exit unmaps it, and the gateway removes the pool.
            self._mapping = attach_pool(plan.pool)
            self.pages = page_view(torch.frombuffer(self._mapping.buf, dtype=torch.uint8),
                                   self.geometry)
        self.caches = key_value_caches(self.pages)  # kept: the pages never move
        self._table, self.page_table = attach_page_table(plan.pool, plan.hot)
        isa = select_cpu_attn_isa(self.geometry.dtype, self.geometry.block_size,
                                  self.geometry.head_size)
        self.batches = StepBatches(self.geometry, plan.shape.num_layers, self.page_table,
                                   plan.max_seqs_per_task, plan.hot, isa)

    def __call__(self, task: OffloadTask) -> None:
        batch = self.batches.for_task(task.seq_lens, task.block_table, task.sliding_window)
        batch.attention_over(self.caches, task.layer, task.q, task.out, scale=task.scale,
                             softcap=task.softcap)


class StepBatches:
    """The batch a hot step's tasks run over the pool's pages, built at its first layer's
    task and kept for the others: a hot step sends one task per layer, all with the same
    sequences, blocks and lengths, and a batch gathers every layer's page tables and builds
    vLLM's scheduler metadata at once (headwise.py). Built for every task, a woven step of
    one 150-token sequence at SmolLM2-135M's shape (30 layers) took the cold's core 20.7 ms,
    with the cache flushed before each task as serving flushes it; kept, 7.1 ms
    (benchmarks/pool_task_cost.py).

    A task is checked before its batch is reused: its lengths, its blocks and those blocks'
    pages in the shared page table must be the batch's. A freed block's id comes back with
    other pages, so lengths and ids alone could name a batch whose pages have moved."""

    def __init__(self, geometry: HeadwiseGeometry, num_layers: int, page_table: torch.Tensor,
                 max_seqs: int, tenant: str, isa: str) -> None:
        self.geometry = geometry
        self.num_layers = num_layers
        self.page_table = page_table
        self._page_ids = page_table.numpy()  # the same memory: numpy indexes small arrays faster
        self.tenant = tenant
        self.isa = isa
        self._query_start_loc = torch.arange(0, max_seqs + 1, dtype=torch.int32)
        self._kept: _KeptBatch | None = None
        self.num_built = 0  # batches built (one per hot step when all goes well)

    def for_task(self, seq_lens: torch.Tensor, block_table: torch.Tensor,
                 sliding_window: int) -> HeadwiseBatch:
        lens, table = seq_lens.numpy(), block_table.numpy()
        lens_bytes, table_bytes = lens.tobytes(), table.tobytes()
        kept = self._kept
        # The few array operations a kept batch costs (this runs between the cold model's
        # operators, where each one is a cache miss): the staged lengths and block table as
        # bytes, then one gather of the pages of the blocks they use.
        if kept is not None and kept.lens == lens_bytes and kept.table == table_bytes \
                and kept.sliding_window == sliding_window \
                and self._page_ids[kept.used].tobytes() == kept.pages:
            return kept.batch
        block_size = self.geometry.block_size
        num_used = (lens.astype(np.int64) + block_size - 1) // block_size
        used = table[np.arange(table.shape[1])[None, :] < num_used[:, None]]
        if used.size and (used.min() < 0 or used.max() >= self._page_ids.shape[0]):
            raise ValueError(f"a task names blocks outside {self.tenant!r}'s "
                             f"{self._page_ids.shape[0]} block ids")
        pages = self._page_ids[used]
        # A block id the hot side sends must have pages: page 0 would be another model's.
        if (pages < 0).any():
            raise ValueError(f"a task names blocks of {self.tenant!r} that have no pages in "
                             "the unified pool")
        batch = HeadwiseBatch(self.geometry, self.num_layers, self.page_table,
                              self._query_start_loc[: lens.shape[0] + 1], seq_lens,
                              block_table, sliding_window=sliding_window, isa=self.isa)
        self._kept = _KeptBatch(lens_bytes, table_bytes, sliding_window, used, pages.tobytes(),
                                batch)
        self.num_built += 1
        return batch


@dataclass(frozen=True)
class _KeptBatch:
    """A batch and what it was built from (StepBatches)."""

    lens: bytes
    table: bytes
    sliding_window: int
    used: np.ndarray  # the block ids its sequences use
    pages: bytes  # their pages when it was built
    batch: HeadwiseBatch


def open_pool(runner: Any, plan: PoolPlan, tenant: str) -> PoolAttentionRuntime:
    """Create the pool and hand it to every attention layer of the runner's model."""
    from vllm.model_executor.models.utils import extract_layer_index

    layers = attention_layers(runner)
    if not layers:
        raise ValueError("the model has no attention layers to keep KV in the pool")
    impls = [layer.impl for layer in layers.values()]
    first = impls[0]
    shape = plan.tenant(tenant).shape
    geometry = HeadwiseGeometry(first.num_heads, first.num_kv_heads, first.head_size,
                                shape.block_size, runner.model_config.dtype)
    problems = []
    if (shape.num_layers, shape.num_kv_heads, shape.head_size) != (
            len(layers), first.num_kv_heads, first.head_size):
        problems.append(f"the plan's shape {shape} is not the model's ({len(layers)} layers, "
                        f"{first.num_kv_heads} KV heads of {first.head_size})")
    if runner.cache_config.block_size != shape.block_size:
        problems.append(f"the engine's block size is {runner.cache_config.block_size}, the "
                        f"plan's {shape.block_size}")
    for impl in impls:
        if getattr(impl, "weaver_attn_chunks", None) is not None:
            problems.append("split attention (a split plan's attn) cannot run on the pool yet")
            break
        if impl.alibi_slopes is not None or impl.sinks is not None:
            problems.append("ALiBi and attention sinks are not supported on the pool")
            break
    if problems:
        raise ValueError(f"engine cannot keep its KV in pool {plan.pool_name!r}: "
                         + "; ".join(problems))
    runtime = PoolAttentionRuntime(plan, tenant, geometry, len(layers))
    for name, layer in layers.items():
        layer.impl.weaver_pool = runtime
        layer.impl.weaver_layer_index = extract_layer_index(name)
    return runtime


def initialize_with_pool(runner: Any, section: tuple[PoolPlan, str],
                         allocate: Callable[[], Any]) -> Any:
    """vLLM's KV initialisation of a pool engine (patches/kv_cache_allocation.py): vLLM's own,
    its buffer left untouched, then the pool opened for the runner's attention layers."""
    plan, tenant = section
    rss_before = _resident_bytes()
    kv_caches = allocate()
    runner.weaver_pool = open_pool(runner, plan, tenant)
    runner.weaver_pool.vllm_buffer_rss_bytes = _resident_bytes() - rss_before
    return kv_caches
