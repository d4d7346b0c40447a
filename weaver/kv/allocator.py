"""The unified KV-block allocator of the cold device's pool (Weaver §4.3, MuxServe §4.2.4).

One pool of ``num_pages`` pages of ``page_bytes`` bytes is shared by *tenants*: the cold
model's own KV cache and the remote sequences of each hot model placed on this device.
A tenant allocates logical blocks; each block is backed by ``pages_per_block`` pages, one
run of pages per (layer, KV head) as ``weaver.kv.pages`` explains, and gets a dense
per-tenant block id (lowest free id first) so a vLLM-style consumer can index a table.

Quotas. Every tenant has a quota in pages, the sum of quotas never exceeds the pool, and a
tenant allocates only within its quota. Hence, outside a shrink, a tenant under quota can
always allocate up to its quota. ``rebalance`` moves quota by the ADBS rule of
``weaver.kv.adbs``; it never takes quota a tenant is using.

Shrinking never invalidates a live block. ``request_shrink`` lowers the quota at once and
returns a ``ShrinkTicket`` saying how many blocks the tenant's owner must free or migrate;
until ``complete_shrink`` accepts it the tenant may hold more than its quota (reported in
``stats``) and cannot allocate. The *owner* tenant (the cold model) has priority: while it
has unused quota, other tenants may not allocate the free pages it would need, so pages
released by shrinking tenants go to the owner first; ``reclaim_for_owner`` takes quota back
from the other tenants (unassigned pages first, then unused quota, then shrink tickets).

This class is not thread-safe and lives in one process; see ``weaver.kv.service`` for the
lock and the cross-process request/response API.
"""

from __future__ import annotations

import logging
from dataclasses import asdict
from typing import Any

from weaver.kv.adbs import AdbsPolicy, TenantLoad, plan_rebalance
from weaver.kv.pages import TenantShape, check_page_bytes
from weaver.kv.records import AllocatorStats, BlockHandle, ShrinkTicket, TenantStats
from weaver.kv.tenant import TenantState

logger = logging.getLogger(__name__)

SNAPSHOT_VERSION = 1


