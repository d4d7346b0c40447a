"""Weaver's attention backend (weaver/vllm_ext/attention/backend.py) over vLLM's real CPU_ATTN
builder and kernel: a batch split by vLLM's micro-batch slicing, into a cold engine's groups
of sequences or a hot step's local and remote requests, gives the rows of the whole batch.

Bit-identical without vLLM's KV split. With it (the default), vLLM's scheduler may cut a
long context across threads differently for a smaller batch, so a row can differ in its
last bit: the batch variance vLLM itself has between steps of different composition; the
engine tests check that greedy tokens stay equal.
"""

from __future__ import annotations

import functools

import pytest
import torch
from attention_batches import (
    BLOCK_SIZE,
    Layer,
    common_metadata,
    cpu_impl,
    random_step,
    whole_batch_attention,
    woven_builder,
)

from weaver.vllm_ext.attention.backend import SequenceGroupsMetadata, WovenMetadata
from weaver.vllm_ext.attention.partition import split_requests
from weaver.vllm_ext.layers import AttentionChunks
from weaver.weaving.hot import HotWeaving, RegionKV

# Mixed step: two decodes, a first prefill chunk, a later chunk over earlier context, more
# decodes; contexts from 1 token to several blocks.
QUERY_LENS = [1, 1, 40, 7, 1, 1, 1]
SEQ_LENS = [1, 90, 40, 75, 200, 33, 64]


def assert_rows_equal(got: torch.Tensor, expected: torch.Tensor, kv_split: str) -> None:
    if kv_split == "0":
        assert torch.equal(got, expected), "the split changed the attention rows"
    else:
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kv_split", ["0", "1"])
def test_sequence_groups_give_the_kernels_own_rows(monkeypatch, kv_split):
    monkeypatch.setenv("VLLM_CPU_ATTN_SPLIT_KV", kv_split)
    query, kv_cache, table = random_step(QUERY_LENS, SEQ_LENS, num_blocks=20)
    cm = common_metadata(QUERY_LENS, SEQ_LENS, table)
    whole = whole_batch_attention(query, kv_cache, cm)
    for num_chunks in (2, 3, 7, 20):
        md = woven_builder(num_chunks, attn_chunks=num_chunks).build(0, cm)
        assert isinstance(md, SequenceGroupsMetadata)
        assert 2 <= len(md.groups) <= min(num_chunks, len(SEQ_LENS))
        impl = cpu_impl()
        impl.weaver_attn_chunks = chunks = AttentionChunks(num_chunks)
        polls: list[int] = []
        chunks.poll = functools.partial(polls.append, 1)
        out = torch.full_like(query, float("nan"))
        for _ in range(2):  # two layers of one step share the groups
            impl.forward(Layer(), query, None, None, kv_cache, md, out)
        assert chunks.num_calls == 2 and chunks.num_chunk_calls == 2 * len(md.groups)
        assert len(polls) == chunks.num_polls == chunks.num_chunk_calls - 2
        assert_rows_equal(out, whole, kv_split)


def test_a_plain_builder_builds_vllms_own_metadata():
    query, _, table = random_step(QUERY_LENS, SEQ_LENS, num_blocks=20)
    md = woven_builder(0).build(0, common_metadata(QUERY_LENS, SEQ_LENS, table))
    assert type(md).__name__ == "CPUAttentionMetadata"


def test_split_requests_keeps_each_requests_rows_and_blocks():
    _, _, table = random_step(QUERY_LENS, SEQ_LENS, num_blocks=20)
    cm = common_metadata(QUERY_LENS, SEQ_LENS, table)
    groups = [torch.tensor([1, 4]), torch.tensor([], dtype=torch.int64), torch.tensor([0, 2, 3])]
    first, empty, last = split_requests(cm, groups)
    assert empty is None
    starts = cm.query_start_loc_cpu.tolist()
    for group, part in ((groups[0], first), (groups[2], last)):
        rows = [t for r in group.tolist() for t in range(starts[r], starts[r + 1])]
        assert part.tokens.tolist() == rows
        assert part.common.seq_lens.tolist() == [SEQ_LENS[r] for r in group.tolist()]
        assert torch.equal(part.common.block_table_tensor, table[group])
        lens = [QUERY_LENS[r] for r in group.tolist()]
        assert part.common.query_start_loc_cpu.tolist() == [0, *torch.tensor(lens).cumsum(0)]


