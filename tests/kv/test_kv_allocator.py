"""Unit tests of the unified KV allocator: blocks, quotas, shrinks, owner priority, ADBS."""

import json

import pytest
from kv_models import LLAMA2_7B, LLAMA3_8B, SMOLLM2_135M, TINY_LLAMA

from weaver.kv.adbs import AdbsPolicy, TenantLoad, plan_rebalance
from weaver.kv.allocator import UnifiedKVAllocator
from weaver.kv.pages import TenantShape, choose_page_bytes


def make_pool(num_pages: int = 400, cold_quota: int = 200, hot_quota: int = 180):
    """TINY (4 pages/block) as the owner, SMOL (180 pages/block) as a hot tenant."""
    allocator = UnifiedKVAllocator(num_pages, choose_page_bytes([SMOLLM2_135M, TINY_LLAMA]))
    allocator.add_tenant("cold", TINY_LLAMA, cold_quota, is_owner=True)
    allocator.add_tenant("hot", SMOLLM2_135M, hot_quota)
    return allocator


def test_blocks_get_dense_ids_and_distinct_pages() -> None:
    allocator = make_pool()
    blocks = [allocator.allocate_block("cold") for _ in range(5)]
    assert [b.block_id for b in blocks] == [0, 1, 2, 3, 4]
    assert blocks[0].page_ids == (0, 1, 2, 3)  # a fresh pool fills from page 0
    pages = [p for b in blocks for p in b.page_ids]
    assert len(set(pages)) == 20
    allocator.free_block("cold", blocks[2])
    again = allocator.allocate_block("cold")
    assert again.block_id == 2  # lowest free id is reused
    assert again.page_ids == blocks[2].page_ids
    allocator.check_invariants()


def test_address_table_orders_pages_by_layer_head_subpage() -> None:
    allocator = make_pool()
    block = allocator.allocate_block("hot")
    assert len(block.page_ids) == 30 * 3 * 2
    assert block.page_id(0, 0, 0) == block.page_ids[0]
    assert block.page_id(0, 1, 1) == block.page_ids[3]
    assert block.page_id(29, 2, 1) == block.page_ids[-1]
    with pytest.raises(ValueError, match="layer 30"):
        block.page_id(30, 0)
    with pytest.raises(ValueError, match="3 KV heads"):
        block.page_id(0, 3)


def test_quota_caps_allocation_and_failure_is_counted() -> None:
    allocator = make_pool(cold_quota=8)
    assert allocator.can_allocate("cold", 2)
    assert not allocator.can_allocate("cold", 3)
    assert allocator.allocate_blocks("cold", 3) is None
    assert len(allocator.allocate_blocks("cold", 2)) == 2
    assert allocator.allocate_block("cold") is None
    stats = allocator.tenant_stats("cold")
    assert (stats.num_blocks, stats.num_used_pages, stats.quota_pages) == (2, 8, 8)
    assert stats.num_failed_allocations == 2
    assert stats.utilisation == 1.0


def test_double_free_and_foreign_handle_raise() -> None:
    allocator = make_pool()
    block = allocator.allocate_block("cold")
    allocator.free_block("cold", block)
    with pytest.raises(ValueError, match="double free"):
        allocator.free_block("cold", block)
    hot_block = allocator.allocate_block("hot")
    with pytest.raises(ValueError, match="not a live block"):
        allocator.free_block("cold", hot_block)
    allocator.allocate_block("cold")
    with pytest.raises(ValueError, match="nothing was freed"):
        allocator.free_blocks("cold", [0, 7])
    assert allocator.tenant_stats("cold").num_blocks == 1


def test_user_errors_raise_value_error_that_says_how_to_fix() -> None:
    allocator = make_pool()
    with pytest.raises(ValueError, match="only 20 of 400 pages are unassigned"):
        allocator.add_tenant("other", TINY_LLAMA, 21)
    with pytest.raises(ValueError, match="already exists"):
        allocator.add_tenant("hot", TINY_LLAMA, 0)
    with pytest.raises(ValueError, match="already the owner"):
        allocator.add_tenant("cold2", TINY_LLAMA, 0, is_owner=True)
    with pytest.raises(ValueError, match="unknown tenant"):
        allocator.allocate_block("nobody")
    with pytest.raises(ValueError, match="enlarge the pool"):
        UnifiedKVAllocator(100, 4096).add_tenant("big", SMOLLM2_135M, 0)
    allocator.allocate_block("hot")
    with pytest.raises(ValueError, match="request_shrink"):
        allocator.set_quota("hot", 100)
    with pytest.raises(ValueError, match="use set_quota"):
        allocator.request_shrink("hot", 180)


