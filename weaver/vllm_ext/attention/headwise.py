"""vLLM's CPU attention kernels over head-wise pages of the unified KV pool.

The unified pool (``weaver.kv``) stores a tenant's KV cache as *head-blocks*: K and V of one
KV head of one layer for ``block_size`` tokens, each in a page of its own, anywhere in the
pool. vLLM's CPU_ATTN kernels read one layer's cache as ``[num_blocks, num_kv_heads,
2 * block_size, head_size]`` through a single block table per sequence, so the kernel expects
the slab of (block, head) at ``block * stride0 + head * stride1``: scattered pages do not fit.

They fit if every (sequence, KV head) pair is handed to the kernel as a sequence of its own
with ONE KV head and that head's group of query heads: the cache is the pool viewed as
``[num_pages, 1, 2 * block_size, head_size]`` and the pair's block table lists the pages of
that head in this layer. Heads never mix in attention, and the kernel honours the strides of
the views it gets, so each head is computed by the same code on the same numbers as in the
tenant's own layout: the outputs are bitwise equal with one kernel thread (a CPU engine on
its own pinned core), split-KV on or off, and with several threads without split-KV
(``tests/vllm_ext/test_headwise_attention.py`` pins it). With several threads AND split-KV
the kernel cuts a long context by how many sequences the batch has (here S * H, not S), so
the last bits may differ (3.6e-7 measured); ``PoolAttentionRuntime`` logs that case.

The cost is bookkeeping, not copies: in decode (one query token per sequence) the query
``[S, H * G, D]`` already is ``[S * H, G, D]`` and the output likewise. The block tables of
all layers (``[S, max_blocks]`` tenant block ids -> ``[L, S * H, max_blocks]`` page ids) and
the K/V slots are gathered once per step. Chunked-prefill rows are regrouped by (sequence,
head) with one gather and one scatter per layer, their indices built once per step.

A page must hold exactly one head-block (K then V, as vLLM lays them out): a tenant's
``block_size`` is chosen so that ``block_size * 2 * head_size * dtype_bytes`` is the pool's
page size (``weaver.kv.pages.headwise_block_size``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm import _custom_ops as ops

from weaver.vllm_ext.attention.cpu_kernels import (
    CPU_ATTN_BLOCK_MULTIPLE,
    PagedBatch,
    key_value_caches,
)


@dataclass(frozen=True)
class HeadwiseGeometry:
    """The attention geometry of one tenant of the pool, as its pages hold it."""

    num_q_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"num_q_heads {self.num_q_heads} is not a multiple of num_kv_heads "
                f"{self.num_kv_heads}: grouped-query attention needs whole groups"
            )
        if self.block_size % CPU_ATTN_BLOCK_MULTIPLE:
            raise ValueError(
                f"block_size {self.block_size} must be a multiple of {CPU_ATTN_BLOCK_MULTIPLE} "
                "for vLLM CPU_ATTN; pick the page size so that it is"
            )

    @property
    def group_size(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def page_bytes(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return self.block_size * 2 * self.head_size * itemsize


def page_view(pool: torch.Tensor, geometry: HeadwiseGeometry) -> torch.Tensor:
    """The pool's bytes as ``[num_pages, 1, block_size, 2 * head_size]`` pages of this tenant's
    dtype: the layout vLLM's CPU kernels read, with one KV head per "block"."""
    if pool.dtype != torch.uint8 or pool.dim() != 1 or not pool.is_contiguous():
        raise ValueError("pool must be a contiguous 1-D uint8 tensor (the region's bytes)")
    page_bytes = geometry.page_bytes
    if pool.numel() % page_bytes:
        raise ValueError(
            f"pool of {pool.numel()} bytes is not a whole number of {page_bytes}-byte pages"
        )
    pages = pool.view(geometry.dtype)
    return pages.view(pool.numel() // page_bytes, 1, geometry.block_size, 2 * geometry.head_size)


def _layer_pages(page_table: torch.Tensor, num_layers: int, num_kv_heads: int) -> torch.Tensor:
    """The tenant's page table as ``[max_blocks, num_layers, num_kv_heads]``."""
    if page_table.dim() != 2 or page_table.shape[1] != num_layers * num_kv_heads:
        raise ValueError(
            f"page table must be [max_blocks, {num_layers} * {num_kv_heads}] (one page per "
            f"head-block), got {tuple(page_table.shape)}"
        )
    return page_table.view(-1, num_layers, num_kv_heads)


class HeadwiseBatch:
    """One step of a tenant (vLLM's query_start_loc / seq_lens / block_table) restated as
    (sequence, KV head) pseudo-sequences over the pool's pages, for every layer at once:
    the page tables are gathered once per step, so a layer costs only the kernel call (a
    per-layer gather cost 70 us, a tenth of a decode layer's attention).

    ``page_table`` is the tenant's ``[max_blocks, num_layers * num_kv_heads]`` page ids, rows
    in (layer, head) order as ``BlockHandle.page_ids`` and ``SharedPageTable`` hold them
    (one page per head-block), -1 where a block has no pages. The scheduler's block id
    ``b`` is the tenant's block ``b - first_block_id`` (vLLM keeps id 0 as its null block,
    so a tenant whose ids start at 0 is seen at first_block_id 1)."""

    def __init__(
        self,
        geometry: HeadwiseGeometry,
        num_layers: int,
        page_table: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        *,
        first_block_id: int = 0,
        causal: bool = True,
        sliding_window: int = -1,
        isa: str,
        enable_kv_split: bool | None = None,
    ) -> None:
        num_seqs = seq_lens.shape[0]
        num_kv_heads = geometry.num_kv_heads
        per_layer = _layer_pages(page_table, num_layers, num_kv_heads)
        if query_start_loc.shape != (num_seqs + 1,) or block_table.shape[0] < num_seqs:
            raise ValueError(
                f"query_start_loc must be [{num_seqs + 1}] and block_table have >= {num_seqs} "
                f"rows, got {tuple(query_start_loc.shape)} and {tuple(block_table.shape)}"
            )
        self.geometry = geometry
        self.num_layers = num_layers
        self.num_seqs = num_seqs
        self.num_tokens = int(query_start_loc[-1])
        # vLLM pads block tables to the longest possible sequence: keep the columns in use.
        max_len = int(seq_lens.max()) if num_seqs else 0
        num_columns = max(1, -(-max_len // geometry.block_size))
        # Columns past a sequence's length hold padding (vLLM's null block 0, or stale
        # ids) and may name dead blocks (-1 pages); the kernel never reads them, and they
        # become tenant block 0 / page 0 so that no index is out of range.
        block_ids = (block_table[:num_seqs, :num_columns].to(torch.int64)
                     - first_block_id).clamp(min=0)
        # [S, columns, L, H] -> [L, S * H, columns]. Contiguous: the kernel reads block
        # table rows densely (with one sequence the reshape is a transposed view).
        self._block_tables = (per_layer[block_ids].permute(2, 0, 3, 1)
                              .reshape(num_layers, num_seqs * num_kv_heads, num_columns)
                              .clamp(min=0).to(torch.int32).contiguous())
        query_lens = (query_start_loc[1:] - query_start_loc[:-1]).to(torch.int64)
        self.is_decode = self.num_tokens == num_seqs and bool((query_lens == 1).all())
        pseudo_lens = query_lens.repeat_interleave(num_kv_heads)
        self.query_start_loc = torch.zeros(num_seqs * num_kv_heads + 1, dtype=torch.int32)
        torch.cumsum(pseudo_lens, 0, out=self.query_start_loc[1:])
        self.seq_lens = seq_lens.to(torch.int32).repeat_interleave(num_kv_heads)
        # Prefill rows of pseudo-sequence (s, h) are the query rows of s, head group h.
        self._rows: tuple[torch.Tensor, torch.Tensor] | None = None
        if not self.is_decode:
            starts = query_start_loc[:-1].to(torch.int64).repeat_interleave(num_kv_heads)
            pseudo_starts = self.query_start_loc[:-1].to(torch.int64)
            offsets = (torch.arange(self.num_tokens * num_kv_heads)
                       - pseudo_starts.repeat_interleave(pseudo_lens))
            token = starts.repeat_interleave(pseudo_lens) + offsets
            head = torch.arange(num_kv_heads).repeat(num_seqs).repeat_interleave(pseudo_lens)
            self._rows = (token, head)
        self._paged = PagedBatch.build(
            num_q_heads=geometry.group_size, num_kv_heads=1, head_size=geometry.head_size,
            dtype=geometry.dtype, query_start_loc=self.query_start_loc,
            seq_lens=self.seq_lens, isa=isa, causal=causal, sliding_window=sliding_window,
            enable_kv_split=enable_kv_split)

    def attention(
        self,
        pages: torch.Tensor,
        layer: int,
        query: torch.Tensor,
        output: torch.Tensor,
        *,
        scale: float,
        softcap: float = 0.0,
    ) -> None:
        """``output[T, num_q_heads, head_size]`` = attention of ``query`` (same shape) over the
        tenant's pages of this layer, as ``cpu_attention_with_kv_cache`` would compute it in
        the tenant's own cache layout."""
        self.attention_over(key_value_caches(pages), layer, query, output, scale=scale,
                            softcap=softcap)

    def attention_over(
        self,
        caches: tuple[torch.Tensor, torch.Tensor],
        layer: int,
        query: torch.Tensor,
        output: torch.Tensor,
        *,
        scale: float,
        softcap: float = 0.0,
    ) -> None:
        """`attention` over the pages' K and V views (``key_value_caches(pages)``), for a
        caller that keeps them (the pool's users in attention/pool.py): made again for every
        layer's call, with the cache flushed before it as serving flushes it, they cost
        58 us, a fifth of a cold-side task's ~0.3 ms."""
        geometry = self.geometry
        expected = (self.num_tokens, geometry.num_q_heads, geometry.head_size)
        if tuple(query.shape) != expected or tuple(output.shape) != expected:
            raise ValueError(
                f"query and output must be {expected}, got {tuple(query.shape)} and "
                f"{tuple(output.shape)}"
            )
        pseudo_shape = (self.num_tokens * geometry.num_kv_heads, geometry.group_size,
                        geometry.head_size)
        per_head = (self.num_tokens, geometry.num_kv_heads, geometry.group_size,
                    geometry.head_size)
        if self._rows is None:
            pseudo_query = query.reshape(pseudo_shape)
            pseudo_output = (output.view(pseudo_shape) if output.is_contiguous()
                             else torch.empty(pseudo_shape, dtype=output.dtype))
        else:
            pseudo_query = query.reshape(per_head)[self._rows]
            pseudo_output = torch.empty(pseudo_shape, dtype=output.dtype)
        self._paged.attend(pseudo_query, caches, pseudo_output,
                           self._block_tables[layer], scale=scale, softcap=softcap)
        if self._rows is not None:
            output.view(per_head)[self._rows] = pseudo_output
        elif pseudo_output.data_ptr() != output.data_ptr():
            output.copy_(pseudo_output.view(expected))


class HeadwiseSlots:
    """Where one step's new K/V go: vLLM's slot_mapping (``block_id * block_size + offset``,
    -1 = padding) turned into pool slots (``page * block_size + offset``) for every layer
    and head at once, so a layer's write is one call of vLLM's reshape-and-cache op."""

    def __init__(
        self,
        geometry: HeadwiseGeometry,
        num_layers: int,
        page_table: torch.Tensor,
        slot_mapping: torch.Tensor,
        *,
        first_block_id: int = 0,
        isa: str,
    ) -> None:
        self.geometry = geometry
        self.isa = isa
        per_layer = _layer_pages(page_table, num_layers, geometry.num_kv_heads)
        block_size = geometry.block_size
        slots = slot_mapping.to(torch.int64)
        is_real = slots >= 0
        blocks = torch.where(is_real, slots // block_size - first_block_id, 0)
        if bool((blocks < 0).any()) or bool((blocks >= per_layer.shape[0]).any()):
            raise ValueError(
                f"a slot names a block outside the tenant's ids [{first_block_id}, "
                f"{first_block_id + per_layer.shape[0]})"
            )
        page_ids = per_layer[blocks].to(torch.int64)  # [T, L, H]
        if bool((page_ids[is_real] < 0).any()):
            raise ValueError("a slot names a block that has no pages: allocate before writing")
        page_slots = page_ids * block_size + (slots % block_size).view(-1, 1, 1)
        page_slots = torch.where(is_real.view(-1, 1, 1), page_slots, -1)
        # [T, L, H] -> [L, T * H]: token-major within a layer, as key.reshape(T * H, ...)
        self.num_tokens = slots.shape[0]
        self._slot_tables = page_slots.permute(1, 0, 2).reshape(num_layers, -1).contiguous()

    def write_kv(self, pages: torch.Tensor, layer: int, key: torch.Tensor,
                 value: torch.Tensor) -> None:
        """Store this step's ``key``/``value`` ``[T, num_kv_heads, head_size]`` of one layer,
        each (token, head) into its page."""
        num_tokens, num_kv_heads, head_size = key.shape
        if value.shape != key.shape or num_kv_heads != self.geometry.num_kv_heads or (
                num_tokens != self.num_tokens):
            raise ValueError(
                f"key/value must both be [{self.num_tokens}, {self.geometry.num_kv_heads}, "
                f"head_size], got {tuple(key.shape)} and {tuple(value.shape)}"
            )
        key_cache, value_cache = key_value_caches(pages)
        ops.cpu_attn_reshape_and_cache(
            key.reshape(num_tokens * num_kv_heads, 1, head_size),
            value.reshape(num_tokens * num_kv_heads, 1, head_size),
            key_cache, value_cache, self._slot_tables[layer], self.isa,
        )
