"""AllocatorBlockPool: vLLM's own BlockPool, its blocks backed by pages of the unified pool."""

from __future__ import annotations

import importlib.util
import uuid

import pytest

from weaver.kv.pages import TenantShape
from weaver.kv.pool_plan import PoolPlan, PoolTenantPlan
from weaver.kv.service import LockedKVAllocator

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM (CPU build) is not installed", allow_module_level=True)

from vllm.v1.core.block_pool import BlockPool  # noqa: E402

from weaver.vllm_ext.pool_scheduler import AllocatorBlockPool, PoolOwner  # noqa: E402

SHAPE = TenantShape(num_layers=2, num_kv_heads=2, head_size=32, block_size=32, dtype_bytes=4)
PAGE = SHAPE.head_block_bytes
OTHER = TenantShape(num_layers=1, num_kv_heads=1, head_size=32, block_size=32, dtype_bytes=4)


def make_plan(quota_blocks: int, num_pages: int = 40) -> PoolPlan:
    name = f"wtest{uuid.uuid4().hex[:8]}"
    return PoolPlan(pool_name=f"{name}_pool", table_name=f"{name}_table", page_bytes=PAGE,
                    num_pages=num_pages,
                    tenants=(PoolTenantPlan("cold", SHAPE, 4 * quota_blocks, is_owner=True),
                             PoolTenantPlan("hot", OTHER, num_pages - 4 * quota_blocks)))


@pytest.fixture
def owner():
    plan = make_plan(quota_blocks=3)
    # vLLM ids 0..10: the null block, then one per block the tenant may ever hold (10)
    pool = BlockPool(plan.max_blocks("cold") + 1, enable_caching=False, hash_block_size=32)
    owner = PoolOwner(plan, "cold", pool)
    yield owner
    owner.close()


def test_free_count_follows_the_quota(owner):
    pool = owner.block_pool
    assert isinstance(pool, AllocatorBlockPool)
    assert pool.get_num_free_blocks() == 3
    blocks = pool.get_new_blocks(2)
    assert [b.block_id for b in blocks] == [1, 2]  # tenant blocks 0, 1
    assert pool.get_num_free_blocks() == 1
    with pytest.raises(ValueError, match="cannot get 2 blocks"):
        pool.get_new_blocks(2)


def test_blocks_get_pages_in_the_shared_table_and_give_them_back(owner):
    pool, table = owner.block_pool, owner.page_table
    blocks = pool.get_new_blocks(3)
    rows = [table.page_ids("cold", b.block_id - 1).tolist() for b in blocks]
    assert all(min(row) >= 0 for row in rows)
    assert len({page for row in rows for page in row}) == 12  # 3 blocks x 4 head-blocks
    pool.free_blocks(blocks[:2])
    assert table.page_ids("cold", 0).tolist() == [-1] * 4
    assert pool.get_num_free_blocks() == 2
    assert owner.stats()["num_free_pages"] == 40 - 4
    # vLLM hands out exactly the ids the allocator chose (lowest free first)
    assert [b.block_id for b in pool.get_new_blocks(1)] == [1]


def test_a_block_still_referenced_keeps_its_pages(owner):
    pool = owner.block_pool
    (block,) = pool.get_new_blocks(1)
    block.ref_cnt += 1  # shared by a second request
    pool.free_blocks([block])
    assert owner.page_table.page_ids("cold", 0).min() >= 0
    pool.free_blocks([block])
    assert owner.page_table.page_ids("cold", 0).tolist() == [-1] * 4


def test_prefix_caching_is_refused():
    plan = make_plan(quota_blocks=3)
    pool = BlockPool(plan.max_blocks("cold") + 1, enable_caching=True, hash_block_size=32)
    with pytest.raises(ValueError, match="no-enable-prefix-caching"):
        PoolOwner(plan, "cold", pool)


def test_an_engine_without_ids_for_the_whole_pool_is_refused():
    plan = make_plan(quota_blocks=3)
    pool = BlockPool(plan.max_blocks("cold"), enable_caching=False, hash_block_size=32)
    with pytest.raises(ValueError, match="KV budget of the whole pool"):
        PoolOwner(plan, "cold", pool)


def test_the_locked_allocator_is_what_the_pool_uses(owner):
    assert isinstance(owner.allocator, LockedKVAllocator)
    assert owner.block_pool.weaver_allocator is owner.allocator