def test_shrink_keeps_live_blocks_until_the_caller_releases_them() -> None:
    allocator = make_pool(num_pages=800, cold_quota=200, hot_quota=540)
    hot_blocks = allocator.allocate_blocks("hot", 3)
    ticket = allocator.request_shrink("hot", 200)
    assert ticket.num_blocks_to_release == 2  # 540 used - 200 quota = 340 pages = 2 blocks
    assert allocator.live_blocks("hot") == hot_blocks  # nothing invalidated
    assert allocator.tenant_stats("hot").num_pages_over_quota == 340
    assert allocator.tenant_stats("hot").is_shrinking
    assert allocator.allocate_block("hot") is None
    allocator.check_invariants()  # over quota is allowed while the ticket is open
    with pytest.raises(ValueError, match="still holds 2 block"):
        allocator.complete_shrink(ticket)
    allocator.free_block("hot", hot_blocks[0])
    assert allocator.num_blocks_to_release("hot") == 1
    allocator.free_block("hot", hot_blocks[1])
    allocator.complete_shrink(ticket)
    assert allocator.live_blocks("hot") == hot_blocks[2:]
    stats = allocator.stats()
    assert (stats.num_shrinks_requested, stats.num_shrinks_completed) == (1, 1)
    assert stats.num_reclaimed_pages == 340
    assert stats.num_unassigned_pages == 800 - 200 - 200
    with pytest.raises(ValueError, match="not open"):
        allocator.complete_shrink(ticket)


def test_owner_gets_freed_pages_before_other_tenants() -> None:
    # Pool 400: owner quota 40 (10 blocks), hot 360 (2 blocks), no unassigned page.
    allocator = make_pool(num_pages=400, cold_quota=40, hot_quota=360)
    allocator.add_tenant("hot2", TINY_LLAMA, 0)
    hot_blocks = allocator.allocate_blocks("hot", 2)
    tickets = allocator.reclaim_for_owner(200)  # the owner wants 200 more pages back
    assert [t.tenant for t in tickets] == ["hot"]
    assert tickets[0].num_blocks_to_release == 2  # 360 used, quota now 160
    assert allocator.quota_pages("cold") == 240
    # hot2 is given quota from nowhere but the pages hot releases must go to the owner first.
    allocator.request_shrink("hot", 0)
    allocator.set_quota("hot2", 160)
    allocator.free_block("hot", hot_blocks[0])  # 180 pages free, owner headroom is 240
    assert allocator.num_free_pages == 220
    assert not allocator.can_allocate("hot2")
    assert allocator.num_allocatable_blocks("cold") == 55
    allocator.free_block("hot", hot_blocks[1])
    assert allocator.can_allocate("hot2", 40)
    assert allocator.num_allocatable_blocks("cold") == 60


def test_reclaim_for_owner_takes_unassigned_then_unused_then_shrinks() -> None:
    allocator = make_pool(num_pages=1000, cold_quota=100, hot_quota=540)
    allocator.add_tenant("hot2", TINY_LLAMA, 200)
    allocator.allocate_blocks("hot", 2)  # hot uses 360 of 540
    allocator.allocate_blocks("hot2", 10)  # hot2 uses 40 of 200
    # 160 unassigned, then 180 + 160 unused: 500 pages need no shrink at all.
    assert allocator.reclaim_for_owner(500) == []
    assert (allocator.quota_pages("hot"), allocator.quota_pages("hot2")) == (360, 40)
    tickets = allocator.reclaim_for_owner(100)
    assert [(t.tenant, t.new_quota_pages, t.num_blocks_to_release) for t in tickets] == [
        ("hot", 260, 1)
    ]
    assert allocator.quota_pages("cold") == 700
    with pytest.raises(ValueError, match="can reclaim 0..300"):
        allocator.reclaim_for_owner(301)


def test_adbs_hand_checked_single_recipient() -> None:
    policy = AdbsPolicy()
    loads = [
        TenantLoad("busy", quota_pages=500, num_used_pages=480, pages_per_block=10),
        TenantLoad("idle", quota_pages=400, num_used_pages=100, pages_per_block=4),
    ]
    # idle: utilisation 0.25, gives floor(0.5 * 300) = 150 (its floor is 104).
    # Pool = 100 unassigned + 150 = 250 -> busy gets 250 (25 blocks of 10 pages).
    assert plan_rebalance(loads, 100, policy) == {"busy": 750, "idle": 250}


