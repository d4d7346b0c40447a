"""Cold-side executor: the hot model's decode attention with vLLM's own CPU kernels.

Mirrors ``CPUAttentionMetadataBuilder.build`` + ``CPUAttentionBackendImpl.forward`` /
``do_kv_cache_update`` in ``vllm/v1/attention/backends/cpu_attn.py`` (vLLM 0.32.0), but
with the HOT model's heads, head size, block size and scale (the cold engine's own
attention layers have other shapes, so its metadata cannot be reused), over views of
the shared remote pool. Decode only: one query token per sequence.
"""

from __future__ import annotations

import logging

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


def select_cpu_attn_isa(shape: HotAttentionShape) -> str:
    """The kernel ISA CPU_ATTN would pick for this shape (vec, vec16, amx, neon, ...).

    Uses vLLM's private ``_get_attn_isa`` so cold and hot sides agree with vLLM's choice;
    probed with getattr because it is not a public API (checked by a drift test).
    """
    get_isa = getattr(cpu_attn, "_get_attn_isa", None)
    if get_isa is None:
        raise RuntimeError(
            "vllm.v1.attention.backends.cpu_attn._get_attn_isa is gone: vLLM changed; "
            "update weaver/vllm_ext/cpu_paged_attention.py"
        )
    return get_isa(shape.torch_dtype, shape.block_size, shape.head_size, "auto")


# Views of more pool layers than this are not kept (a hot model has fewer layers).
MAX_CACHED_KV_LAYERS = 256


def key_value_caches(kv_layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # Same reinterpretation as cpu_attn.py forward: each (block, head) page is [K | V].
    num_blocks, num_kv_heads, block_size, _ = kv_layer.shape
    pages = kv_layer.view(num_blocks, num_kv_heads, block_size * 2, -1)
    key_cache, value_cache = pages.chunk(2, dim=2)
    return key_cache, value_cache


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


class CpuPagedAttentionExecutor:
    """Runs one OffloadTask (decode, one token per sequence) with vLLM's CPU kernels."""

    def __init__(self, shape: HotAttentionShape, *, enable_kv_split: bool | None = None) -> None:
        validate_cpu_attn_shape(shape)
        self.shape = shape
        self.isa = select_cpu_attn_isa(shape)
        self._dtype = shape.torch_dtype
        self._enable_kv_split = (
            envs.VLLM_CPU_ATTN_SPLIT_KV if enable_kv_split is None else enable_kv_split
        )
        # Decode: sequence i's single query token is row i, so query_start_loc = 0..S.
        self._query_start_loc = torch.arange(0, 1, dtype=torch.int32)
        # Kept between tasks: what does not depend on the task's data. The cold side serves
        # tasks between its own operators, which evict the caches; after a cache flush
        # (as weaver.profiling.task_timing times tasks) building the scheduler metadata took
        # 155-190 us and the K/V views 90-100 us per task (benchmarks/README.md).
        # - scheduler metadata: a function of the batch's sequence lengths only; a hot step
        #   sends one task per layer with the same lengths, and vLLM's own CPU backend
        #   likewise builds it once per step for all layers (cpu_attn.py).
        # - K/V views per pool layer: id -> (the layer tensor, kept so the id stays its own;
        #   key view; value view). They hold the region's memory: release() drops them.
        self._metadata: tuple[tuple[int, int, bytes], torch.Tensor] | None = None  # key, value
        self._kv_views: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        logger.info("CPU paged attention executor for %s uses ISA %s", shape, self.isa)

    def __call__(self, task: OffloadTask) -> None:
        self.run(
            task.q,
            task.kv_layer,
            task.seq_lens,
            task.block_table,
            task.out,
            scale=task.scale,
            sliding_window=task.sliding_window,
            softcap=task.softcap,
        )

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
        num_seqs = q.shape[0]
        if self._query_start_loc.numel() < num_seqs + 1:
            self._query_start_loc = torch.arange(0, num_seqs + 1, dtype=torch.int32)
        query_start_loc = self._query_start_loc[: num_seqs + 1]
        seq_lens = seq_lens.to(torch.int32)
        block_table = block_table.to(torch.int32)
        scheduler_metadata = self._scheduler_metadata(num_seqs, seq_lens, query_start_loc,
                                                      sliding_window)
        key_cache, value_cache = self._key_value_caches(kv_layer)
        ops.cpu_attention_with_kv_cache(
            query=q,
            key_cache=key_cache,
            value_cache=value_cache,
            output=out,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            scale=scale,
            causal=True,
            alibi_slopes=None,
            sliding_window=sliding_window,
            block_table=block_table,
            softcap=softcap,
            scheduler_metadata=scheduler_metadata,
            s_aux=None,
        )

    def release(self) -> None:
        """Drop the cached K/V views (and metadata), e.g. before their region is unmapped."""
        self._kv_views.clear()
        self._metadata = None

    def _scheduler_metadata(self, num_seqs: int, seq_lens: torch.Tensor,
                            query_start_loc: torch.Tensor, sliding_window: int) -> torch.Tensor:
        key = (num_seqs, sliding_window, seq_lens.contiguous().numpy().tobytes())
        if self._metadata is None or self._metadata[0] != key:
            metadata = ops.cpu_attn_get_scheduler_metadata(
                num_reqs=num_seqs,
                num_heads=self.shape.num_q_heads,
                num_kv_heads=self.shape.num_kv_heads,
                head_dim=self.shape.head_size,
                seq_lens=seq_lens,
                dtype=self._dtype,
                query_start_loc=query_start_loc,
                causal=True,
                sliding_window_size=sliding_window,
                isa=self.isa,
                enable_kv_split=self._enable_kv_split,
            )
            self._metadata = (key, metadata)
        return self._metadata[1]

    def _key_value_caches(self, kv_layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cached = self._kv_views.get(id(kv_layer))
        if cached is None or cached[0] is not kv_layer:
            if len(self._kv_views) >= MAX_CACHED_KV_LAYERS:
                self._kv_views.clear()  # pools come and go (e.g. a profiler's regions)
            cached = (kv_layer, *key_value_caches(kv_layer))
            self._kv_views[id(kv_layer)] = cached
        return cached[1], cached[2]
