"""AllocatorBlockPool: vLLM's own BlockPool, its blocks backed by pages of the unified pool."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import multiprocessing
import os
import signal
import time
import uuid
from multiprocessing.connection import Client

import pytest

from weaver.kv.lease import LeasedTenantAllocator
from weaver.kv.owner import HostedPool, PoolClient
from weaver.kv.pages import TenantShape
from weaver.kv.pool_plan import PoolPlan, PoolTenantPlan
from weaver.kv.service import KVAllocatorClient, LockedKVAllocator

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM (CPU build) is not installed", allow_module_level=True)

from vllm.v1.core.block_pool import BlockPool  # noqa: E402
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    BlockHash,
    get_block_hash,
    make_block_hash_with_group_id,
)

from weaver.vllm_ext.block_pool import (
    AllocatorBlockPool,  # noqa: E402
    open_pool_owner,  # noqa: E402
)
from weaver.vllm_ext.routing_kv_cache_manager import lendable_blocks  # noqa: E402
from weaver.vllm_ext.scheduler import LeaseKeeper  # noqa: E402
from weaver.weaving.placement import Placement  # noqa: E402

SHAPE = TenantShape(num_layers=2, num_kv_heads=2, head_size=32, block_size=32, dtype_bytes=4)
PAGE = SHAPE.head_block_bytes
OTHER = TenantShape(num_layers=1, num_kv_heads=1, head_size=32, block_size=32, dtype_bytes=4)


def make_plan(quota_blocks: int, num_pages: int = 40, service: bool = False) -> PoolPlan:
    name = f"wtest{uuid.uuid4().hex[:8]}"
    extra = {"service_address": f"\0{name}", "authkey_hex": uuid.uuid4().hex} if service else {}
    return PoolPlan(pool_name=f"{name}_pool", table_name=f"{name}_table", page_bytes=PAGE,
                    num_pages=num_pages,
                    tenants=(PoolTenantPlan("cold", SHAPE, 4 * quota_blocks, is_owner=True),
                             PoolTenantPlan("hot", OTHER, num_pages - 4 * quota_blocks)),
                    rebalance_interval_s=0.0, **extra)  # quotas move only when a test says


@pytest.fixture
def owner():
    plan = make_plan(quota_blocks=3)
    # vLLM ids 0..10: the null block, then one per block the tenant may ever hold (10)
    pool = BlockPool(plan.max_blocks("cold") + 1, enable_caching=False, hash_block_size=32)
    owner = open_pool_owner(plan, "cold", pool)
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


@pytest.fixture
def caching_owner():
    plan = make_plan(quota_blocks=3)
    pool = BlockPool(plan.max_blocks("cold") + 1, enable_caching=True, hash_block_size=32)
    owner = open_pool_owner(plan, "cold", pool)
    yield owner
    owner.close()


def cache(pool: BlockPool, block, tag: bytes) -> bytes:
    """Give the block a prefix-cache entry, as vLLM's cache_full_blocks does after a step."""
    key = make_block_hash_with_group_id(BlockHash(tag * 8), 0)
    pool._insert_block_hash(key, block, None)
    return key


def test_a_cached_block_keeps_its_pages_and_a_prefix_hit_reuses_them(caching_owner):
    pool, table = caching_owner.block_pool, caching_owner.page_table
    a, b = pool.get_new_blocks(2)
    key = cache(pool, a, b"a")
    pages = table.page_ids("cold", a.block_id - 1).tolist()
    pool.free_blocks([a, b])
    assert table.page_ids("cold", a.block_id - 1).tolist() == pages  # cached: kept
    assert table.page_ids("cold", b.block_id - 1).tolist() == [-1] * 4  # uncached: back
    assert list(pool.weaver_cached) == [a.block_id]
    assert pool.get_num_free_blocks() == 3  # 2 new + the cached one
    (hit,) = pool.get_cached_block(get_block_hash(key), [0])
    assert hit is a
    pool.touch([a])
    assert not pool.weaver_cached and a.ref_cnt == 1
    assert pool.get_num_free_blocks() == 2