class UnifiedKVAllocator:
    """Page bookkeeping of one cold device's KV pool shared by several models."""

    def __init__(self, num_pages: int, page_bytes: int, policy: AdbsPolicy | None = None):
        if not isinstance(num_pages, int) or isinstance(num_pages, bool) or num_pages < 1:
            raise ValueError(
                f"num_pages must be a positive integer, got {num_pages!r}; "
                "divide the region's bytes by page_bytes"
            )
        check_page_bytes(page_bytes)
        self.num_pages = num_pages
        self.page_bytes = page_bytes
        self.policy = policy or AdbsPolicy()
        self._tenants: dict[str, TenantState] = {}
        # A stack with the lowest page id on top, so a fresh pool fills from page 0.
        self._free_pages: list[int] = list(range(num_pages - 1, -1, -1))
        self._next_ticket_id = 0
        self.num_rebalances = 0
        self.num_quota_pages_moved = 0
        self.num_shrinks_requested = 0
        self.num_shrinks_completed = 0
        self.num_reclaimed_pages = 0

    # ----------------------------------------------------------------- tenants and quotas
    def add_tenant(
        self,
        name: str,
        shape: TenantShape,
        quota_pages: int,
        *,
        is_owner: bool = False,
        min_quota_pages: int = 0,
    ) -> None:
        if not name or not isinstance(name, str):
            raise ValueError(f"tenant name must be a non-empty string, got {name!r}")
        if name in self._tenants:
            raise ValueError(f"tenant {name!r} already exists; pick another name")
        if is_owner and self._owner() is not None:
            raise ValueError(
                f"tenant {self._owner().name!r} is already the owner; a pool has one owner "
                "(the cold model)"
            )
        pages_per_block = shape.pages_per_block(self.page_bytes)  # also validates the shape
        if pages_per_block > self.num_pages:
            raise ValueError(
                f"one block of {name!r} needs {pages_per_block} pages but the pool has "
                f"{self.num_pages}; enlarge the pool or reduce block_size"
            )
        self._check_quota_value(name, quota_pages)
        if min_quota_pages < 0:
            raise ValueError(f"min_quota_pages must be >= 0, got {min_quota_pages}")
        self._check_fits(quota_pages)
        self._tenants[name] = TenantState(
            name, shape, self.page_bytes, quota_pages, min_quota_pages, is_owner
        )
        logger.info(
            "KV pool tenant %s: %d pages/block (%d bytes wasted/block), quota %d pages",
            name,
            pages_per_block,
            shape.num_wasted_bytes_per_block(self.page_bytes),
            quota_pages,
        )

    @property
    def tenant_names(self) -> list[str]:
        return list(self._tenants)

    def shape(self, tenant: str) -> TenantShape:
        return self._tenant(tenant).shape

    def pages_per_block(self, tenant: str) -> int:
        return self._tenant(tenant).pages_per_block

    def max_blocks(self, tenant: str) -> int:
        """An upper bound on the blocks the tenant can ever hold: its block ids stay below it."""
        return self.num_pages // self._tenant(tenant).pages_per_block

    def quota_pages(self, tenant: str) -> int:
        return self._tenant(tenant).quota_pages

    def set_quota(self, tenant: str, quota_pages: int) -> None:
        """Raise a quota, or lower it to no less than what the tenant uses. Raising the quota
        of a shrinking tenant is allowed and shortens what its ticket asks for."""
        state = self._tenant(tenant)
        self._check_quota_value(tenant, quota_pages)
        if quota_pages < min(state.quota_pages, state.num_used_pages):
            raise ValueError(
                f"tenant {tenant!r} uses {state.num_used_pages} pages, more than the new quota "
                f"{quota_pages}; call request_shrink to have blocks released first"
            )
        self._check_fits(quota_pages - state.quota_pages)
        state.quota_pages = quota_pages

    @property
    def num_free_pages(self) -> int:
        return len(self._free_pages)

    @property
    def num_unassigned_pages(self) -> int:
        """Pages no tenant has quota for."""
        return self.num_pages - sum(t.quota_pages for t in self._tenants.values())

    # -------------------------------------------------------------------- blocks
    def num_allocatable_blocks(self, tenant: str) -> int:
        state = self._tenant(tenant)
        pages = min(state.quota_pages - state.num_used_pages, self._num_free_pages_for(state))
        return max(0, pages // state.pages_per_block)

    def can_allocate(self, tenant: str, num_blocks: int = 1) -> bool:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        return num_blocks <= self.num_allocatable_blocks(tenant)

    def allocate_block(self, tenant: str) -> BlockHandle | None:
        """A new block for the tenant, or None when its quota or the pool is exhausted."""
        blocks = self.allocate_blocks(tenant, 1)
        return blocks[0] if blocks else None

    def allocate_blocks(self, tenant: str, num_blocks: int) -> list[BlockHandle] | None:
        """``num_blocks`` new blocks, all or none (None records a failed allocation, which
        marks the tenant as starved for the next rebalance)."""
        state = self._tenant(tenant)
        if not self.can_allocate(tenant, num_blocks):
            state.is_starved = True
            state.num_failed_allocations += 1
            return None
        return [
            state.add_block(tuple(self._free_pages.pop() for _ in range(state.pages_per_block)))
            for _ in range(num_blocks)
        ]

    def free_block(self, tenant: str, block: BlockHandle | int) -> None:
        state = self._tenant(tenant)
        block_id = block.block_id if isinstance(block, BlockHandle) else block
        live = state.blocks.get(block_id)
        if live is None or (isinstance(block, BlockHandle) and block != live):
            raise ValueError(
                f"block {block_id} is not a live block of tenant {tenant!r} "
                "(double free, or a handle from another tenant)"
            )
        state.remove_block(block_id)
        # Push in reverse so the next allocation reuses the same pages in the same order.
        self._free_pages.extend(reversed(live.page_ids))

    def free_blocks(self, tenant: str, block_ids: list[int]) -> None:
        """Free several blocks, all or none: every id is checked before any is freed."""
        state = self._tenant(tenant)
        unknown = [b for b in block_ids if b not in state.blocks]
        if unknown or len(set(block_ids)) != len(block_ids):
            raise ValueError(
                f"cannot free blocks {list(block_ids)} of tenant {tenant!r}: ids {unknown} are "
                "not live or an id is repeated; nothing was freed"
            )
        for block_id in block_ids:
            self.free_block(tenant, block_id)

    def get_block(self, tenant: str, block_id: int) -> BlockHandle:
        block = self._tenant(tenant).blocks.get(block_id)
        if block is None:
            raise ValueError(f"block {block_id} is not a live block of tenant {tenant!r}")
        return block

    def live_blocks(self, tenant: str) -> list[BlockHandle]:
        return sorted(self._tenant(tenant).blocks.values(), key=lambda b: b.block_id)

    # ------------------------------------------------------------------- shrinking
    def request_shrink(self, tenant: str, new_quota_pages: int) -> ShrinkTicket:
        """Lower the quota now; live blocks stay valid until the caller releases them.

        The ticket says how many blocks must be freed or migrated; hand it back to
        ``complete_shrink`` once they are. A newer request for the same tenant replaces an
        open ticket."""
        state = self._tenant(tenant)
        self._check_quota_value(tenant, new_quota_pages)
        if new_quota_pages >= state.quota_pages:
            raise ValueError(
                f"request_shrink needs a quota below the current {state.quota_pages} pages of "
                f"{tenant!r}, got {new_quota_pages}; use set_quota to raise a quota"
            )
        excess = max(0, state.num_used_pages - new_quota_pages)
        ticket = ShrinkTicket(
            ticket_id=self._next_ticket_id,
            tenant=tenant,
            old_quota_pages=state.quota_pages,
            new_quota_pages=new_quota_pages,
            num_blocks_to_release=-(-excess // state.pages_per_block),
        )
        self._next_ticket_id += 1
        self.num_shrinks_requested += 1
        state.quota_pages = new_quota_pages
        state.shrink = ticket
        if excess:
            logger.info(
                "shrink %d of tenant %s: quota %d -> %d pages, %d blocks to release",
                ticket.ticket_id,
                tenant,
                ticket.old_quota_pages,
                new_quota_pages,
                ticket.num_blocks_to_release,
            )
        return ticket

    def num_blocks_to_release(self, tenant: str) -> int:
        """Blocks the tenant still holds above its quota (0 when not shrinking)."""
        state = self._tenant(tenant)
        return -(-state.num_pages_over_quota // state.pages_per_block)

    def is_shrinking(self, tenant: str) -> bool:
        return self._tenant(tenant).shrink is not None

    def open_shrink(self, tenant: str) -> ShrinkTicket | None:
        """The tenant's open shrink ticket, if any."""
        return self._tenant(tenant).shrink

    def complete_shrink(self, ticket: ShrinkTicket) -> None:
        state = self._tenant(ticket.tenant)
        if state.shrink != ticket:
            raise ValueError(
                f"shrink ticket {ticket.ticket_id} of {ticket.tenant!r} is not open "
                "(already completed, or replaced by a newer request_shrink)"
            )
        remaining = self.num_blocks_to_release(ticket.tenant)
        if remaining:
            raise ValueError(
                f"tenant {ticket.tenant!r} still holds {remaining} block(s) above its quota of "
                f"{state.quota_pages} pages; free or migrate them, then complete the shrink"
            )
        state.shrink = None
        self.num_shrinks_completed += 1
        self.num_reclaimed_pages += ticket.old_quota_pages - ticket.new_quota_pages

    def reclaim_for_owner(self, num_pages: int) -> list[ShrinkTicket]:
        """Give the owner ``num_pages`` more quota, taken from the others.

        Order: unassigned pages, then unused quota of other tenants (most unused first), then
        shrinks of other tenants (largest holders first). Returns the shrink tickets whose
        blocks must be released; until they are, the owner has first claim on freed pages.
        """
        owner = self._owner()
        if owner is None:
            raise ValueError("reclaim_for_owner needs a tenant added with is_owner=True")
        available = self.num_pages - owner.quota_pages
        if not 0 <= num_pages <= available:
            raise ValueError(
                f"the owner can reclaim 0..{available} pages (the pool minus its quota), "
                f"got {num_pages}"
            )
        needed = num_pages - min(num_pages, self.num_unassigned_pages)
        others = [t for t in self._tenants.values() if not t.is_owner]
        for state in sorted(others, key=lambda t: t.num_used_pages - t.quota_pages):
            take = min(needed, max(0, state.quota_pages - state.num_used_pages))
            state.quota_pages -= take
            needed -= take
        tickets = []
        for state in sorted(others, key=lambda t: -t.num_used_pages):
            take = min(needed, state.quota_pages)
            if take:
                tickets.append(self.request_shrink(state.name, state.quota_pages - take))
                needed -= take
        assert needed == 0, "quotas of non-owners must cover what is not unassigned"
        owner.quota_pages += num_pages
        return tickets

    # ------------------------------------------------------------------ rebalancing
    def rebalance(self, evictable_pages: dict[str, int] | None = None) -> dict[str, int]:
        """Move quota by the ADBS rule (``weaver.kv.adbs``); returns the change per tenant.

        ``evictable_pages``: pages a tenant holds only as a cache it can drop at once (the
        cold engine's prefix-cached blocks that no request uses). ADBS counts them as
        unused, so an idle cold model with a warm cache still lends its memory; a tenant
        left above its new quota must evict that many pages before anyone else needs them
        (``PoolOwner`` does it in the same critical section)."""
        evictable = evictable_pages or {}
        for name, pages in evictable.items():
            state = self._tenant(name)
            if not 0 <= pages <= state.num_used_pages:
                raise ValueError(
                    f"tenant {name!r} cannot have {pages} evictable pages: it holds "
                    f"{state.num_used_pages}"
                )
        loads = [
            TenantLoad(
                name=t.name,
                quota_pages=t.quota_pages,
                num_used_pages=t.num_used_pages - evictable.get(t.name, 0),
                pages_per_block=t.pages_per_block,
                min_quota_pages=t.min_quota_pages,
                is_starved=t.is_starved,
                is_shrinking=t.shrink is not None,
            )
            for t in self._tenants.values()
        ]
        new_quotas = plan_rebalance(loads, self.num_unassigned_pages, self.policy)
        deltas = {}
        for state in self._tenants.values():
            deltas[state.name] = new_quotas[state.name] - state.quota_pages
            assert (new_quotas[state.name] >= state.num_used_pages - evictable.get(state.name, 0)
                    or state.shrink is not None)
            state.quota_pages = new_quotas[state.name]
            state.is_starved = False
        moved = sum(d for d in deltas.values() if d > 0)
        if moved:
            self.num_rebalances += 1
            self.num_quota_pages_moved += moved
            logger.debug("ADBS rebalance moved %d pages: %s", moved, deltas)
        return deltas

    # --------------------------------------------------------------------- metrics
    def tenant_stats(self, tenant: str) -> TenantStats:
        return self._tenant(tenant).stats()

    def stats(self) -> AllocatorStats:
        return AllocatorStats(
            num_pages=self.num_pages,
            page_bytes=self.page_bytes,
            num_free_pages=self.num_free_pages,
            num_unassigned_pages=self.num_unassigned_pages,
            num_rebalances=self.num_rebalances,
            num_quota_pages_moved=self.num_quota_pages_moved,
            num_shrinks_requested=self.num_shrinks_requested,
            num_shrinks_completed=self.num_shrinks_completed,
            num_reclaimed_pages=self.num_reclaimed_pages,
            tenants=tuple(self.tenant_stats(name) for name in self._tenants),
        )

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (for tests and debugging)."""
        owner_of: dict[int, str] = {}
        for state in self._tenants.values():
            for block_id, block in state.blocks.items():
                if block.block_id != block_id or len(block.page_ids) != state.pages_per_block:
                    raise AssertionError(f"malformed block {block_id} of {state.name}")
                for page in block.page_ids:
                    if page in owner_of:
                        raise AssertionError(
                            f"page {page} owned by {owner_of[page]} and {state.name}"
                        )
                    owner_of[page] = state.name
            if state.shrink is None and state.num_pages_over_quota:
                raise AssertionError(f"{state.name} is over quota without a shrink ticket")
            if set(state.free_block_ids) & set(state.blocks):
                raise AssertionError(f"{state.name} has a live block id on its free list")
        free = set(self._free_pages)
        if len(free) != len(self._free_pages) or free & set(owner_of):
            raise AssertionError("a page is free twice, or both free and owned")
        if len(free) + len(owner_of) != self.num_pages or not free <= set(range(self.num_pages)):
            raise AssertionError("pages leaked: free + used != total")
        if self.num_unassigned_pages < 0:
            raise AssertionError("quotas exceed the pool")

    # ----------------------------------------------------------- snapshot / restore
    def snapshot(self) -> dict[str, Any]:
        """A JSON-serialisable copy of the whole state (for another process or a restart)."""
        return {
            "version": SNAPSHOT_VERSION,
            "num_pages": self.num_pages,
            "page_bytes": self.page_bytes,
            "policy": asdict(self.policy),
            "free_pages": list(self._free_pages),
            "next_ticket_id": self._next_ticket_id,
            "counters": {
                "num_rebalances": self.num_rebalances,
                "num_quota_pages_moved": self.num_quota_pages_moved,
                "num_shrinks_requested": self.num_shrinks_requested,
                "num_shrinks_completed": self.num_shrinks_completed,
                "num_reclaimed_pages": self.num_reclaimed_pages,
            },
            "tenants": [t.to_snapshot() for t in self._tenants.values()],
        }

    @classmethod
    def from_snapshot(cls, data: dict[str, Any]) -> UnifiedKVAllocator:
        if data.get("version") != SNAPSHOT_VERSION:
            raise ValueError(
                f"snapshot version {data.get('version')!r} is not {SNAPSHOT_VERSION}; "
                "take the snapshot with the same Weaver version"
            )
        allocator = cls(data["num_pages"], data["page_bytes"], AdbsPolicy(**data["policy"]))
        for entry in data["tenants"]:
            state = TenantState.from_snapshot(entry, allocator.page_bytes)
            allocator._tenants[state.name] = state
        allocator._free_pages = list(data["free_pages"])
        allocator._next_ticket_id = data["next_ticket_id"]
        for name, value in data["counters"].items():
            setattr(allocator, name, value)
        allocator.check_invariants()
        return allocator

    # ------------------------------------------------------------------- internals
    def _tenant(self, name: str) -> TenantState:
        state = self._tenants.get(name)
        if state is None:
            raise ValueError(f"unknown tenant {name!r}; known: {sorted(self._tenants)}")
        return state

    def _owner(self) -> TenantState | None:
        return next((t for t in self._tenants.values() if t.is_owner), None)

    def _num_free_pages_for(self, state: TenantState) -> int:
        """Free pages the tenant may take: the owner's unused quota is kept for the owner,
        which matters only while a shrinking tenant still holds pages above its quota."""
        owner = self._owner()
        if owner is None or owner is state:
            return self.num_free_pages
        return self.num_free_pages - max(0, owner.quota_pages - owner.num_used_pages)

    def _check_quota_value(self, tenant: str, quota_pages: int) -> None:
        if not isinstance(quota_pages, int) or isinstance(quota_pages, bool) or quota_pages < 0:
            raise ValueError(
                f"quota of {tenant!r} must be a non-negative number of pages, got {quota_pages!r}"
            )

    def _check_fits(self, num_extra_pages: int) -> None:
        if num_extra_pages > self.num_unassigned_pages:
            raise ValueError(
                f"{num_extra_pages} more pages of quota do not fit: only "
                f"{self.num_unassigned_pages} of {self.num_pages} pages are unassigned; lower "
                "another tenant's quota first (set_quota, request_shrink or reclaim_for_owner)"
            )
