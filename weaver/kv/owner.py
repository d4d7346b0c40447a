"""Who hosts a unified KV pool's allocator, and a leasing tenant's connection to it.

A weaving cold device's pool is owned by the cold engine's scheduler process
(``PoolOwner``): the allocator, the shared page table its workers map, the ADBS rebalancing
thread, and a local-socket service from which a hot engine's scheduler leases its remote
blocks (``PoolClient``, used by ``weaver.kv.lease``). A colocated group's pool is hosted by
the gateway (``HostedPool``), and every engine of the group leases. The owner engine's
own block pool (vLLM's, adopted by weaver/vllm_ext/block_pool.py) is handed in: this
module imports no vLLM.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from multiprocessing import shared_memory
from multiprocessing.connection import Client, Listener
from typing import Protocol

from weaver.kv.pool_plan import PoolPlan
from weaver.kv.service import (
    KVAllocatorClient,
    KVAllocatorService,
    LockedKVAllocator,
    serve_connection,
)
from weaver.kv.shared_table import SharedPageTable

logger = logging.getLogger(__name__)


class EvictableBlockPool(Protocol):
    """What the owner needs of the engine's block pool: its prefix-cached free blocks,
    which keep pages the pool may lend."""

    weaver_cached: dict[int, None]

    @property
    def num_evictable_pages(self) -> int: ...

    def evict_cached(self, num_blocks: int) -> int: ...


class PoolService:
    """The allocator of one unified pool, the shared page table its readers map, the
    listener that serves the tenants' leases (when the plan names an address) and the ADBS
    thread that re-balances quotas. Subclasses say who else
    allocates in this process: `PoolOwner` (a cold engine's own block pool) or
    `HostedPool` (nobody: the gateway hosts a colocated group's pool)."""

    def __init__(self, plan: PoolPlan) -> None:
        self.plan = plan
        allocator = plan.build_allocator()
        self.page_table = SharedPageTable.create(plan.table_name, allocator)
        self.allocator = LockedKVAllocator(allocator, self.page_table)
        # Held by whoever touches a local block pool while the ADBS thread may evict from it.
        self.lock = threading.RLock()
        self._listener: Listener | None = None
        self._stop = threading.Event()
        self._rebalancer: threading.Thread | None = None

    def _start_threads(self) -> None:
        if self.plan.service_address:
            self._listener = Listener(self.plan.service_address, family="AF_UNIX",
                                      authkey=bytes.fromhex(self.plan.authkey_hex))
            threading.Thread(target=self._accept, name="weaver-kv-pool-service",
                             daemon=True).start()
        if self.plan.rebalance_interval_s > 0:
            self._rebalancer = threading.Thread(target=self._rebalance_loop,
                                                name="weaver-kv-pool-adbs", daemon=True)
            self._rebalancer.start()

    def _accept(self) -> None:
        service = KVAllocatorService(self.allocator)
        listener = self._listener  # close() clears the attribute, then closes this one
        while True:
            try:
                conn = listener.accept()
            except (OSError, EOFError):  # closed, or a peer that failed authentication
                if self._listener is None:
                    return
                logger.warning("unified KV pool %s: a connection was refused or broken",
                               self.plan.pool_name)
                continue
            threading.Thread(target=serve_connection, args=(service, conn),
                             name="weaver-kv-pool-client", daemon=True).start()

    def _rebalance_loop(self) -> None:
        while not self._stop.wait(self.plan.rebalance_interval_s):
            try:
                self.rebalance()
                if not self._stop.is_set():
                    self._after_rebalance()
            except Exception:  # a bookkeeping bug must show, not stop the engine
                logger.exception("unified KV pool %s: rebalance failed", self.plan.pool_name)

    def rebalance(self) -> dict[str, int]:
        """One ADBS round (weaver.kv.adbs) over every tenant's held pages."""
        with self.lock:
            return self.allocator.rebalance()

    def _after_rebalance(self) -> None:
        """After each round of the ADBS thread: nothing here (the gateway that hosts a pool
        reads its allocator directly)."""

    def stats(self) -> dict:
        return {"pool": self.plan.pool_name,
                "tenant_reports": dict(self.allocator.tenant_reports),
                **asdict(self.allocator.stats())}

    def close(self) -> None:
        self._stop.set()
        if self._rebalancer is not None:
            self._rebalancer.join(timeout=5)
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()
        # Connections still served answer "closing" from here on: a hot engine's lease
        # takes that as the owner gone (seen: a dying cold engine's table, torn down under a
        # lease's sync, answered KeyError, and the hot engine crashed on it).
        self.allocator.closed = True
        self.page_table.close()


class PoolOwner(PoolService):
    """The pool of a weaving cold device, owned by the cold engine's scheduler process:
    the engine's block pool allocates through the allocator as the owner tenant, and the
    hot engines lease their remote blocks from the listener.

    adopt_block_pool: makes the engine's block pool allocate through the allocator (the
    vLLM side: weaver/vllm_ext/block_pool.py) and returns it."""

    def __init__(self, plan: PoolPlan, tenant: str,
                 adopt_block_pool: Callable[[LockedKVAllocator], EvictableBlockPool]) -> None:
        super().__init__(plan)
        self.tenant = tenant
        self.num_cache_evictions = 0  # cached blocks dropped to lend their pages
        self.num_reclaims = 0  # times the owner took quota back for its own requests
        self.num_reclaimed_blocks = 0
        try:
            self.block_pool = adopt_block_pool(self.allocator)
            self._start_threads()
        except Exception:
            self.close()
            raise
        logger.info(
            "unified KV pool %s: %d pages of %d bytes; tenant %s allocates through it "
            "(quota %d pages = %d blocks)", plan.pool_name, plan.num_pages, plan.page_bytes,
            tenant, plan.tenant(tenant).quota_pages,
            plan.tenant(tenant).quota_pages // self.allocator.pages_per_block(tenant))

    def ensure_owner_blocks(self, num_blocks: int) -> int:
        """Make room for ``num_blocks`` more blocks of the owner (the cold model's next step):
        when its quota is short, take quota back from the other tenants
        (``reclaim_for_owner``: unassigned pages, their unused quota, then shrinks that their
        schedulers pay by preempting remote requests). Returns the blocks reclaimed."""
        new_blocks = self.allocator.num_allocatable_blocks(self.tenant)
        # Cached free blocks keep their pages (inside the quota) and are reused first.
        deficit = num_blocks - new_blocks - len(self.block_pool.weaver_cached)
        if deficit <= 0:
            return 0
        owner = self.allocator.tenant_stats(self.tenant)
        pages_per_block = owner.pages_per_block
        # Quota the owner already has but cannot use yet: pages other tenants still hold
        # over their (shrunk) quota; they come back as those tenants release blocks.
        waiting = max(0, owner.quota_pages - owner.num_used_pages - new_blocks * pages_per_block)
        missing = deficit * pages_per_block - waiting
        available = self.allocator.num_pages - owner.quota_pages
        pages = min(max(0, missing), available)
        if pages <= 0:
            return 0
        tickets = self.allocator.reclaim_for_owner(pages)
        self.num_reclaims += 1
        self.num_reclaimed_blocks += pages // pages_per_block
        logger.info("unified KV pool %s: %s reclaims %d pages (%d shrink tickets)",
                    self.plan.pool_name, self.tenant, pages, len(tickets))
        return pages // pages_per_block

    def rebalance(self) -> dict[str, int]:
        """One ADBS round. The owner's prefix-cached free blocks count as unused (an idle
        cold model lends its memory even with a warm cache); those its new quota no longer
        covers are evicted before the lock is let go."""
        with self.lock:
            deltas = self.allocator.rebalance(
                {self.tenant: self.block_pool.num_evictable_pages})
            owner = self.allocator.tenant_stats(self.tenant)
            if owner.num_pages_over_quota:
                self.num_cache_evictions += self.block_pool.evict_cached(
                    -(-owner.num_pages_over_quota // owner.pages_per_block))
        return deltas

    def _after_rebalance(self) -> None:
        """Publish the stats for the gateway, in another process (weaver/server/weaving.py)."""
        path = self.plan.stats_path
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as out:
            json.dump(self.stats(), out)
        os.replace(tmp, path)

    def close(self) -> None:
        super().close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.plan.stats_path)

    def stats(self) -> dict:
        return {**super().stats(), "owner": self.tenant,
                "num_reclaims": self.num_reclaims,
                "num_reclaimed_blocks": self.num_reclaimed_blocks,
                "num_cache_evictions": self.num_cache_evictions,
                "num_cached_blocks": len(self.block_pool.weaver_cached)}


class HostedPool(PoolService):
    """A colocated group's pool, hosted by the gateway process: it creates the pool's bytes
    (the engines' workers map them) before any engine starts, and every engine of the group
    leases its blocks (weaver.kv.lease), so an engine that dies and restarts finds the pool
    as it was, less the blocks its dead process held (freed when its connection closed).
    A cold model's loan pool (weaver/weaving/plan.py plan_loan_pools) is hosted the same
    way; `kind` names which the pool is in the log."""

    def __init__(self, plan: PoolPlan, kind: str = "unified KV pool") -> None:
        if plan.owner is not None:
            raise ValueError(f"pool {plan.pool_name!r} has an owner tenant "
                             f"({plan.owner.name!r}), whose engine hosts it; a hosted pool "
                             "has none")
        if not plan.service_address:
            raise ValueError(f"hosted pool {plan.pool_name!r} needs a service_address: its "
                             "tenants lease every block")
        super().__init__(plan)
        self._bytes: shared_memory.SharedMemory | None = None
        try:
            self._bytes = shared_memory.SharedMemory(name=plan.pool_name, create=True,
                                                     size=plan.pool_bytes)
            self._start_threads()
        except Exception:
            self.close()
            raise
        logger.info("%s %s hosted: %d pages of %d bytes for %s", kind, plan.pool_name,
                    plan.num_pages, plan.page_bytes, [t.name for t in plan.tenants])

    def close(self) -> None:
        super().close()
        pool_bytes, self._bytes = self._bytes, None
        if pool_bytes is not None:
            pool_bytes.close()
            with contextlib.suppress(FileNotFoundError):
                pool_bytes.unlink()


class PoolClient:
    """A remote tenant's connection to the owner's allocator service, opened at the first
    call (the owner, the cold engine, may start after the hot engine's scheduler exists;
    the first call comes with the first request, when every engine is up)."""

    CONNECT_TIMEOUT_S = 30.0

    def __init__(self, plan: PoolPlan) -> None:
        self.plan = plan
        self._client: KVAllocatorClient | None = None

    def call(self, op: str, **kwargs):
        if self._client is None:
            self._client = KVAllocatorClient(self._connect())
        return self._client.call(op, **kwargs)

    def _connect(self):
        deadline = time.monotonic() + self.CONNECT_TIMEOUT_S
        while True:
            try:
                return Client(self.plan.service_address, family="AF_UNIX",
                              authkey=bytes.fromhex(self.plan.authkey_hex))
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def close(self) -> None:
        # Forgotten first: a connection to an owner that died raises on close, and the next
        # call must open a new one (a restarted owner's).
        client, self._client = self._client, None
        if client is not None:
            client.close()
