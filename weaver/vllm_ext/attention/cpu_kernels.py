"""vLLM's CPU paged-attention kernels at a shape no engine layer has: the one place Weaver
calls them directly (vLLM 0.32.0, ``vllm/v1/attention/backends/cpu_attn.py``).

Two users run attention at a geometry vLLM's own builder cannot describe:
- the cold side's executor (``CpuPagedAttentionExecutor``) runs the *hot* model's decode
  attention inside the cold engine, whose own layers have other heads and head sizes;
- the unified pool's head-wise attention (headwise.py) runs each (sequence, KV head) pair as
  a sequence of its own.
Both do what ``CPUAttentionMetadataBuilder.build`` + ``CPUAttentionBackendImpl.forward``
do: vLLM's scheduler metadata for a batch (``PagedBatch``), then the kernel per layer. The
hot side's own sub-batches go through vLLM's builder instead (backend.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from vllm import _custom_ops as ops
from vllm import envs
from vllm.v1.attention.backends import cpu_attn

from weaver.offload.layout import HotAttentionShape
from weaver.offload.protocol import OffloadTask

logger = logging.getLogger(__name__)

CPU_ATTN_BLOCK_MULTIPLE = 32  # CPUAttentionBackend.get_supported_kernel_block_sizes


def validate_cpu_attn_shape(shape: HotAttentionShape) -> None:
    """ValueError if vLLM's CPU attention kernels cannot run this hot shape."""
    head_sizes = cpu_attn.CPUAttentionBackend.get_supported_head_sizes()
    if shape.head_size not in head_sizes:
        raise ValueError(
            f"head_size {shape.head_size} is not supported by vLLM CPU_ATTN ({head_sizes}); "
            "this hot model cannot be offloaded to a CPU cold side"
        )
    if shape.block_size % CPU_ATTN_BLOCK_MULTIPLE:
        raise ValueError(
            f"block_size {shape.block_size} must be a multiple of {CPU_ATTN_BLOCK_MULTIPLE} "
            "for vLLM CPU_ATTN; set the hot engine's --block-size accordingly"
        )
    if shape.torch_dtype not in cpu_attn.CPUAttentionBackend.supported_dtypes:
        raise ValueError(f"dtype {shape.dtype} is not supported by vLLM CPU_ATTN")


def select_cpu_attn_isa(dtype: torch.dtype, block_size: int, head_size: int) -> str:
    """The kernel ISA CPU_ATTN would pick for this geometry (vec, vec16, amx, neon, ...).

    Uses vLLM's private ``_get_attn_isa`` so that every caller agrees with vLLM's choice
    (checked by tests/vllm_ext/test_drift.py).
    """
    return cpu_attn._get_attn_isa(dtype, block_size, head_size, "auto")


def key_value_caches(kv_layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's cache ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` as the
    kernel's K and V views: each (block, head) page is [K | V] (cpu_attn.py ``forward``)."""
    num_blocks, num_kv_heads, block_size, _ = kv_layer.shape
    pages = kv_layer.view(num_blocks, num_kv_heads, block_size * 2, -1)
    key_cache, value_cache = pages.chunk(2, dim=2)
    return key_cache, value_cache


@dataclass(frozen=True)
class PagedBatch:
    """A batch of sequences as vLLM's CPU kernel reads them, with vLLM's scheduler metadata
    for it: built once per batch, used by every layer."""

    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    seq_lens: torch.Tensor  # int32 [num_seqs]
    scheduler_metadata: torch.Tensor
    causal: bool
    sliding_window: int  # -1 = none

    @classmethod
    def build(cls, *, num_q_heads: int, num_kv_heads: int, head_size: int,
              dtype: torch.dtype, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
              isa: str, causal: bool = True, sliding_window: int = -1,
              enable_kv_split: bool | None = None) -> PagedBatch:
        metadata = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=seq_lens.shape[0],
            num_heads=num_q_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_size,
            seq_lens=seq_lens,
            dtype=dtype,
            query_start_loc=query_start_loc,
            causal=causal,
            sliding_window_size=sliding_window,
            isa=isa,
            enable_kv_split=(envs.VLLM_CPU_ATTN_SPLIT_KV if enable_kv_split is None
                             else enable_kv_split),
        )
        return cls(query_start_loc, seq_lens, metadata, causal, sliding_window)

    def attend(self, query: torch.Tensor, caches: tuple[torch.Tensor, torch.Tensor],
               output: torch.Tensor, block_table: torch.Tensor, *, scale: float,
               softcap: float = 0.0) -> None:
        """output = attention of query over the pages that block_table names in caches
        (key_value_caches of a layer)."""
        key_cache, value_cache = caches
        ops.cpu_attention_with_kv_cache(
            query=query,
            key_cache=key_cache,
            value_cache=value_cache,
            output=output,
            query_start_loc=self.query_start_loc,
            seq_lens=self.seq_lens,
            scale=scale,
            causal=self.causal,
            alibi_slopes=None,
            sliding_window=self.sliding_window,
            block_table=block_table,
            softcap=softcap,
            scheduler_metadata=self.scheduler_metadata,
            s_aux=None,
        )


