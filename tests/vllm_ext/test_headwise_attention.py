"""vLLM's CPU attention over head-wise pages of the unified pool equals vLLM's own layout.

Two tenants of different shapes share one pool through the real `UnifiedKVAllocator`, their
blocks allocated interleaved so every tenant's pages are scattered. Each tenant's K/V are
written twice: by vLLM's op into the tenant's own `[num_blocks, H, N, 2D]` cache (the
reference: what `CPUAttentionBackendImpl.forward` computes), and by `write_kv_headwise` into
the pool. Attention of the same queries must be bitwise equal.
"""

from __future__ import annotations

import contextlib
import importlib.util

import pytest
import torch

from weaver.kv.allocator import UnifiedKVAllocator
from weaver.kv.pages import TenantShape, headwise_block_size

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM (CPU build) is not installed", allow_module_level=True)

from vllm import _custom_ops as ops  # noqa: E402

from weaver.vllm_ext.attention.cpu_kernels import key_value_caches  # noqa: E402
from weaver.vllm_ext.attention.headwise import (  # noqa: E402
    HeadwiseBatch,
    HeadwiseGeometry,
    HeadwiseSlots,
    page_view,
)

PAGE_BYTES = 32 * 1024
DTYPE = torch.float32
NUM_PAGES = 400


def geometry(num_q_heads: int, num_kv_heads: int, head_size: int) -> HeadwiseGeometry:
    return HeadwiseGeometry(num_q_heads, num_kv_heads, head_size,
                            headwise_block_size(PAGE_BYTES, head_size, 4), DTYPE)


# SmolLM2-135M's attention (9 q / 3 kv heads of 64) and a Llama-like cold model of another
# shape (8 q / 2 kv heads of 128): block sizes 64 and 32 over the same 32 KiB pages.
TENANTS = {
    "hot": (3, geometry(9, 3, 64)),
    "cold": (2, geometry(8, 2, 128)),
}
MAX_BLOCKS = 16


class Tenant:
    """One tenant: its blocks in the pool and, for reference, in vLLM's own layout."""

    def __init__(self, name: str, num_layers: int, geo: HeadwiseGeometry):
        self.name, self.num_layers, self.geo = name, num_layers, geo
        self.own_cache = [torch.zeros(MAX_BLOCKS, geo.num_kv_heads, geo.block_size,
                                      2 * geo.head_size, dtype=DTYPE)
                          for _ in range(num_layers)]
        self.page_table = torch.full((MAX_BLOCKS, num_layers * geo.num_kv_heads), -1,
                                     dtype=torch.int32)

    def shape(self) -> TenantShape:
        return TenantShape(self.num_layers, self.geo.num_kv_heads, self.geo.head_size,
                           self.geo.block_size, 4)


@pytest.fixture
def pool_and_tenants():
    allocator = UnifiedKVAllocator(NUM_PAGES, PAGE_BYTES)
    tenants = {name: Tenant(name, layers, geo) for name, (layers, geo) in TENANTS.items()}
    for tenant in tenants.values():
        allocator.add_tenant(tenant.name, tenant.shape(), NUM_PAGES // 2,
                             is_owner=tenant.name == "cold")
        assert allocator.pages_per_block(tenant.name) == tenant.num_layers * (
            tenant.geo.num_kv_heads)  # one page per head-block
    for _ in range(MAX_BLOCKS):  # interleaved, so each tenant's pages are scattered
        for tenant in tenants.values():
            block = allocator.allocate_block(tenant.name)
            tenant.page_table[block.block_id] = torch.tensor(block.page_ids)
    pool = torch.zeros(NUM_PAGES * PAGE_BYTES, dtype=torch.uint8)
    return pool, tenants


@contextlib.contextmanager
def torch_threads(num: int):
    previous = torch.get_num_threads()
    torch.set_num_threads(num)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def isa_of(geo: HeadwiseGeometry) -> str:
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return _get_attn_isa(geo.dtype, geo.block_size, geo.head_size, "auto")