def test_adbs_hand_checked_two_recipients_round_to_their_blocks() -> None:
    policy = AdbsPolicy()
    loads = [
        TenantLoad("a", quota_pages=500, num_used_pages=450, pages_per_block=10),  # 0.90: busy
        TenantLoad("b", quota_pages=100, num_used_pages=20, pages_per_block=4, is_starved=True),
        TenantLoad("idle", quota_pages=300, num_used_pages=0, pages_per_block=4),
        TenantLoad(
            "floored", quota_pages=100, num_used_pages=0, pages_per_block=4, min_quota_pages=90
        ),
    ]
    # idle gives 150; floored may give only 10. Pool 0 + 160, share 80 each:
    # a takes 80 (8 blocks), b takes 80 (20 blocks).
    assert plan_rebalance(loads, 0, policy) == {"a": 580, "b": 180, "idle": 150, "floored": 90}
    # With no busy tenant nothing moves.
    calm = [TenantLoad("x", 500, 100, 10), TenantLoad("y", 400, 100, 4)]
    assert plan_rebalance(calm, 100, policy) == {"x": 500, "y": 400}


def test_rebalance_moves_quota_to_the_busy_tenant() -> None:
    allocator = make_pool(num_pages=1000, cold_quota=500, hot_quota=360)
    allocator.allocate_blocks("cold", 25)  # cold uses 100 of 500: a donor
    allocator.allocate_blocks("hot", 2)  # hot uses 360 of 360: busy
    deltas = allocator.rebalance()
    # cold gives floor(0.5 * 400) = 200; pool = 140 unassigned + 200 = 340 -> hot gets 180.
    assert deltas == {"cold": -200, "hot": 180}
    assert allocator.stats().num_unassigned_pages == 160
    assert allocator.stats().num_rebalances == 1
    assert allocator.stats().num_quota_pages_moved == 180
    assert allocator.allocate_block("hot") is not None


def fill_idle_cold(allocator: UnifiedKVAllocator, hot: str) -> int:
    """Allocate hot blocks, re-balancing whenever hot is refused, until re-balancing stops
    giving hot more quota. Returns the pages hot ends up holding."""
    while True:
        if allocator.allocate_block(hot) is None and allocator.rebalance()[hot] <= 0:
            allocator.check_invariants()
            return allocator.tenant_stats(hot).num_used_pages


@pytest.mark.parametrize(
    ("hot_shape", "cold_shape", "num_cold_blocks"),
    [
        (SMOLLM2_135M, TINY_LLAMA, 1800),  # 7200 pages
        (TINY_LLAMA, SMOLLM2_135M, 40),  # 7200 pages
        (LLAMA3_8B, LLAMA2_7B, 40),  # 40960 pages
    ],
    ids=["smollm2-hot-on-tiny", "tiny-hot-on-smollm2", "llama3-8b-hot-on-llama2-7b"],
)
@pytest.mark.parametrize("cold_share", [0.5, 1.0])
def test_hot_uses_at_least_80_percent_when_cold_is_idle(
    hot_shape: TenantShape, cold_shape: TenantShape, num_cold_blocks: int, cold_share: float
) -> None:
    page_bytes = choose_page_bytes([hot_shape, cold_shape])
    num_pages = num_cold_blocks * cold_shape.pages_per_block(page_bytes)
    allocator = UnifiedKVAllocator(num_pages, page_bytes)
    cold_quota = int(cold_share * num_pages)
    allocator.add_tenant("cold", cold_shape, cold_quota, is_owner=True)
    allocator.add_tenant("hot", hot_shape, num_pages - cold_quota)
    hot_pages = fill_idle_cold(allocator, "hot")
    assert hot_pages * page_bytes >= 0.8 * num_pages * page_bytes
    # ...and the idle owner can still take its quota back when it wakes up.
    tickets = allocator.reclaim_for_owner(cold_quota - allocator.quota_pages("cold"))
    for ticket in tickets:
        allocator.free_blocks(
            "hot",
            [b.block_id for b in allocator.live_blocks("hot")][: ticket.num_blocks_to_release],
        )
        allocator.complete_shrink(ticket)
    assert allocator.num_allocatable_blocks("cold") == cold_quota // cold_shape.pages_per_block(
        page_bytes
    )


def test_snapshot_round_trips_through_json() -> None:
    allocator = make_pool(num_pages=800, cold_quota=200, hot_quota=540)
    allocator.allocate_blocks("cold", 7)
    hot_blocks = allocator.allocate_blocks("hot", 3)
    allocator.free_block("cold", 3)
    ticket = allocator.request_shrink("hot", 360)
    allocator.rebalance()
    restored = UnifiedKVAllocator.from_snapshot(json.loads(json.dumps(allocator.snapshot())))
    assert restored.stats() == allocator.stats()
    assert restored.live_blocks("hot") == hot_blocks
    assert restored.allocate_block("cold") == allocator.allocate_block("cold")
    restored.free_block("hot", hot_blocks[0])
    restored.complete_shrink(ticket)
    bad = allocator.snapshot()
    bad["free_pages"].append(bad["free_pages"][0])
    with pytest.raises(AssertionError, match="free twice"):
        UnifiedKVAllocator.from_snapshot(bad)
    with pytest.raises(ValueError, match="snapshot version"):
        UnifiedKVAllocator.from_snapshot({**bad, "version": 99})