def write_kv_to_pool(
    kv_layer: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    isa: str,
) -> None:
    """Store new key/value [T, num_kv_heads, head_size] at slots (block*block_size+offset).

    kv_layer is one layer of the remote pool; slot ids are local to it; -1 marks a
    padding token that is skipped, as in vLLM's slot_mapping.
    """
    if key.shape != value.shape or key.dim() != 3 or key.shape[1] != kv_layer.shape[1]:
        raise ValueError(
            f"key/value must both be [T, {kv_layer.shape[1]}, head_size], got "
            f"{tuple(key.shape)} and {tuple(value.shape)}"
        )
    if key.dtype != kv_layer.dtype or value.dtype != kv_layer.dtype:
        raise ValueError(f"key/value dtype must match the pool's {kv_layer.dtype}")
    if slot_mapping.shape != (key.shape[0],):
        raise ValueError(f"slot_mapping must be [{key.shape[0]}], got {tuple(slot_mapping.shape)}")
    num_slots = kv_layer.shape[0] * kv_layer.shape[2]
    # The kernel trusts the slots: one out of range would write past this layer's pool.
    if key.shape[0] and (int(slot_mapping.min()) < -1 or int(slot_mapping.max()) >= num_slots):
        raise ValueError(
            f"slots must be in [0, {num_slots}) (or -1 for padding), local to the remote pool"
        )
    key_cache, value_cache = key_value_caches(kv_layer)
    ops.cpu_attn_reshape_and_cache(
        key, value, key_cache, value_cache, slot_mapping.to(torch.int64), isa
    )


# Views of more pool layers than this are not kept (a hot model has fewer layers).
MAX_CACHED_KV_LAYERS = 256


class CpuPagedAttentionExecutor:
    """The cold side's executor of an offloaded task (decode, one token per sequence) with
    vLLM's CPU kernels, at the hot model's shape, over views of the remote pool."""

    def __init__(self, shape: HotAttentionShape, *, enable_kv_split: bool | None = None) -> None:
        validate_cpu_attn_shape(shape)
        self.shape = shape
        self._dtype = shape.torch_dtype
        self.isa = select_cpu_attn_isa(self._dtype, shape.block_size, shape.head_size)
        self._enable_kv_split = enable_kv_split
        # Decode: sequence i's single query token is row i, so query_start_loc = 0..S.
        self._query_start_loc = torch.arange(0, 1, dtype=torch.int32)
        # Kept between tasks: what does not depend on the task's data. The cold side serves
        # tasks between its own operators, which evict the caches; after a cache flush
        # (as weaver.profiling.task_timing times tasks) building the scheduler metadata took
        # 155-190 us and the K/V views 90-100 us per task (benchmarks/HISTORY.md).
        # - the batch (scheduler metadata): a function of the sequence lengths only; a hot
        #   step sends one task per layer with the same lengths, and vLLM's own CPU backend
        #   likewise builds it once per step for all layers (cpu_attn.py).
        # - K/V views per pool layer: id -> (the layer tensor, kept so the id stays its own;
        #   key view; value view). They hold the region's memory: release() drops them.
        self._batch: tuple[tuple[int, int, bytes], PagedBatch] | None = None  # key, batch
        self._kv_views: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        logger.info("CPU paged attention executor for %s uses ISA %s", shape, self.isa)

    def __call__(self, task: OffloadTask) -> None:
        self.run(task.q, task.kv_layer, task.seq_lens, task.block_table, task.out,
                 scale=task.scale, sliding_window=task.sliding_window, softcap=task.softcap)

    def run(
        self,
        q: torch.Tensor,
        kv_layer: torch.Tensor,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        out: torch.Tensor,
        *,
        scale: float,
        sliding_window: int = -1,
        softcap: float = 0.0,
    ) -> None:
        batch = self._batch_for(q.shape[0], seq_lens.to(torch.int32), sliding_window)
        batch.attend(q, self._key_value_caches(kv_layer), out, block_table.to(torch.int32),
                     scale=scale, softcap=softcap)

    def release(self) -> None:
        """Drop the cached K/V views (and metadata), e.g. before their region is unmapped."""
        self._kv_views.clear()
        self._batch = None

    def _batch_for(self, num_seqs: int, seq_lens: torch.Tensor,
                   sliding_window: int) -> PagedBatch:
        key = (num_seqs, sliding_window, seq_lens.contiguous().numpy().tobytes())
        if self._batch is None or self._batch[0] != key:
            if self._query_start_loc.numel() < num_seqs + 1:
                self._query_start_loc = torch.arange(0, num_seqs + 1, dtype=torch.int32)
            shape = self.shape
            batch = PagedBatch.build(
                num_q_heads=shape.num_q_heads, num_kv_heads=shape.num_kv_heads,
                head_size=shape.head_size, dtype=self._dtype,
                query_start_loc=self._query_start_loc[: num_seqs + 1], seq_lens=seq_lens,
                isa=self.isa, sliding_window=sliding_window,
                enable_kv_split=self._enable_kv_split)
            self._batch = (key, batch)
        return self._batch[1]

    def _key_value_caches(self, kv_layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cached = self._kv_views.get(id(kv_layer))
        if cached is None or cached[0] is not kv_layer:
            if len(self._kv_views) >= MAX_CACHED_KV_LAYERS:
                self._kv_views.clear()  # pools come and go (e.g. a profiler's regions)
            cached = (kv_layer, *key_value_caches(kv_layer))
            self._kv_views[id(kv_layer)] = cached
        return cached[1], cached[2]