def test_with_the_quota_used_up_the_least_recently_freed_cached_block_is_reused(caching_owner):
    pool, table = caching_owner.block_pool, caching_owner.page_table
    blocks = pool.get_new_blocks(3)
    keys = [cache(pool, block, tag)
            for block, tag in zip(blocks, [b"x", b"y", b"z"], strict=True)]
    pool.free_blocks([blocks[1]])
    pool.free_blocks([blocks[0]])
    pages = table.page_ids("cold", blocks[1].block_id - 1).tolist()
    (reused,) = pool.get_new_blocks(1)  # quota full: no new pages, evict the LRU block
    assert reused is blocks[1]
    assert reused.block_hash is None
    assert pool.get_cached_block(get_block_hash(keys[1]), [0]) is None
    assert table.page_ids("cold", reused.block_id - 1).tolist() == pages
    assert list(pool.weaver_cached) == [blocks[0].block_id]
    caching_owner.allocator.check_invariants()


def test_adbs_lends_an_idle_owners_cached_pages_by_evicting_them(caching_owner):
    pool, table, allocator = (caching_owner.block_pool, caching_owner.page_table,
                              caching_owner.allocator)
    blocks = pool.get_new_blocks(3)
    for block, tag in zip(blocks, [b"p", b"q", b"r"], strict=True):
        cache(pool, block, tag)
    pool.free_blocks(blocks)  # the cold model is idle; its 12 pages stay as a cache
    assert allocator.stats().num_free_pages == 40 - 12
    # The hot tenant is starved: an allocation beyond its quota (28 pages) failed.
    assert allocator.allocate_blocks("hot", 29) is None
    deltas = caching_owner.rebalance()
    # The owner counted its cache as unused: it gave half (6 pages) and evicted 2 blocks
    # (least recently freed first) to be back within its quota.
    assert deltas == {"cold": -6, "hot": 6}
    assert caching_owner.num_cache_evictions == 2
    assert list(pool.weaver_cached) == [blocks[2].block_id]
    assert table.page_ids("cold", blocks[0].block_id - 1).tolist() == [-1] * 4
    assert blocks[0].block_hash is None and blocks[2].block_hash is not None
    allocator.check_invariants()
    assert allocator.allocate_blocks("hot", 34) is not None  # the whole lent part


def test_resetting_the_prefix_cache_gives_the_pages_back(caching_owner):
    pool = caching_owner.block_pool
    (block,) = pool.get_new_blocks(1)
    cache(pool, block, b"k")
    pool.free_blocks([block])
    assert caching_owner.stats()["num_cached_blocks"] == 1
    assert pool.reset_prefix_cache()
    assert not pool.weaver_cached
    assert caching_owner.page_table.page_ids("cold", 0).tolist() == [-1] * 4
    assert caching_owner.stats()["num_free_pages"] == 40


def test_an_engine_without_ids_for_the_whole_pool_is_refused():
    plan = make_plan(quota_blocks=3)
    pool = BlockPool(plan.max_blocks("cold"), enable_caching=False, hash_block_size=32)
    with pytest.raises(ValueError, match="KV budget of the whole pool"):
        open_pool_owner(plan, "cold", pool)


def test_the_locked_allocator_is_what_the_pool_uses(owner):
    assert isinstance(owner.allocator, LockedKVAllocator)
    assert owner.block_pool.weaver_allocator is owner.allocator


# --- a remote tenant (the hot engine's scheduler) leasing blocks over the connection ------
NUM_LOCAL = 5  # the hot engine's own blocks: its remote ids start here


