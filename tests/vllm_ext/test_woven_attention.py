"""Weaver's attention backend (weaver/vllm_ext/attention/backend.py) over vLLM's real CPU_ATTN
builder and kernel: a batch split by vLLM's micro-batch slicing, into a cold engine's groups
of sequences or a hot step's local and remote requests (of one or two cold engines), gives
the rows of the whole batch.

Bit-identical without vLLM's KV split. With it (the default), vLLM's scheduler may cut a
long context across threads differently for a smaller batch, so a row can differ in its
last bit: the batch variance vLLM itself has between steps of different composition; the
engine tests check that greedy tokens stay equal.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from types import SimpleNamespace

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
from weaver.weaving.hot_pairs import HotPairs

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


@dataclass
class _Plan:
    """The PairPlan fields the hot pairs read (a region of `num_remote_blocks` blocks)."""

    cold: str
    num_remote_blocks: int
    hot: str = "h"
    shape: object = field(default_factory=lambda: SimpleNamespace(block_size=BLOCK_SIZE))


def degraded_cold(cold: str, pool: torch.Tensor) -> HotWeaving:
    region = _Region(pool)
    runtime = HotWeaving(plan=_Plan(cold, pool.shape[0]), sender=region,
                         remote_kv=RegionKV(region))
    runtime.degraded_reason = "a test: no cold side"
    return runtime


@pytest.mark.parametrize("kv_split", ["0", "1"])
def test_a_woven_step_over_two_colds_gives_the_rows_of_the_whole_batch(monkeypatch, kv_split):
    """Local requests and the remote ones of two cold engines, prefill and decode,
    interleaved; each cold's blocks live in its own pool (ids from num_local, then from
    num_local + the first cold's blocks). With both pairs degraded the hot side attends the
    remote decode rows itself, through the same groups."""
    monkeypatch.setenv("VLLM_CPU_ATTN_SPLIT_KV", kv_split)
    num_local = 20
    side = torch.tensor([-1, 0, 1, -1, 1, -1, 0])  # -1 local, else the cold's index
    query, local_kv, local_table = random_step(QUERY_LENS, SEQ_LENS, num_blocks=num_local,
                                                seed=1)
    _, first_kv, first_table = random_step(QUERY_LENS, SEQ_LENS, num_blocks=20, seed=2,
                                           first_block_id=num_local)
    _, second_kv, second_table = random_step(QUERY_LENS, SEQ_LENS, num_blocks=24, seed=3,
                                             first_block_id=num_local + 20)
    table = torch.where((side == 0)[:, None], first_table,
                        torch.where((side == 1)[:, None], second_table, local_table))
    cm = common_metadata(QUERY_LENS, SEQ_LENS, table)
    # The whole batch over one cache holding every pool, each after the one before.
    whole = whole_batch_attention(query, torch.cat([local_kv, first_kv, second_kv]), cm)

    pairs = HotPairs.of(degraded_cold("c0", first_kv), degraded_cold("c1", second_kv))
    builder = woven_builder(5)  # the local group, then each cold's prefill and decode
    builder.weaver_hot, builder.weaver_num_local_blocks = pairs, num_local
    md = builder.build(0, cm)
    assert isinstance(md, WovenMetadata)
    step = md.step
    assert step.local.seq_lens.tolist() == [1, 75, 33]
    first, second = step.remotes
    assert (first.cold, first.prefill, first.decode.seq_lens.tolist()) == (0, None, [90, 64])
    assert second.cold == 1 and second.decode.seq_lens.tolist() == [200]
    assert second.prefill.seq_lens.tolist() == [40]  # request 2, its first chunk
    assert [cold.stats.num_remote_sequences for cold in pairs.colds] == [0, 1]
    assert int(first.decode.block_table.max()) < 20  # rebased to its own pool
    assert int(second.decode.block_table.max()) < 24
    impl = cpu_impl()
    impl.weaver_hot, impl.weaver_layer_index = pairs, 0
    out = torch.full_like(query, float("nan"))
    impl.forward(Layer(), query, None, None, local_kv, md, out)
    assert [cold.stats.num_fallback_tasks for cold in pairs.colds] == [1, 1]
    assert_rows_equal(out, whole, kv_split)


def test_new_kv_goes_to_the_pool_of_its_slot():
    """Slots below the local count stay local; each cold's range, rebased, goes to its
    pool (slot = block id x block size + offset, the ranges one after another)."""
    pools = [torch.zeros(4, 1, BLOCK_SIZE, 2), torch.zeros(2, 1, BLOCK_SIZE, 2)]
    pairs = HotPairs.of(degraded_cold("c0", pools[0]), degraded_cold("c1", pools[1]))
    written: dict[str, list[int]] = {}

    class Ops:
        layer_index = 0
        local_kv = torch.zeros(3, 1, BLOCK_SIZE, 2)

        def write(self, kv_layer, key, value, slots):
            name = {id(Ops.local_kv): "local", id(pools[0]): "c0", id(pools[1]): "c1"}
            written[name[id(kv_layer)]] = slots.tolist()

    local_slots = 3 * BLOCK_SIZE
    slots = torch.tensor([5, local_slots + 1, local_slots + 4 * BLOCK_SIZE + 3, 0,
                          local_slots + 4 * BLOCK_SIZE - 1])
    key = torch.zeros(5, 1, 1)
    pairs.write_kv(Ops(), key, key, slots, local_slots)
    assert written == {"local": [5, 0], "c0": [1, 4 * BLOCK_SIZE - 1], "c1": [3]}
    written.clear()
    pairs.write_kv(Ops(), key[:2], key[:2], torch.tensor([7, 2]), local_slots)
    assert written == {"local": [7, 2]}  # nothing remote: one write of the whole step


def test_a_step_with_nothing_remote_is_vllms_own():
    query, _, table = random_step(QUERY_LENS, SEQ_LENS, num_blocks=20)
    builder = woven_builder(3)
    builder.weaver_hot = HotPairs.of(degraded_cold("c0", torch.empty(8)))
    builder.weaver_num_local_blocks = 20
    md = builder.build(0, common_metadata(QUERY_LENS, SEQ_LENS, table))
    assert type(md).__name__ == "CPUAttentionMetadata"


def test_block_ids_of_the_whole_pool_are_rebased_and_padding_clamped():
    from weaver.vllm_ext.attention.partition import rebase_block_table

    table = torch.tensor([[12, 15, 0], [20, 0, 0]], dtype=torch.int32)
    cm = common_metadata([1, 1], [2 * BLOCK_SIZE, 1], table)
    assert rebase_block_table(cm, 12).block_table_tensor.tolist() == [[0, 3, 0], [8, 0, 0]]
    assert cm.block_table_tensor.tolist() == table.tolist()  # the batch's own is untouched