def fill(pool: torch.Tensor, tenant: Tenant, lens: list[int], gen: torch.Generator):
    """Random K/V for `lens` tokens of each sequence, written both ways (as one prefill step
    would); returns the block table (sequence i owns blocks in a shuffled order)."""
    geo, isa = tenant.geo, isa_of(tenant.geo)
    pages = page_view(pool, geo)
    order = torch.randperm(MAX_BLOCKS, generator=gen)
    per_seq = MAX_BLOCKS // len(lens)
    block_table = order[: per_seq * len(lens)].view(len(lens), per_seq).to(torch.int32)
    slots = torch.cat([block_table[i, torch.arange(n) // geo.block_size].to(torch.int64)
                       * geo.block_size + torch.arange(n) % geo.block_size
                       for i, n in enumerate(lens)])
    writes = HeadwiseSlots(geo, tenant.num_layers, tenant.page_table, slots, isa=isa)
    for layer in range(tenant.num_layers):
        key = torch.randn(len(slots), geo.num_kv_heads, geo.head_size, generator=gen)
        value = torch.randn(len(slots), geo.num_kv_heads, geo.head_size, generator=gen)
        own_k, own_v = key_value_caches(tenant.own_cache[layer])
        ops.cpu_attn_reshape_and_cache(key, value, own_k, own_v, slots, isa)
        writes.write_kv(pages, layer, key, value)
    return block_table


def reference_attention(tenant: Tenant, layer: int, query, query_start_loc, seq_lens,
                        block_table, split: bool) -> torch.Tensor:
    """What vLLM's CPU backend computes over the tenant's own cache layout."""
    geo, isa = tenant.geo, isa_of(tenant.geo)
    metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=len(seq_lens), num_heads=geo.num_q_heads, num_kv_heads=geo.num_kv_heads,
        head_dim=geo.head_size, seq_lens=seq_lens, dtype=DTYPE,
        query_start_loc=query_start_loc, causal=True, sliding_window_size=-1, isa=isa,
        enable_kv_split=split)
    own_k, own_v = key_value_caches(tenant.own_cache[layer])
    out = torch.empty_like(query)
    ops.cpu_attention_with_kv_cache(
        query=query, key_cache=own_k, value_cache=own_v, output=out,
        query_start_loc=query_start_loc, seq_lens=seq_lens, scale=geo.head_size ** -0.5,
        causal=True, alibi_slopes=None, sliding_window=-1, block_table=block_table,
        softcap=0.0, scheduler_metadata=metadata, s_aux=None)
    return out


# (context length, query length) per sequence: decode only, and chunked prefill mixed with
# decodes (a first chunk, a later chunk that must see earlier K/V, a one-token prompt).
BATCHES = {
    "decode": [(37, 1), (100, 1), (5, 1), (128, 1)],
    "mixed": [(90, 1), (70, 70), (120, 33), (1, 1)],
    # One sequence over several blocks: its [S * H, columns] table is a transposed view
    # before it is made contiguous (the kernel read it wrongly, found in the engine test).
    "single": [(100, 1)],
    "single-prefill": [(70, 40)],
}


# One thread (a CPU engine on one pinned core), split-KV on or off; or more threads without
# split-KV. With several threads AND split-KV, the kernel cuts a sequence's context by how
# many sequences the batch has, which differs here (S * H sequences instead of S): the
# results may then differ in the last bits (3.6e-7 measured with 2 sequences, 2 threads).
@pytest.mark.parametrize(("num_threads", "split"), [(1, True), (1, False), (2, False)],
                         ids=["1-thread-split-kv", "1-thread", "2-threads"])
@pytest.mark.parametrize("batch", sorted(BATCHES))
@pytest.mark.parametrize("tenant_name", sorted(TENANTS))
def test_headwise_attention_is_bitwise_vllms(pool_and_tenants, tenant_name, batch, num_threads,
                                             split):
    pool, tenants = pool_and_tenants
    tenant = tenants[tenant_name]
    geo = tenant.geo
    gen = torch.Generator().manual_seed(7)
    lens = [ctx for ctx, _ in BATCHES[batch]]
    query_lens = [q for _, q in BATCHES[batch]]
    block_table = fill(pool, tenant, lens, gen)
    # Also fill the other tenant, so a page mix-up would read its numbers.
    other = next(t for t in tenants.values() if t is not tenant)
    fill(pool, other, [64, 64], gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    query_start_loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()],
                                   dtype=torch.int32)
    num_tokens = int(query_start_loc[-1])
    with torch_threads(num_threads):
        headwise = HeadwiseBatch(geo, tenant.num_layers, tenant.page_table, query_start_loc,
                                 seq_lens, block_table, isa=isa_of(geo), enable_kv_split=split)
        assert headwise.is_decode == all(q == 1 for q in query_lens)
        pages = page_view(pool, geo)
        for layer in range(tenant.num_layers):
            query = torch.randn(num_tokens, geo.num_q_heads, geo.head_size, generator=gen)
            expected = reference_attention(tenant, layer, query, query_start_loc, seq_lens,
                                           block_table, split)
            got = torch.full_like(query, float("nan"))
            headwise.attention(pages, layer, query, got, scale=geo.head_size ** -0.5)
            assert torch.equal(got, expected), (layer, (got - expected).abs().max())


