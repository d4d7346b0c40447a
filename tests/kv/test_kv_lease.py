"""LeasedTenantAllocator against the real allocator service, in process (the socket path is
tests/vllm_ext/test_pool_scheduler.py)."""

import pytest
from kv_models import SMOLLM2_135M, TINY_LLAMA

from weaver.kv.allocator import UnifiedKVAllocator
from weaver.kv.lease import LeasedTenantAllocator
from weaver.kv.pages import choose_page_bytes
from weaver.kv.service import KVAllocatorService, LockedKVAllocator


class InProcess:
    """The client's `call` straight into the service (same requests and answers)."""

    def __init__(self, service: KVAllocatorService):
        self.service = service

    def call(self, op, **kwargs):
        answer = self.service.handle({"op": op, **kwargs})
        if not answer["ok"]:
            raise ValueError(answer["error"])
        return answer["result"]


@pytest.fixture
def parts():
    allocator = UnifiedKVAllocator(1000, choose_page_bytes([SMOLLM2_135M, TINY_LLAMA]))
    allocator.add_tenant("cold", TINY_LLAMA, 280, is_owner=True)
    allocator.add_tenant("hot", SMOLLM2_135M, 720)  # 4 blocks of 180 pages
    locked = LockedKVAllocator(allocator)
    lease = LeasedTenantAllocator(InProcess(KVAllocatorService(locked)), "hot",
                                  allocator.max_blocks("hot"), lease_blocks=3)
    return locked, lease


def test_lease_tops_up_within_the_quota(parts):
    locked, lease = parts
    assert lease.sync() == 0 and lease.num_allocatable_blocks("hot") == 3
    blocks = lease.allocate_blocks("hot", 3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert lease.allocate_blocks("hot", 1) is None
    lease.sync()  # the quota has room for one more block only
    assert lease.num_allocatable_blocks("hot") == 1
    assert locked.stats().tenants[1].num_blocks == 4


def test_the_lease_knows_the_room_its_quota_still_grants(parts):
    """Spares cover the next step only; the room beyond them is what a hot engine weighs
    this pool by against its other colds' free blocks."""
    _, lease = parts
    lease.sync(1)
    assert (lease.num_allocatable_blocks("hot"), lease.num_room_blocks) == (1, 3)
    lease.sync(3)
    assert (lease.num_allocatable_blocks("hot"), lease.num_room_blocks) == (3, 1)
    lease.client = Gone()
    lease.sync(4)  # the owner is gone: nothing more to count on
    assert lease.num_room_blocks == 0


def test_freed_blocks_are_spares_and_the_excess_goes_back(parts):
    locked, lease = parts
    lease.sync()
    blocks = lease.allocate_blocks("hot", 3)
    lease.sync()  # + 1
    lease.free_blocks("hot", [b.block_id for b in blocks])
    assert lease.num_allocatable_blocks("hot") == 4
    lease.sync()
    assert lease.num_held_blocks == 3 and locked.stats().tenants[1].num_blocks == 3


def test_mistakes_are_named(parts):
    _, lease = parts
    with pytest.raises(ValueError, match="not held by this lease"):
        lease.free_blocks("hot", [7])
    with pytest.raises(ValueError, match="'hot''s, not 'cold''s"):
        lease.num_allocatable_blocks("cold")
    with pytest.raises(ValueError, match="lease_blocks"):
        LeasedTenantAllocator(lease.client, "hot", 4, 0)


class Gone:
    def call(self, op, **kwargs):
        raise ConnectionResetError("owner died")


def test_a_lost_owner_stops_new_blocks_but_keeps_the_engine_running(parts):
    _, lease = parts
    lease.sync()
    (block,) = lease.allocate_blocks("hot", 1)
    lease.client = Gone()
    assert lease.sync() == 0
    assert lease.broken_reason == "ConnectionResetError: owner died"
    assert lease.num_allocatable_blocks("hot") == 0
    lease.free_blocks("hot", [block.block_id])  # no error: the request just finished
    assert lease.num_held_blocks == 0


def test_a_restarted_owner_is_leased_from_anew_once_the_old_blocks_are_freed(parts):
    _, lease = parts
    lease.sync()
    (block,) = lease.allocate_blocks("hot", 1)
    lease.report["reclaim_preemptions"] = 3
    lease.void("the pool's owner restarted")
    assert lease.num_allocatable_blocks("hot") == 0 and lease.sync() == 0
    # The restarted owner's allocator: the same tenants, nothing handed out yet.
    allocator = UnifiedKVAllocator(1000, choose_page_bytes([SMOLLM2_135M, TINY_LLAMA]))
    allocator.add_tenant("cold", TINY_LLAMA, 280, is_owner=True)
    allocator.add_tenant("hot", SMOLLM2_135M, 720)
    new_owner = LockedKVAllocator(allocator)
    client = InProcess(KVAllocatorService(new_owner))
    with pytest.raises(ValueError, match="still in use"):
        lease.renew(client)  # block 0 of the old pool is still some request's
    lease.free_blocks("hot", [block.block_id])
    lease.renew(client)
    assert lease.broken_reason is None and lease.report == {}
    lease.sync()
    assert [b.block_id for b in lease.allocate_blocks("hot", 3)] == [0, 1, 2]
    assert new_owner.stats().tenants[1].num_blocks == 3


def test_wanting_more_than_the_quota_marks_the_tenant_starved_for_adbs(parts):
    locked, lease = parts
    lease.lease_blocks = 6  # the quota holds 4 blocks
    lease.sync()
    assert lease.num_allocatable_blocks("hot") == 4
    hot = locked.stats().tenants[1]
    assert hot.num_failed_allocations == 1
    # ADBS: the idle owner donates half its unused quota per rebalance, the starved hot
    # tenant takes it in whole blocks of 180 pages: 140 pages are not one, 140 + 70 are.
    assert locked.rebalance() == {"cold": -140, "hot": 0}
    assert locked.rebalance() == {"cold": -70, "hot": 180}


def test_a_shrink_completes_once_the_blocks_are_back_and_reports_travel(parts):
    locked, lease = parts
    lease.sync()
    blocks = lease.allocate_blocks("hot", 3)
    locked.request_shrink("hot", 180)  # keep 1 block of 4
    lease.report["reclaim_preemptions"] = 2
    assert lease.sync() == 2  # the spare went back; 2 of the 3 in use are due
    assert locked.tenant_reports == {"hot": {"reclaim_preemptions": 2}}
    lease.free_blocks("hot", [b.block_id for b in blocks[1:]])
    assert lease.sync() == 0
    assert locked.stats().num_shrinks_completed == 1


class Counting(InProcess):
    def __init__(self, service):
        super().__init__(service)
        self.num_calls = 0

    def call(self, op, **kwargs):
        self.num_calls += 1
        return super().call(op, **kwargs)


def test_a_starved_lease_asks_again_only_after_a_pause(parts, monkeypatch):
    locked, lease = parts
    lease.client = Counting(lease.client.service)
    lease.lease_blocks = 6  # more than the quota's 4 blocks: starved
    lease.sync()
    assert lease.client.num_calls == 1 and lease.num_allocatable_blocks("hot") == 4
    for _ in range(50):  # a scheduler looping without work
        lease.sync()
    assert lease.client.num_calls == 1 and lease.num_skipped_syncs == 50
    monkeypatch.setattr(LeasedTenantAllocator, "STARVED_SYNC_INTERVAL_S", 0.0)
    lease.sync()
    assert lease.client.num_calls == 2
