"""Property test: random interleavings of allocate / free / rebalance / shrink / reclaim on a
pool shared by tenants of different shapes, checked against a plain model of live blocks."""

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from weaver.kv.allocator import UnifiedKVAllocator
from weaver.kv.pages import TenantShape, choose_page_bytes
from weaver.kv.records import BlockHandle, ShrinkTicket

SHAPES = {
    "cold": TenantShape(2, 2, 32, 32, 2),  # owner; 4096-byte head-blocks -> 4 pages/block
    "smol": TenantShape(30, 3, 64, 32, 2),  # SmolLM2-135M; 8192 bytes -> 180 pages/block
    "wide": TenantShape(4, 1, 128, 16, 4),  # fp32, block 16; 16384 bytes -> 16 pages/block
}
INITIAL_QUOTAS = {"cold": 300, "smol": 400, "wide": 200}  # 100 pages left unassigned
NUM_PAGES = 1000
TENANTS = st.sampled_from(sorted(SHAPES))


class AllocatorMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.allocator = UnifiedKVAllocator(NUM_PAGES, choose_page_bytes(SHAPES.values()))
        for name, shape in SHAPES.items():
            self.allocator.add_tenant(name, shape, INITIAL_QUOTAS[name], is_owner=name == "cold")
        self.live: dict[str, dict[int, BlockHandle]] = {name: {} for name in SHAPES}
        self.tickets: dict[str, ShrinkTicket] = {}

    def used(self, tenant: str) -> int:
        return len(self.live[tenant]) * self.allocator.pages_per_block(tenant)

    @rule(tenant=TENANTS, num_blocks=st.integers(1, 4))
    def allocate(self, tenant: str, num_blocks: int) -> None:
        expected = self.allocator.can_allocate(tenant, num_blocks)
        blocks = self.allocator.allocate_blocks(tenant, num_blocks)
        assert (blocks is not None) == expected
        event("allocation granted" if expected else "allocation refused")
        for block in blocks or []:
            assert block.block_id not in self.live[tenant]
            self.live[tenant][block.block_id] = block

    @precondition(lambda self: any(self.live.values()))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        tenant = data.draw(st.sampled_from([t for t, blocks in self.live.items() if blocks]))
        block_id = data.draw(st.sampled_from(sorted(self.live[tenant])))
        self.allocator.free_block(tenant, self.live[tenant].pop(block_id))
        with pytest.raises(ValueError, match="double free"):
            self.allocator.free_block(tenant, block_id)

    @rule()
    def rebalance(self) -> None:
        before = {t: self.allocator.quota_pages(t) for t in SHAPES}
        unassigned = self.allocator.num_unassigned_pages
        deltas = self.allocator.rebalance()
        assert sum(deltas.values()) <= unassigned
        for tenant, delta in deltas.items():
            assert self.allocator.quota_pages(tenant) == before[tenant] + delta
            if tenant in self.tickets:
                assert delta == 0  # a shrinking tenant is left alone
            else:
                assert self.allocator.quota_pages(tenant) >= self.used(tenant)

    @rule(tenant=TENANTS, fraction=st.floats(0.0, 0.95))
    def request_shrink(self, tenant: str, fraction: float) -> None:
        quota = self.allocator.quota_pages(tenant)
        new_quota = int(quota * fraction)
        if new_quota >= quota:
            return
        ticket = self.allocator.request_shrink(tenant, new_quota)
        ppb = self.allocator.pages_per_block(tenant)
        assert ticket.num_blocks_to_release == -(-max(0, self.used(tenant) - new_quota) // ppb)
        self.tickets[tenant] = ticket

    @precondition(lambda self: bool(self.tickets))
    @rule(data=st.data())
    def finish_shrink(self, data: st.DataObject) -> None:
        tenant = data.draw(st.sampled_from(sorted(self.tickets)))
        ticket = self.tickets.pop(tenant)
        to_release = self.allocator.num_blocks_to_release(tenant)
        event("shrink had live blocks to release" if to_release else "shrink needed no release")
        if to_release:
            with pytest.raises(ValueError, match="still holds"):
                self.allocator.complete_shrink(ticket)
        victims = data.draw(st.permutations(sorted(self.live[tenant])))[:to_release]
        self.allocator.free_blocks(tenant, list(victims))
        for block_id in victims:
            del self.live[tenant][block_id]
        self.allocator.complete_shrink(ticket)

    @rule(fraction=st.floats(0.0, 1.0))
    def reclaim_for_owner(self, fraction: float) -> None:
        owner_quota = self.allocator.quota_pages("cold")
        num_pages = int(fraction * (NUM_PAGES - owner_quota))
        tickets = self.allocator.reclaim_for_owner(num_pages)
        event("reclaim issued shrink tickets" if tickets else "reclaim needed no shrink")
        for ticket in tickets:
            self.tickets[ticket.tenant] = ticket
        assert self.allocator.quota_pages("cold") == owner_quota + num_pages

    @rule(tenant=TENANTS, fraction=st.floats(0.0, 1.0))
    def raise_quota(self, tenant: str, fraction: float) -> None:
        extra = int(fraction * self.allocator.num_unassigned_pages)
        self.allocator.set_quota(tenant, self.allocator.quota_pages(tenant) + extra)

    @invariant()
    def bookkeeping_is_consistent(self) -> None:
        self.allocator.check_invariants()

    @invariant()
    def live_blocks_are_never_moved_or_lost(self) -> None:
        for tenant, blocks in self.live.items():
            assert self.allocator.live_blocks(tenant) == sorted(
                blocks.values(), key=lambda b: b.block_id
            )

    @invariant()
    def no_page_owned_twice_and_pages_are_conserved(self) -> None:
        pages = [p for blocks in self.live.values() for b in blocks.values() for p in b.page_ids]
        assert len(pages) == len(set(pages))
        assert all(0 <= p < NUM_PAGES for p in pages)
        assert self.allocator.num_free_pages + len(pages) == NUM_PAGES

    @invariant()
    def quotas_hold_except_during_a_reported_shrink(self) -> None:
        assert self.allocator.num_unassigned_pages >= 0
        for tenant in SHAPES:
            stats = self.allocator.tenant_stats(tenant)
            assert stats.num_used_pages == self.used(tenant)
            if stats.num_used_pages > stats.quota_pages:
                assert stats.is_shrinking and tenant in self.tickets
                assert stats.num_pages_over_quota == stats.num_used_pages - stats.quota_pages

    @invariant()
    def quota_is_always_reachable_outside_a_shrink(self) -> None:
        """A tenant under quota can fill it when nobody is over quota; the owner can always
        take every free page within its quota."""
        owner = self.allocator.tenant_stats("cold")
        assert (
            self.allocator.num_allocatable_blocks("cold")
            == max(0, min(owner.quota_pages - owner.num_used_pages, self.allocator.num_free_pages))
            // owner.pages_per_block
        )
        if any(self.allocator.tenant_stats(t).num_pages_over_quota for t in SHAPES):
            return
        for tenant in SHAPES:
            stats = self.allocator.tenant_stats(tenant)
            headroom = stats.quota_pages - stats.num_used_pages
            assert (
                self.allocator.num_allocatable_blocks(tenant) == headroom // stats.pages_per_block
            )


AllocatorMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestAllocatorMachine = AllocatorMachine.TestCase