def test_scheduler_block_ids_may_start_above_the_tenants(pool_and_tenants):
    """vLLM's block 0 is its null block: the tenant's block b is the scheduler's b + 1."""
    pool, tenants = pool_and_tenants
    cold = tenants["cold"]
    geo = cold.geo
    gen = torch.Generator().manual_seed(5)
    block_table = fill(pool, cold, [50, 90], gen)
    seq_lens = torch.tensor([50, 90], dtype=torch.int32)
    query_start_loc = torch.tensor([0, 1, 2], dtype=torch.int32)
    query = torch.randn(2, geo.num_q_heads, geo.head_size, generator=gen)
    # Padding columns hold vLLM's null block 0: it must not be read as tenant block -1.
    shifted = torch.cat([block_table + 1, torch.zeros(2, 3, dtype=torch.int32)], dim=1)
    got = torch.empty_like(query)
    with torch_threads(1):
        expected = reference_attention(cold, 1, query, query_start_loc, seq_lens, block_table,
                                       True)
        HeadwiseBatch(geo, cold.num_layers, cold.page_table, query_start_loc, seq_lens, shifted,
                      first_block_id=1, isa=isa_of(geo), enable_kv_split=True).attention(
            page_view(pool, geo), 1, query, got, scale=geo.head_size ** -0.5)
    assert torch.equal(got, expected)


def test_each_tenant_writes_only_its_own_pages(pool_and_tenants):
    pool, tenants = pool_and_tenants
    hot, cold = tenants["hot"], tenants["cold"]
    gen = torch.Generator().manual_seed(3)
    fill(pool, cold, [128, 64], gen)
    cold_pages = page_view(pool, cold.geo)[cold.page_table.flatten().long()].clone()
    before = pool.clone()
    fill(pool, hot, [200, 56], gen)
    changed = (pool != before).view(NUM_PAGES, PAGE_BYTES).any(dim=1).nonzero().flatten()
    assert set(changed.tolist()) <= set(hot.page_table.flatten().tolist())
    assert torch.equal(page_view(pool, cold.geo)[cold.page_table.flatten().long()], cold_pages)


def one_token_slots(tenant: Tenant, page_table: torch.Tensor, slot: int) -> HeadwiseSlots:
    return HeadwiseSlots(tenant.geo, tenant.num_layers, page_table, torch.tensor([slot]),
                         isa=isa_of(tenant.geo))


def test_writing_to_a_block_without_pages_is_refused(pool_and_tenants):
    _, tenants = pool_and_tenants
    hot = tenants["hot"]
    table = hot.page_table.clone()
    table[2] = -1  # block 2 freed
    with pytest.raises(ValueError, match="has no pages"):
        one_token_slots(hot, table, 2 * hot.geo.block_size + 5)


def test_padding_slots_are_skipped(pool_and_tenants):
    pool, tenants = pool_and_tenants
    hot = tenants["hot"]
    geo = hot.geo
    before = pool.clone()
    key = torch.ones(1, geo.num_kv_heads, geo.head_size)
    one_token_slots(hot, hot.page_table, -1).write_kv(page_view(pool, geo), 0, key, key)
    assert torch.equal(pool, before)


