"""Attention split into groups of sequences (weaver/vllm_ext/split_attention.py): the cut,
and vLLM's real CPU kernel run by groups against the same kernel over the whole batch."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weaver.vllm_ext.split_attention import group_bounds


def test_group_bounds_by_work():
    assert group_bounds([1, 1, 1, 1], 2) == [(0, 2), (2, 4)]
    # A heavy first request gets a group of its own; the rest still make two groups.
    assert group_bounds([10, 1, 1, 1], 3) == [(0, 1), (1, 2), (2, 4)]
    # A heavy last request: the cut follows the work, so fewer groups than asked.
    assert group_bounds([1, 1, 1, 30], 3) == [(0, 3), (3, 4)]
    assert group_bounds([5, 5], 4) == [(0, 1), (1, 2)]  # one group per sequence at most
    assert group_bounds([], 3) == []
    with pytest.raises(ValueError, match="num_chunks"):
        group_bounds([1], 0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 5000), min_size=1, max_size=64), st.integers(1, 16))
def test_group_bounds_cover_the_batch_in_order(work, num_chunks):
    bounds = group_bounds(work, num_chunks)
    assert bounds[0][0] == 0 and bounds[-1][1] == len(work)
    assert all(lo < hi for lo, hi in bounds)
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))
    assert len(bounds) <= num_chunks
    if len(set(work)) == 1:  # equal work: exactly min(n, requests) groups
        assert len(bounds) == min(num_chunks, len(work))


def _batch(torch, query_lens, seq_lens, *, num_kv_heads=2, num_heads=4, head_size=64,
           block_size=32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 1
    kv_cache = torch.randn(num_blocks, num_kv_heads, block_size, 2 * head_size, generator=gen)
    width = max(blocks_per_seq)
    block_table = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)  # scattered blocks
    used = 0
    for i, n in enumerate(blocks_per_seq):
        block_table[i, :n] = perm[used:used + n]
        used += n
    query_start_loc = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(torch.tensor(query_lens), 0)
    query = torch.randn(int(query_start_loc[-1]), num_heads, head_size, generator=gen)
    md = SimpleNamespace(query_start_loc=query_start_loc,
                         seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                         block_table=block_table, causal=True)
    return query, kv_cache, md


@pytest.mark.parametrize("kv_split", ["0", "1"])
def test_groups_give_the_kernels_own_rows(monkeypatch, kv_split):
    """Bit-identical without vLLM's KV split. With it (the default), vLLM's scheduler may
    cut a long context across threads differently for a smaller batch, so a row can
    differ in its last bit: the same batch-variance vLLM itself has between steps of
    different composition; the engine-level tests check that greedy tokens stay equal."""
    torch = pytest.importorskip("torch")
    monkeypatch.setenv("VLLM_CPU_ATTN_SPLIT_KV", kv_split)
    from vllm import _custom_ops as ops
    from vllm import envs
    from vllm.v1.attention.backends import cpu_attn

    from weaver.vllm_ext import split_attention
    from weaver.vllm_ext.split_attention import AttentionChunks

    num_heads, num_kv_heads, head_size, block_size = 4, 2, 64, 32
    # Mixed step: two decodes, a first prefill chunk, a later chunk over earlier context,
    # more decodes; contexts from 1 token to several blocks.
    query_lens = [1, 1, 40, 7, 1, 1, 1]
    seq_lens = [1, 90, 40, 75, 200, 33, 64]
    query, kv_cache, md = _batch(torch, query_lens, seq_lens, num_heads=num_heads,
                                 num_kv_heads=num_kv_heads, head_size=head_size,
                                 block_size=block_size)
    isa = cpu_attn._get_attn_isa(torch.float32, block_size, head_size, "auto")
    impl = SimpleNamespace(num_heads=num_heads, num_kv_heads=num_kv_heads,
                           head_size=head_size, scale=head_size ** -0.5, sliding_window=-1,
                           kv_cache_dtype="auto", alibi_slopes=None, logits_soft_cap=0.0,
                           sinks=None)
    layer = SimpleNamespace(isa=isa, _k_scale_float=1.0, _v_scale_float=1.0)

    # The whole batch, as CPUAttentionBackendImpl.forward runs it.
    whole = torch.zeros_like(query)
    key_cache, value_cache = kv_cache.view(kv_cache.shape[0], num_kv_heads, block_size * 2,
                                           -1).chunk(2, dim=2)
    scheduler_metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=len(seq_lens), num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_dim=head_size, seq_lens=md.seq_lens, dtype=torch.float32,
        query_start_loc=md.query_start_loc, causal=True, sliding_window_size=-1, isa=isa,
        enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV)
    ops.cpu_attention_with_kv_cache(
        query=query, key_cache=key_cache, value_cache=value_cache, output=whole,
        query_start_loc=md.query_start_loc, seq_lens=md.seq_lens, scale=impl.scale,
        causal=True, alibi_slopes=None, sliding_window=-1, block_table=md.block_table,
        softcap=0.0, scheduler_metadata=scheduler_metadata, s_aux=None)

    for num_chunks in (2, 3, 7, 20):
        split_attention._step_groups.__init__()  # a new step for each plan
        chunks = AttentionChunks(num_chunks)
        polls: list[int] = []
        chunks.poll = functools.partial(polls.append, 1)
        out = torch.full_like(query, float("nan"))
        for _ in range(2):  # two layers of one step share the groups
            chunks.run(impl, layer, query, out, kv_cache, md)
        num_groups = min(num_chunks, len(seq_lens))
        assert chunks.num_chunk_calls == 2 * len(split_attention._step_groups.groups)
        assert 2 <= len(split_attention._step_groups.groups) <= num_groups
        assert len(polls) == chunks.num_polls == chunks.num_chunk_calls - 2
        if kv_split == "0":
            assert torch.equal(out, whole), f"{num_chunks} chunks changed the attention rows"
        else:
            torch.testing.assert_close(out, whole, rtol=1e-6, atol=1e-6)


def test_a_split_needs_two_chunks():
    from weaver.vllm_ext.split_attention import AttentionChunks

    with pytest.raises(ValueError, match=">= 2 chunks"):
        AttentionChunks(1)
