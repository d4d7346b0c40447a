"""Helpers for the attention tests (not a test module): a step's batch as vLLM's runner
hands it to a builder, and vLLM's real CPU_ATTN builder and impl around Weaver's mixins,
made without an engine (only the attributes their build() and forward() read are set)."""

from __future__ import annotations

import torch
from vllm.v1.attention.backend import AttentionType, CommonAttentionMetadata
from vllm.v1.attention.backends import cpu_attn

from weaver.vllm_ext.attention.cpu import WeaverCPUAttentionImpl, WeaverCPUMetadataBuilder

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 4, 2, 64, 32


def common_metadata(query_lens: list[int], seq_lens: list[int],
                    block_table: torch.Tensor) -> CommonAttentionMetadata:
    qsl = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(query_lens), 0)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    num_tokens = int(qsl[-1])
    slots = torch.arange(num_tokens, dtype=torch.int64)  # not read by decoder attention
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=lens,
        num_reqs=len(seq_lens), num_actual_tokens=num_tokens, max_query_len=max(query_lens),
        max_seq_len=max(seq_lens), block_table_tensor=block_table, slot_mapping=slots,
        seq_lens_cpu_upper_bound=lens.clone())


def _set_builder_fields(builder: object) -> None:
    builder.num_heads, builder.num_kv_heads, builder.head_dim = NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE
    builder.dtype, builder.window_size, builder.block_size = torch.float32, -1, BLOCK_SIZE
    builder.kv_cache_dtype = "auto"
    builder.isa = cpu_attn._get_attn_isa(torch.float32, BLOCK_SIZE, HEAD_SIZE, "auto")
    builder.is_cross_attention = builder.is_encoder_only_attention = False


def cpu_builder() -> cpu_attn.CPUAttentionMetadataBuilder:
    """vLLM's own CPU_ATTN builder (its build() is what runs)."""
    builder = object.__new__(cpu_attn.CPUAttentionMetadataBuilder)
    _set_builder_fields(builder)
    return builder


def woven_builder(num_parts: int, *, attn_chunks: int = 1) -> WeaverCPUMetadataBuilder:
    """Weaver's builder in front of vLLM's, with vLLM builders for its groups."""
    builder = object.__new__(WeaverCPUMetadataBuilder)
    _set_builder_fields(builder)
    builder._weaver_part_builders = [cpu_builder() for _ in range(num_parts)]
    builder.weaver_hot, builder.weaver_num_local_blocks = None, 0
    builder.weaver_attn_chunks = attn_chunks
    return builder


def cpu_impl() -> WeaverCPUAttentionImpl:
    """Weaver's impl in front of vLLM's CPU_ATTN impl, as a plain engine has it."""
    impl = object.__new__(WeaverCPUAttentionImpl)
    impl.num_heads, impl.num_kv_heads, impl.head_size = NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE
    impl.scale, impl.sliding_window, impl.logits_soft_cap = HEAD_SIZE ** -0.5, -1, 0
    impl.alibi_slopes = impl.sinks = None
    impl.kv_cache_dtype, impl.attn_type = "auto", AttentionType.DECODER
    impl.use_zentorch_sdpa = False
    impl.weaver_attn_chunks = None
    return impl


class Layer:
    """What CPU_ATTN reads of its attention layer."""

    isa = cpu_attn._get_attn_isa(torch.float32, BLOCK_SIZE, HEAD_SIZE, "auto")
    _k_scale_float = 1.0
    _v_scale_float = 1.0


def random_step(query_lens: list[int], seq_lens: list[int], num_blocks: int, *,
                seed: int = 0, first_block_id: int = 0) -> tuple[torch.Tensor, torch.Tensor,
                                                                   torch.Tensor]:
    """query [T, H, D], a cache of num_blocks random blocks, and a block table giving each
    sequence scattered blocks (ids from first_block_id)."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-s // BLOCK_SIZE) for s in seq_lens]
    if sum(blocks_per_seq) > num_blocks:
        raise ValueError("not enough blocks")
    kv_cache = torch.randn(num_blocks, NUM_KV_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE, generator=gen)
    block_table = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32) + first_block_id
    used = 0
    for i, n in enumerate(blocks_per_seq):
        block_table[i, :n] = perm[used:used + n]
        used += n
    query = torch.randn(sum(query_lens), NUM_HEADS, HEAD_SIZE, generator=gen)
    return query, kv_cache, block_table


def whole_batch_attention(query: torch.Tensor, kv_cache: torch.Tensor,
                          cm: CommonAttentionMetadata) -> torch.Tensor:
    """The batch as vLLM runs it: its builder's metadata, its impl's forward."""
    out = torch.full_like(query, float("nan"))
    md = cpu_builder().build(0, cm)
    cpu_attn.CPUAttentionBackendImpl.forward(cpu_impl(), Layer(), query, None, None, kv_cache,
                                             md, out)
    return out