def test_geometry_and_shape_checks(pool_and_tenants):
    pool, tenants = pool_and_tenants
    hot = tenants["hot"]
    with pytest.raises(ValueError, match="whole groups"):
        HeadwiseGeometry(9, 2, 64, 64, DTYPE)
    with pytest.raises(ValueError, match="multiple of 32"):
        HeadwiseGeometry(9, 3, 64, 48, DTYPE)
    with pytest.raises(ValueError, match="whole number"):
        page_view(torch.zeros(PAGE_BYTES + 1, dtype=torch.uint8), hot.geo)
    with pytest.raises(ValueError, match="one page per"):
        one_token_slots(hot, torch.zeros(4, 5, dtype=torch.int32), 0)
    with pytest.raises(ValueError, match="outside the tenant's ids"):
        one_token_slots(hot, hot.page_table, MAX_BLOCKS * hot.geo.block_size)
    wrong = torch.zeros(2, hot.geo.num_kv_heads, hot.geo.head_size)
    with pytest.raises(ValueError, match="key/value"):
        one_token_slots(hot, hot.page_table, 0).write_kv(page_view(pool, hot.geo), 0, wrong,
                                                         wrong)
    batch = HeadwiseBatch(hot.geo, hot.num_layers, hot.page_table, torch.tensor([0, 1]),
                          torch.tensor([1]), torch.zeros(1, 1, dtype=torch.int32),
                          isa=isa_of(hot.geo))
    query = torch.zeros(2, hot.geo.num_q_heads, hot.geo.head_size)
    with pytest.raises(ValueError, match="query and output"):
        batch.attention(page_view(pool, hot.geo), 0, query, query, scale=1.0)


def test_a_hot_steps_tasks_share_one_batch_until_its_sequences_or_pages_change(
        pool_and_tenants):
    """The cold side's pool executor (attention/pool.py StepBatches) builds a hot step's
    batch at its first layer's task and keeps it for the others; a task of other lengths,
    or whose blocks' pages moved (a freed block id comes back with other pages), gets a
    batch of its own; every task's output equals a batch built for it alone (which the test
    above holds to vLLM's)."""
    from weaver.vllm_ext.attention.pool import StepBatches

    pool, tenants = pool_and_tenants
    hot = tenants["hot"]
    geo = hot.geo
    gen = torch.Generator().manual_seed(11)
    block_table = fill(pool, hot, [150, 90], gen)
    table = hot.page_table.clone()  # the shared table, as the allocator changes it in place
    batches = StepBatches(geo, hot.num_layers, table, max_seqs=4, tenant="hot",
                          isa=isa_of(geo))
    pages = page_view(pool, geo)
    query_start_loc = torch.tensor([0, 1, 2], dtype=torch.int32)

    def serve_step(lens: list[int]) -> None:
        seq_lens = torch.tensor(lens, dtype=torch.int32)
        for layer in range(hot.num_layers):
            query = torch.randn(2, geo.num_q_heads, geo.head_size, generator=gen)
            got = torch.full_like(query, float("nan"))
            batches.for_task(seq_lens, block_table, -1).attention(
                pages, layer, query, got, scale=geo.head_size ** -0.5)
            fresh = torch.empty_like(query)
            HeadwiseBatch(geo, hot.num_layers, table, query_start_loc, seq_lens, block_table,
                          isa=isa_of(geo)).attention(pages, layer, query, fresh,
                                                     scale=geo.head_size ** -0.5)
            assert torch.equal(got, fresh), layer

    with torch_threads(1):
        serve_step([149, 89])
        assert batches.num_built == 1  # one batch for the step's three layers
        serve_step([150, 90])
        assert batches.num_built == 2
        # The first sequence's first block freed and its id given other pages: the same
        # lengths and ids, another batch (the one kept would read the old pages).
        first = int(block_table[0, 0])
        spare = int(block_table[1, -1])  # a block the second sequence does not reach
        table[first] = table[spare].clone()
        serve_step([150, 90])
        assert batches.num_built == 3
        serve_step([150, 90])
        assert batches.num_built == 3
        table[first] = -1
        with pytest.raises(ValueError, match="no pages"):
            batches.for_task(torch.tensor([150, 90], dtype=torch.int32), block_table, -1)
        outside = block_table.clone()
        outside[0, 0] = MAX_BLOCKS
        with pytest.raises(ValueError, match="outside 'hot'"):
            batches.for_task(torch.tensor([150, 90], dtype=torch.int32), outside, -1)