@pytest.fixture
def remote():
    """The owner (quota: cold 3 blocks, hot the other 28 pages = 28 blocks of 1 page) and a
    hot-side block pool leasing 4 blocks at a time through a real socket connection."""
    plan = make_plan(quota_blocks=3, service=True)
    owner = open_pool_owner(plan, "cold", BlockPool(plan.max_blocks("cold") + 1,
                                              enable_caching=False, hash_block_size=32))
    conn = Client(plan.service_address, family="AF_UNIX",
                  authkey=bytes.fromhex(plan.authkey_hex))
    lease = LeasedTenantAllocator(KVAllocatorClient(conn), "hot", plan.max_blocks("hot"), 4)
    hot_pool = BlockPool(NUM_LOCAL + plan.max_blocks("hot"), enable_caching=False,
                         hash_block_size=32)
    hot_pool.get_new_blocks(NUM_LOCAL - 1)  # the local range, as WeaverScheduler pins it
    hot_pool = AllocatorBlockPool.adopt(hot_pool, lease, "hot", NUM_LOCAL)
    yield owner, lease, hot_pool
    lease.client.close()
    owner.close()


def test_a_remote_tenant_allocates_from_its_lease(remote):
    owner, lease, hot_pool = remote
    assert hot_pool.get_num_free_blocks() == 0  # nothing leased before the first step
    lease.sync()
    assert hot_pool.get_num_free_blocks() == 4
    blocks = hot_pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [NUM_LOCAL, NUM_LOCAL + 1, NUM_LOCAL + 2]
    # the owner published their pages before the lease answered
    for block in blocks:
        assert owner.page_table.page_ids("hot", block.block_id - NUM_LOCAL).min() >= 0
    hot_pool.free_blocks(blocks)
    assert hot_pool.get_num_free_blocks() == 4
    lease.sync()  # 4 spare blocks: nothing to take, nothing to give back
    assert lease.num_held_blocks == 4
    assert owner.stats()["tenants"][1]["num_blocks"] == 4


def test_a_shrink_takes_the_lease_back_first(remote):
    owner, lease, hot_pool = remote
    lease.sync()
    held = hot_pool.get_new_blocks(2)
    # The cold model needs memory: the hot tenant may keep only 1 block.
    owner.allocator.request_shrink("hot", 1)
    # 3 blocks are due: the 2 spares go back at once, 1 of the 2 in use is still owed
    assert lease.sync() == 1
    assert hot_pool.get_num_free_blocks() == 0 and lease.num_held_blocks == 2
    hot_pool.free_blocks(held[:1])
    assert lease.sync() == 0
    assert owner.allocator.num_blocks_to_release("hot") == 0


def test_the_owner_reclaims_what_its_next_step_needs(remote):
    owner, lease, hot_pool = remote
    lease.sync()  # the hot tenant holds 4 of its 28 blocks (28 pages of quota)
    hot_blocks = hot_pool.get_new_blocks(4)
    assert owner.ensure_owner_blocks(3) == 0  # the owner's own quota covers 3 blocks
    # 8 owner blocks = 32 pages: 20 more than its quota; the hot tenant's unused quota
    # (24 pages) pays without any shrink.
    assert owner.ensure_owner_blocks(8) == 5
    assert owner.allocator.num_allocatable_blocks("cold") == 8
    assert owner.allocator.num_blocks_to_release("hot") == 0
    # Everything: the hot tenant must give back all but what the pool still has free.
    owner.ensure_owner_blocks(owner.plan.max_blocks("cold"))
    assert owner.allocator.num_blocks_to_release("hot") == 4
    assert lease.sync() == 4  # no spares; the scheduler preempts to pay the rest
    hot_pool.free_blocks(hot_blocks)
    assert lease.sync() == 0
    assert owner.allocator.num_allocatable_blocks("cold") == owner.plan.max_blocks("cold")
    stats = owner.stats()
    assert stats["num_reclaims"] == 2 and stats["num_shrinks_completed"] == 1


def test_the_owner_rebalances_and_publishes_its_stats():
    plan = dataclasses.replace(make_plan(quota_blocks=3), rebalance_interval_s=0.05)
    owner = open_pool_owner(plan, "cold", BlockPool(plan.max_blocks("cold") + 1,
                                              enable_caching=False, hash_block_size=32))
    try:
        deadline = time.monotonic() + 10
        while not os.path.exists(plan.stats_path):
            assert time.monotonic() < deadline, "no stats published"
            time.sleep(0.05)
        with open(plan.stats_path) as stats_file:
            stats = json.load(stats_file)
        assert stats["pool"] == plan.pool_name and stats["num_pages"] == 40
        assert [t["name"] for t in stats["tenants"]] == ["cold", "hot"]
    finally:
        owner.close()
    assert not os.path.exists(plan.stats_path)


