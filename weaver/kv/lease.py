"""A remote tenant's blocks, leased from the pool's allocator a step at a time.

The allocator lives in the cold engine's scheduler process; a hot engine's scheduler is in
another process and allocates remote blocks many times per step (every admission, every
block a decode fills). A round trip for each would put the cold process on the hot
scheduler's critical path, and an allocation refused in the middle of vLLM's
``allocate_slots`` (after it checked the free count) cannot be undone. So the hot side
keeps a *lease*: a few blocks allocated ahead (pages and page-table rows included), from
which vLLM's block pool takes blocks locally; blocks vLLM frees go back to the lease.
Once per scheduler step, ``sync`` tops the lease up to its target, gives back what is
above it, and learns how many blocks a shrink of the tenant's quota asks for
(``to_release``): those are given back from the lease first; what the lease cannot cover
must be freed by the scheduler (by preempting remote requests).

The lease has the methods of ``LockedKVAllocator`` that
``weaver.vllm_ext.block_pool.AllocatorBlockPool`` calls. Pure Python.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Protocol

logger = logging.getLogger(__name__)


class _Caller(Protocol):
    def call(self, op: str, **kwargs: Any) -> Any: ...


@dataclass(frozen=True)
class LeasedBlock:
    block_id: int
    page_ids: tuple[int, ...]


class LeasedTenantAllocator:
    """A tenant's spare blocks on this side of the allocator's connection."""

    # While the owner has nothing to give, ask again at most this often: a starved engine's
    # scheduler loops without work, and each sync is a round trip into the owner's process.
    STARVED_SYNC_INTERVAL_S = 0.02

    def __init__(self, client: _Caller, tenant: str, max_blocks: int, lease_blocks: int):
        if lease_blocks < 1:
            raise ValueError(f"lease_blocks must be >= 1, got {lease_blocks}")
        self.client = client
        self.tenant = tenant
        self._max_blocks = max_blocks
        self.lease_blocks = lease_blocks
        self._spare: list[LeasedBlock] = []
        self._pages: dict[int, tuple[int, ...]] = {}  # every block this side holds
        self.num_to_release = 0  # blocks a shrink asks for beyond what the lease gave back
        self.num_syncs = 0
        # Set when the owner cannot be reached: no new blocks from then on; the blocks in
        # use stay readable where they are mapped (the requests holding them can finish).
        self.broken_reason: str | None = None
        self.report: dict[str, Any] = {}  # sent with every sync: the tenant's own counters
        self._starved_since: float | None = None  # last sync that got fewer blocks than asked
        self.num_skipped_syncs = 0
        # Blocks the owner would still grant beyond the spares, as of the last sync (the
        # tenant's quota room): with the spares, what this pool can lend a new sequence.
        self.num_room_blocks = 0

    # --- what AllocatorBlockPool calls ------------------------------------------------
    def max_blocks(self, tenant: str) -> int:
        self._check(tenant)
        return self._max_blocks

    def num_allocatable_blocks(self, tenant: str) -> int:
        self._check(tenant)
        return len(self._spare)

    def allocate_blocks(self, tenant: str, num_blocks: int) -> list[LeasedBlock] | None:
        self._check(tenant)
        if num_blocks > len(self._spare):
            return None
        # Lowest ids first, as the allocator itself would hand them out.
        self._spare.sort(key=lambda b: b.block_id, reverse=True)
        return [self._spare.pop() for _ in range(num_blocks)]

    def free_blocks(self, tenant: str, block_ids: list[int]) -> None:
        self._check(tenant)
        if self.broken_reason is not None:  # nobody to give them back to
            for block_id in block_ids:
                self._pages.pop(block_id, None)
            return
        for block_id in block_ids:
            if block_id not in self._pages:
                raise ValueError(f"block {block_id} of {tenant!r} is not held by this lease")
            self._spare.append(LeasedBlock(block_id, self._pages[block_id]))

    # --- once per scheduler step --------------------------------------------------------
    @property
    def is_starved(self) -> bool:
        """The owner had no blocks for the last sync and none are spare."""
        return self._starved_since is not None and not self._spare

    @property
    def num_held_blocks(self) -> int:
        return len(self._pages)

    def sync(self, target: int | None = None) -> int:
        """Top up / trim the spares to ``target`` blocks (default ``lease_blocks``; the
        scheduler passes what its next step may take, so that few pages idle here); returns
        the blocks the scheduler still has to free for a shrink (0 almost always). One round
        trip, two when a shrink is pending and the lease has spares to give back at once."""
        if self.broken_reason is not None:
            return 0
        target = self.lease_blocks if target is None else max(0, target)
        excess = len(self._spare) - target
        if (excess < 0 and not self.num_to_release and self._starved_since is not None
                and time.monotonic() - self._starved_since < self.STARVED_SYNC_INTERVAL_S):
            self.num_skipped_syncs += 1  # starved a moment ago: the answer would be the same
            return 0
        try:
            want = max(0, -excess)
            to_release, granted = self._round_trip(release=self._take_spares(excess), want=want)
            self._starved_since = time.monotonic() if granted < want else None
            if to_release and self._spare:
                to_release, _ = self._round_trip(release=self._take_spares(to_release), want=0)
        except (OSError, EOFError) as exc:  # the owner (the cold engine) is gone
            self.void(f"{type(exc).__name__}: {exc}")
            return 0
        self.num_to_release = to_release
        self.num_syncs += 1
        return to_release

    def void(self, reason: str) -> None:
        """Stop taking blocks from this owner: it died, or a restarted one replaced it
        (the blocks this side holds belong to the old pool, which the new owner does not
        know). The spares are dropped; the blocks in use are dropped as they are freed."""
        if self.broken_reason is not None:
            return
        self.broken_reason = reason
        for block in self._spare:
            self._pages.pop(block.block_id, None)
        self._spare.clear()
        self.num_room_blocks = 0
        logger.error("KV pool lease of %r broken (%s): no new remote blocks",
                     self.tenant, self.broken_reason)

    def renew(self, client: _Caller) -> None:
        """Lease from a new owner (the cold engine restarted and made the pool again):
        only once every block of the old pool is freed, since the new allocator hands out
        the same block ids."""
        if self._pages:
            raise ValueError(f"{len(self._pages)} block(s) of {self.tenant!r} from the old "
                             "pool are still in use: free them before renewing the lease")
        self.client = client
        self.broken_reason = None
        self.num_to_release = 0
        self._starved_since = None
        self.num_room_blocks = 0
        self.report = {}
        logger.info("KV pool lease of %r renewed with the pool's new owner", self.tenant)

    def _take_spares(self, num: int) -> list[LeasedBlock]:
        """Up to ``num`` spare blocks, highest ids first (the allocator hands out low ids)."""
        self._spare.sort(key=lambda b: b.block_id)
        return [self._spare.pop() for _ in range(min(max(num, 0), len(self._spare)))]

    def _round_trip(self, release: list[LeasedBlock], want: int) -> tuple[int, int]:
        """Returns (blocks a shrink still asks for, new blocks granted)."""
        answer = self.client.call("sync_lease", tenant=self.tenant,
                                  release=[b.block_id for b in release], want=want,
                                  report=self.report)
        for block in release:
            del self._pages[block.block_id]
        for block_id, pages in answer["blocks"]:
            block = LeasedBlock(block_id, tuple(pages))
            self._pages[block_id] = block.page_ids
            self._spare.append(block)
        self.num_room_blocks = answer.get("room", 0)
        return answer["to_release"], len(answer["blocks"])

    def _check(self, tenant: str) -> None:
        if tenant != self.tenant:
            raise ValueError(f"this lease is {self.tenant!r}'s, not {tenant!r}'s")