class _Region:
    """The hot side's view of the region's KV section: one pool tensor per layer."""

    def __init__(self, pool: torch.Tensor) -> None:
        self.pool = pool

    def kv_layer(self, layer: int) -> torch.Tensor:
        return self.pool

    def take_num_device_fallbacks(self) -> int:
        return 0  # a host region: fallbacks are counted where they run


@pytest.mark.parametrize("kv_split", ["0", "1"])
def test_a_woven_step_gives_the_rows_of_the_whole_batch(monkeypatch, kv_split):
    """Local, remote-prefill and remote-decode requests interleaved; the remote ones'
    blocks live in another pool (ids from num_local). With the pair degraded the hot side
    attends the remote decode rows itself, through the same groups."""
    monkeypatch.setenv("VLLM_CPU_ATTN_SPLIT_KV", kv_split)
    num_local = 20
    is_remote = [False, True, True, False, True, False, True]
    query, local_kv, local_table = random_step(QUERY_LENS, SEQ_LENS, num_blocks=num_local,
                                                seed=1)
    _, remote_kv, remote_table = random_step(QUERY_LENS, SEQ_LENS, num_blocks=num_local,
                                             seed=2, first_block_id=num_local)
    table = torch.where(torch.tensor(is_remote)[:, None], remote_table, local_table)
    cm = common_metadata(QUERY_LENS, SEQ_LENS, table)
    # The whole batch over one cache holding both pools, remote ids past the local ones.
    whole = whole_batch_attention(query, torch.cat([local_kv, remote_kv]), cm)

    region = _Region(remote_kv)
    runtime = HotWeaving(plan=None, sender=region, remote_kv=RegionKV(region))
    runtime.degraded_reason = "a test: no cold side"
    builder = woven_builder(3)
    builder.weaver_hot, builder.weaver_num_local_blocks = runtime, num_local
    md = builder.build(0, cm)
    assert isinstance(md, WovenMetadata)
    step = md.step
    assert step.local.seq_lens.tolist() == [1, 75, 33]
    assert step.remote_prefill.seq_lens.tolist() == [40]  # request 2, its first chunk
    assert step.remote_decode.seq_lens.tolist() == [90, 200, 64]
    assert step.num_new_remote == 1 == runtime.stats.num_remote_sequences
    assert int(step.remote_decode.block_table.max()) < num_local  # rebased to the pool
    impl = cpu_impl()
    impl.weaver_hot, impl.weaver_layer_index = runtime, 0
    out = torch.full_like(query, float("nan"))
    impl.forward(Layer(), query, None, None, local_kv, md, out)
    assert runtime.stats.num_fallback_tasks == 1
    assert_rows_equal(out, whole, kv_split)


def test_a_step_with_nothing_remote_is_vllms_own():
    query, _, table = random_step(QUERY_LENS, SEQ_LENS, num_blocks=20)
    builder = woven_builder(3)
    builder.weaver_hot = HotWeaving(plan=None, sender=_Region(torch.empty(0)))
    builder.weaver_num_local_blocks = 20
    md = builder.build(0, common_metadata(QUERY_LENS, SEQ_LENS, table))
    assert type(md).__name__ == "CPUAttentionMetadata"


def test_block_ids_of_the_whole_pool_are_rebased_and_padding_clamped():
    from weaver.vllm_ext.attention.partition import rebase_block_table

    table = torch.tensor([[12, 15, 0], [20, 0, 0]], dtype=torch.int32)
    cm = common_metadata([1, 1], [2 * BLOCK_SIZE, 1], table)
    assert rebase_block_table(cm, 12).block_table_tensor.tolist() == [[0, 3, 0], [8, 0, 0]]
    assert cm.block_table_tensor.tolist() == table.tolist()  # the batch's own is untouched