def make_group_plan(num_pages: int = 40) -> PoolPlan:
    """A colocated group's pool: two equal tenants, no owner, hosted by the gateway."""
    name = f"wtest{uuid.uuid4().hex[:8]}"
    half = num_pages // 2
    return PoolPlan(pool_name=f"{name}_pool", table_name=f"{name}_table", page_bytes=PAGE,
                    num_pages=num_pages,
                    tenants=(PoolTenantPlan("a", SHAPE, half, min_quota_pages=8),
                             PoolTenantPlan("b", SHAPE, half, min_quota_pages=8)),
                    service_address=f"\0{name}", authkey_hex=uuid.uuid4().hex,
                    rebalance_interval_s=0.0)


def leasing_block_pool(plan: PoolPlan, tenant: str) -> tuple[LeasedTenantAllocator, BlockPool]:
    """A colocated engine's block pool as WeaverScheduler makes it: every block leased."""
    lease = LeasedTenantAllocator(PoolClient(plan), tenant, plan.max_blocks(tenant), 2)
    lease.STARVED_SYNC_INTERVAL_S = 0.0  # the test drives every sync itself
    pool = BlockPool(plan.max_blocks(tenant) + 1, enable_caching=False, hash_block_size=32)
    return lease, AllocatorBlockPool.adopt(pool, lease, tenant, 1)


@pytest.fixture
def hosted():
    plan = make_group_plan()  # 40 pages of 4-page blocks: quota 5 blocks each
    host = HostedPool(plan)
    members = {name: leasing_block_pool(plan, name) for name in ("a", "b")}
    yield host, members
    for lease, _ in members.values():
        lease.client.close()
    host.close()


def test_a_hosted_pool_is_mapped_by_its_engines_and_removed_with_its_host():
    plan = make_group_plan()
    host = HostedPool(plan)
    assert os.path.exists(f"/dev/shm/{plan.pool_name}")
    assert os.path.getsize(f"/dev/shm/{plan.pool_name}") >= plan.pool_bytes
    host.close()
    assert not os.path.exists(f"/dev/shm/{plan.pool_name}")
    assert not os.path.exists(f"/dev/shm/{plan.table_name}")


def test_a_pool_with_an_owner_is_not_hosted():
    with pytest.raises(ValueError, match="owner tenant"):
        HostedPool(make_plan(quota_blocks=3, service=True))


def test_adbs_moves_an_idle_engines_quota_to_the_starved_one_but_not_below_its_floor(hosted):
    host, members = hosted
    (lease_a, pool_a), (lease_b, _) = members["a"], members["b"]
    lease_b.sync(0)  # b is idle: it holds nothing
    lease_a.sync(8)  # a wants 8 blocks; its quota covers 5
    assert lease_a.num_held_blocks == 5
    held = pool_a.get_new_blocks(5)
    assert lease_a.is_starved and pool_a.get_num_free_blocks() == 0
    host.rebalance()
    # b was idle: it gave half its unused quota (10 of 20 pages), a took it (2 blocks).
    quotas = {t.name: t.quota_pages for t in host.allocator.stats().tenants}
    assert quotas == {"a": 28, "b": 10}
    lease_a.sync(3)
    assert lease_a.num_held_blocks == 7
    for _ in range(5):
        lease_a.sync(3)
        host.rebalance()
    # b keeps its floor (min_quota_pages 8 = 2 blocks: one longest sequence) however long
    # it idles, so its next request is never starved outright.
    quotas = {t.name: t.quota_pages for t in host.allocator.stats().tenants}
    assert quotas["b"] == 8 and quotas["a"] == 32
    pool_a.free_blocks(held)


