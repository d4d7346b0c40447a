"""The vLLM-style block-id view of one tenant (weaver/kv/block_view.py)."""

import numpy as np
import pytest

from weaver.kv.allocator import UnifiedKVAllocator
from weaver.kv.block_view import TenantBlockView
from weaver.kv.service import LockedKVAllocator


def test_ids_are_contiguous_after_the_offset_and_stable(allocator: UnifiedKVAllocator) -> None:
    view = TenantBlockView(allocator, "hot", first_block_id=16)  # e.g. 16 local blocks first
    assert view.block_id_range == range(16, 21)  # 1000 pages // 180 per block = 5 ids
    assert view.get_num_free_blocks() == 4  # quota 720 = 4 blocks
    ids = view.get_new_blocks(3)
    assert ids == [16, 17, 18]
    view.free_blocks([17])
    assert view.get_new_blocks(1) == [17]
    assert view.handle(18).page_ids == allocator.get_block("hot", 2).page_ids


def test_get_new_blocks_is_all_or_nothing_and_raises_like_block_pool(
    allocator: UnifiedKVAllocator,
) -> None:
    view = TenantBlockView(allocator, "hot")
    with pytest.raises(ValueError, match="cannot get 5 free blocks"):
        view.get_new_blocks(5)
    assert allocator.tenant_stats("hot").num_blocks == 0
    assert view.get_new_blocks(4) == [0, 1, 2, 3]
    assert view.get_num_free_blocks() == 0


def test_page_table_matches_handles(allocator: UnifiedKVAllocator) -> None:
    view = TenantBlockView(allocator, "hot", first_block_id=1)
    ids = view.get_new_blocks(2)
    table = view.page_table(ids)
    assert table.shape == (2, 30, 3, 2)
    assert table.dtype == np.int64
    for row, block_id in zip(table, ids, strict=True):
        handle = view.handle(block_id)
        assert row[7, 2, 1] == handle.page_id(7, 2, 1)
        assert tuple(row.ravel()) == handle.page_ids
    assert len(np.unique(table)) == 2 * 180


def test_foreign_or_dead_ids_raise(allocator: UnifiedKVAllocator) -> None:
    view = TenantBlockView(allocator, "cold", first_block_id=10)
    [block_id] = view.get_new_blocks(1)
    with pytest.raises(ValueError, match="outside tenant 'cold'"):
        view.free_blocks([9])
    with pytest.raises(ValueError, match="not a live block"):
        view.handle(11)
    view.free_blocks([block_id])
    with pytest.raises(ValueError, match="nothing was freed"):
        view.free_blocks([block_id])


def test_view_over_the_locked_allocator_counts_a_refusal(allocator: UnifiedKVAllocator) -> None:
    view = TenantBlockView(LockedKVAllocator(allocator), "cold", first_block_id=3)
    assert view.block_id_range == range(3, 253)  # 1000 pages // 4 per block
    assert view.get_new_blocks(70) == list(range(3, 73))  # quota 280 pages = 70 blocks
    with pytest.raises(ValueError, match="0 available"):
        view.get_new_blocks(1)
    assert allocator.tenant_stats("cold").num_failed_allocations == 1
    assert view.page_table([3, 72]).shape == (2, 2, 2, 1)
