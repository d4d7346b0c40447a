"""A subset of a step's attention batch, and vLLM's CPU attention kernel over it.

Both the hot side (local / remote-prefill / remote-decode rows, weaver/vllm_ext/
hot_attention.py) and the cold side's split attention (groups of sequences with a poll
between them, weaver/vllm_ext/split_attention.py) run CPU_ATTN on part of a batch. This
does what ``CPUAttentionMetadataBuilder.build`` + ``CPUAttentionBackendImpl.forward`` in
``vllm/v1/attention/backends/cpu_attn.py`` (vLLM 0.32.0) would do for a batch of just
these requests: each request's attention depends only on its own query rows, KV blocks
and length, so running the batch in parts gives the same rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm import _custom_ops as ops
from vllm import envs

if TYPE_CHECKING:
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadata


@dataclass
class BatchRows:
    """A subset of the batch's requests and the token rows they own."""

    requests: torch.Tensor  # int64 request indices
    tokens: torch.Tensor  # int64 token indices into query/output
    query_start_loc: torch.Tensor  # int32, rebased to the subset
    seq_lens: torch.Tensor  # int32
    block_table: torch.Tensor  # int32, rebased to the pool the rows' KV lives in
    scheduler_metadata: torch.Tensor | None = None  # vLLM's, built once per step


def select_rows(md: CPUAttentionMetadata, requests: torch.Tensor,
                block_offset: int = 0) -> BatchRows | None:
    """The rows of ``requests`` (int64 indices, ascending); None when there are none."""
    if requests.numel() == 0:
        return None
    starts = md.query_start_loc[requests].to(torch.int64)
    lengths = md.query_start_loc[requests + 1].to(torch.int64) - starts
    query_start_loc = torch.zeros(len(requests) + 1, dtype=torch.int32)
    torch.cumsum(lengths, 0, out=query_start_loc[1:])
    # Token i of the subset sits at starts[r] + (i - query_start_loc[r]) in the batch.
    offsets = torch.repeat_interleave(starts - query_start_loc[:-1].to(torch.int64), lengths)
    tokens = torch.arange(int(query_start_loc[-1]), dtype=torch.int64) + offsets
    block_table = md.block_table[requests]
    if block_offset:
        block_table = (block_table - block_offset).clamp_(min=0)
    return BatchRows(requests, tokens, query_start_loc, md.seq_lens[requests].to(torch.int32),
                     block_table)


def select_mask(md: CPUAttentionMetadata, mask: torch.Tensor,
                block_offset: int = 0) -> BatchRows | None:
    """The rows of the requests where ``mask`` (one bool per request) is true."""
    return select_rows(md, torch.nonzero(mask).flatten(), block_offset)


def attend_rows(impl: Any, layer: Any, query: torch.Tensor, output: torch.Tensor,
                kv_layer: torch.Tensor, md: CPUAttentionMetadata, rows: BatchRows) -> None:
    """vLLM's CPU attention kernel over ``rows`` with ``impl``'s (a CPU_ATTN impl's) heads,
    scale and window, reading K/V from ``kv_layer``; writes the rows of ``output``."""
    if rows.scheduler_metadata is None:  # the same for every layer of the step
        rows.scheduler_metadata = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=len(rows.requests), num_heads=impl.num_heads,
            num_kv_heads=impl.num_kv_heads, head_dim=impl.head_size,
            seq_lens=rows.seq_lens, dtype=query.dtype,
            query_start_loc=rows.query_start_loc, causal=md.causal,
            sliding_window_size=impl.sliding_window, isa=layer.isa,
            enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV, kv_cache_dtype=impl.kv_cache_dtype)
    num_blocks, num_kv_heads, block_size, _ = kv_layer.shape
    key_cache, value_cache = kv_layer.view(
        num_blocks, num_kv_heads, block_size * 2, -1).chunk(2, dim=2)
    sub_out = output.new_empty((rows.tokens.numel(), *output.shape[1:]))
    ops.cpu_attention_with_kv_cache(
        query=query[rows.tokens], key_cache=key_cache, value_cache=value_cache,
        output=sub_out, query_start_loc=rows.query_start_loc, seq_lens=rows.seq_lens,
        scale=impl.scale, causal=md.causal, alibi_slopes=impl.alibi_slopes,
        sliding_window=impl.sliding_window, block_table=rows.block_table,
        softcap=impl.logits_soft_cap, scheduler_metadata=rows.scheduler_metadata,
        s_aux=impl.sinks, k_scale=layer._k_scale_float, v_scale=layer._v_scale_float,
        kv_cache_dtype=impl.kv_cache_dtype)
    output[rows.tokens] = sub_out