def test_a_dead_engines_blocks_return_to_the_pool_and_its_successor_leases_anew(hosted):
    host, members = hosted
    lease_a, pool_a = members["a"]
    lease_a.sync(4)
    pool_a.get_new_blocks(3)
    assert host.allocator.tenant_stats("a").num_blocks == 4
    lease_a.client.close()  # the engine's process is gone: its connection closes
    deadline = time.monotonic() + 10
    while host.allocator.tenant_stats("a").num_blocks:
        assert time.monotonic() < deadline, "the closed connection's blocks stayed held"
        time.sleep(0.02)
    successor, pool = leasing_block_pool(host.plan, "a")
    successor.sync(5)
    assert [b.block_id for b in pool.get_new_blocks(5)] == [1, 2, 3, 4, 5]
    successor.client.close()


# --- the pool's owner restarts under a hot engine (HotRouting.cold_restarted) -------------
class _Request:
    def __init__(self, request_id: str, blocks: list) -> None:
        self.request_id = request_id
        self.blocks = blocks


class StandInScheduler:
    """Stands in for the parts of vLLM's Scheduler that LeaseKeeper.preempt_leased touches
    (the running queue, the routing manager's placement and block ids, _preempt_request),
    over a real AllocatorBlockPool leasing from a real owner."""

    def __init__(self, hot_pool: BlockPool) -> None:
        self.hot_pool = hot_pool
        self.running: list[_Request] = []
        self.preempted: list[str] = []
        self.kv_cache_manager = self  # cold_of and get_block_ids, as RoutingKVCacheManager's
        self.cold_of: dict[str, int] = {}  # a remote request's cold, in plan order

    def get_block_ids(self, request_id: str) -> tuple[list[int]]:
        (request,) = [r for r in self.running if r.request_id == request_id]
        return ([b.block_id for b in request.blocks],)

    def _preempt_request(self, request: _Request, timestamp: float) -> None:
        self.hot_pool.free_blocks(request.blocks)
        self.preempted.append(request.request_id)


def _owner_until_killed(plan: PoolPlan, ready) -> None:
    """A forked child: the pool's owner, as a cold engine's scheduler holds it."""
    open_pool_owner(plan, "cold", BlockPool(plan.max_blocks("cold") + 1, enable_caching=False,
                                            hash_block_size=32))
    ready.send(True)
    while True:
        time.sleep(60)


def test_a_restarted_owner_gets_the_old_pools_requests_preempted_and_a_new_lease():
    """The owner's process is SIGKILLed (a cold engine dying) and a new owner starts under
    the same names; the hot side preempts what it held of the old pool and leases anew."""
    plan = make_plan(quota_blocks=3, service=True)
    context = multiprocessing.get_context("fork")
    ready_out, ready_in = context.Pipe(duplex=False)
    first = context.Process(target=_owner_until_killed, args=(plan, ready_in), daemon=True)
    first.start()
    assert ready_out.poll(30) and ready_out.recv()
    lease = LeasedTenantAllocator(PoolClient(plan), "hot", plan.max_blocks("hot"), 4)
    hot_pool = BlockPool(NUM_LOCAL + plan.max_blocks("hot"), enable_caching=False,
                         hash_block_size=32)
    hot_pool.get_new_blocks(NUM_LOCAL - 1)
    hot_pool = AllocatorBlockPool.adopt(hot_pool, lease, "hot", NUM_LOCAL)
    # The hot engine weaves into two colds; the pool is the second's (plan order 1), the
    # first keeps its remote blocks in a region.
    keeper = LeaseKeeper(lease, is_local=False, cold=1)
    scheduler = StandInScheduler(hot_pool)
    lease.sync(4)
    for request_id, placement, cold in (("a", Placement.REMOTE, 1), ("b", Placement.LOCAL, -1),
                                        ("c", Placement.REMOTE, 1), ("d", Placement.REMOTE, 0)):
        blocks = hot_pool.get_new_blocks(2) if cold == 1 else []
        scheduler.running.append(_Request(request_id, blocks))
        if placement is Placement.REMOTE:
            scheduler.cold_of[request_id] = cold
    keeper.num_reclaim_preemptions = 2  # told to the old owner
    os.kill(first.pid, signal.SIGKILL)
    first.join(10)
    os.unlink(f"/dev/shm/{plan.table_name}")  # what the gateway removes before a restart
    owner = open_pool_owner(plan, "cold", BlockPool(plan.max_blocks("cold") + 1,
                                                    enable_caching=False, hash_block_size=32))
    try:
        lease.sync(4)  # the dead owner's connection is broken: the lease stops
        assert lease.broken_reason is not None and lease.num_allocatable_blocks("hot") == 0
        lease.void("the unified pool's owner restarted")  # what cold_restarted does
        assert keeper.preempt_leased(scheduler) == (4, 2)
        # Newest first; the local one and the one on the other cold run on.
        assert scheduler.preempted == ["c", "a"]
        assert [r.request_id for r in scheduler.running] == ["b", "d"]
        assert lease.num_held_blocks == 0
        keeper.renew()
        lease.sync(3)  # a new connection, to the new owner
        assert lease.broken_reason is None
        assert [b.block_id for b in hot_pool.get_new_blocks(3)] == [
            NUM_LOCAL, NUM_LOCAL + 1, NUM_LOCAL + 2]
        assert owner.stats()["tenants"][1]["num_blocks"] == 3
        keeper._give_back(scheduler, 0)  # the new owner hears only of its own preemptions
        assert lease.report["reclaim_preemptions"] == 0
    finally:
        keeper.close()
        owner.close()



def test_an_owner_tearing_down_is_gone_to_its_leases_not_an_error():
    """A cold engine whose worker died shuts its scheduler down while the allocator's
    connections are still served: a lease's sync then met the torn-down page table
    (ValueError 'sync_lease: KeyError') and crashed the hot engine (seen in the soak). It
    now reads as the owner gone: the lease stops, the hot engine runs on."""
    plan = make_plan(quota_blocks=3, service=True)
    owner = open_pool_owner(plan, "cold", BlockPool(plan.max_blocks("cold") + 1,
                                                    enable_caching=False, hash_block_size=32))
    lease = LeasedTenantAllocator(PoolClient(plan), "hot", plan.max_blocks("hot"), 4)
    try:
        lease.sync(2)  # connected, served
        lease.allocate_blocks("hot", 1)
        owner.close()  # in this process its connection threads live on, as in a dying engine
        assert lease.sync(4) == 0
        assert lease.broken_reason == "ConnectionResetError: the pool's owner is closing"
    finally:
        lease.client.close()


def test_a_loan_pool_lease_counts_its_quota_room_for_placement():
    """Two hot tenants share a loan pool (no owner: the gateway hosts it). A hot engine's
    leased remote pool holds only the next step's spares, so placement weighs it against
    its other colds by those and the room its quota still grants, not by the spares."""
    name = f"wtest{uuid.uuid4().hex[:8]}"
    per_block = OTHER.pages_per_block(PAGE)
    plan = PoolPlan(pool_name=f"{name}_pool", table_name=f"{name}_table", page_bytes=PAGE,
                    num_pages=8 * per_block,
                    tenants=(PoolTenantPlan("hot", OTHER, 4 * per_block, first_block_id=0),
                             PoolTenantPlan("hot2", OTHER, 4 * per_block, first_block_id=0)),
                    rebalance_interval_s=0.0, service_address=f"\0{name}",
                    authkey_hex=uuid.uuid4().hex)
    hosted = HostedPool(plan)
    lease = LeasedTenantAllocator(PoolClient(plan), "hot", plan.max_blocks("hot"), 1)
    try:
        hot_pool = BlockPool(NUM_LOCAL + plan.max_blocks("hot"), enable_caching=False,
                             hash_block_size=32)
        hot_pool.get_new_blocks(NUM_LOCAL - 1)
        hot_pool = AllocatorBlockPool.adopt(hot_pool, lease, "hot", NUM_LOCAL)
        lease.sync(1)
        assert hot_pool.get_num_free_blocks() == 1  # what vLLM may take in this step
        assert lendable_blocks(hot_pool) == 4  # the spare and the quota's 3 more
        region = BlockPool(10, enable_caching=False, hash_block_size=32)
        assert lendable_blocks(region) == region.get_num_free_blocks() == 9
    finally:
        lease.client.close()
        hosted.close()
