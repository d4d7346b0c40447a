"""Sharing one allocator between threads and processes.

Cross-process plan. The pool lives on the cold device, so the allocator lives in the cold
engine's scheduler process (its `PoolOwner`, opened by WeaverScheduler; a colocated
group's pool is hosted by the gateway instead: weaver/kv/owner.py) and is the only writer
of the bookkeeping. The cold scheduler and every hot scheduler are clients:

- in the owning process, every caller goes through ``LockedKVAllocator`` (one
  ``threading.Lock`` around each call, so the cold scheduler and the threads that serve
  remote clients never interleave inside a mutation);
- other processes send small JSON-able requests (``{"op": "allocate_blocks", "tenant": ...,
  "num_blocks": ...}``) over a ``multiprocessing.connection`` (a ``Pipe``, or a
  ``Listener``/``Client`` pair whose address and authkey come from the deployment config,
  never hard-coded) and get a JSON-able response; ``serve_connection`` answers one
  connection, ``KVAllocatorClient`` is the hot scheduler's side. Blocks move in batches
  (``allocate_blocks``/``free_blocks``) so a scheduler step costs one round trip, and the
  request path of the attention kernels never talks to the allocator: tasks carry block
  ids, and the workers on either side translate them to pages through the
  ``SharedPageTable`` (``weaver.kv.shared_table``) that ``LockedKVAllocator`` keeps in step;
- a restart or a new client can start from ``UnifiedKVAllocator.snapshot()``, which is
  plain JSON and is checked on restore.

Failures are answers, not exceptions across the boundary: a refused allocation returns
``blocks: None`` and a bad request returns ``ok: False`` with the ValueError's message,
which the client raises again as ValueError.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import asdict
from multiprocessing.connection import Connection
from typing import Any

from weaver.kv.allocator import UnifiedKVAllocator
from weaver.kv.pages import TenantShape
from weaver.kv.records import AllocatorStats, BlockHandle, ShrinkTicket, TenantStats
from weaver.kv.shared_table import SharedPageTable

logger = logging.getLogger(__name__)


class LockedKVAllocator:
    """The allocator's public API with every call under one lock.

    Add every tenant to the allocator before wrapping it: tenants are fixed from then on.

    With a ``SharedPageTable``, every allocated block's row is published before the call
    returns (so before its id can reach another process) and cleared when it is freed."""

    def __init__(self, allocator: UnifiedKVAllocator, page_table: SharedPageTable | None = None):
        self._allocator = allocator
        self._page_table = page_table
        self._lock = threading.Lock()
        # Set by the owner as it tears down (weaver/kv/owner.py PoolService.close): a call
        # that fails from then on failed because the owner is going, not by its caller.
        self.closed = False
        # What remote tenants report about themselves with each lease sync (counters their
        # schedulers keep, e.g. requests preempted to give memory back), for the metrics.
        self.tenant_reports: dict[str, dict[str, Any]] = {}
        self.page_bytes = allocator.page_bytes
        self.num_pages = allocator.num_pages

    # Shapes and limits never change after add_tenant, so these need no lock.
    def shape(self, tenant: str) -> TenantShape:
        return self._allocator.shape(tenant)

    def max_blocks(self, tenant: str) -> int:
        return self._allocator.max_blocks(tenant)

    def pages_per_block(self, tenant: str) -> int:
        return self._allocator.pages_per_block(tenant)

    def get_block(self, tenant: str, block_id: int) -> BlockHandle:
        with self._lock:
            return self._allocator.get_block(tenant, block_id)

    def allocate_blocks(self, tenant: str, num_blocks: int) -> list[BlockHandle] | None:
        with self._lock:
            blocks = self._allocator.allocate_blocks(tenant, num_blocks)
            if self._page_table is not None:
                for block in blocks or []:
                    self._page_table.publish(block)
            return blocks

    def allocate_block(self, tenant: str) -> BlockHandle | None:
        blocks = self.allocate_blocks(tenant, 1)
        return blocks[0] if blocks else None

    def free_blocks(self, tenant: str, block_ids: list[int]) -> None:
        with self._lock:
            self._allocator.free_blocks(tenant, block_ids)
            if self._page_table is not None:
                for block_id in block_ids:
                    self._page_table.retract(tenant, block_id)

    def free_block(self, tenant: str, block: BlockHandle | int) -> None:
        with self._lock:
            self._allocator.free_block(tenant, block)
            if self._page_table is not None:
                block_id = block.block_id if isinstance(block, BlockHandle) else block
                self._page_table.retract(tenant, block_id)

    def can_allocate(self, tenant: str, num_blocks: int = 1) -> bool:
        with self._lock:
            return self._allocator.can_allocate(tenant, num_blocks)

    def num_allocatable_blocks(self, tenant: str) -> int:
        with self._lock:
            return self._allocator.num_allocatable_blocks(tenant)

    def set_quota(self, tenant: str, quota_pages: int) -> None:
        with self._lock:
            self._allocator.set_quota(tenant, quota_pages)

    def request_shrink(self, tenant: str, new_quota_pages: int) -> ShrinkTicket:
        with self._lock:
            return self._allocator.request_shrink(tenant, new_quota_pages)

    def num_blocks_to_release(self, tenant: str) -> int:
        with self._lock:
            return self._allocator.num_blocks_to_release(tenant)

    def complete_shrink(self, ticket: ShrinkTicket) -> None:
        with self._lock:
            self._allocator.complete_shrink(ticket)

    def complete_shrink_if_released(self, tenant: str) -> bool:
        """Close the tenant's open shrink once it holds no block above its quota."""
        with self._lock:
            ticket = self._allocator.open_shrink(tenant)
            if ticket is None or self._allocator.num_blocks_to_release(tenant):
                return False
            self._allocator.complete_shrink(ticket)
            return True

    def reclaim_for_owner(self, num_pages: int) -> list[ShrinkTicket]:
        with self._lock:
            return self._allocator.reclaim_for_owner(num_pages)

    def rebalance(self, evictable_pages: dict[str, int] | None = None) -> dict[str, int]:
        with self._lock:
            return self._allocator.rebalance(evictable_pages)

    def stats(self) -> AllocatorStats:
        with self._lock:
            return self._allocator.stats()

    def tenant_stats(self, tenant: str) -> TenantStats:
        with self._lock:
            return self._allocator.tenant_stats(tenant)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return self._allocator.snapshot()

    def check_invariants(self) -> None:
        with self._lock:
            self._allocator.check_invariants()


# The answer of an owner that is tearing down; its clients take it as the owner gone.
_OWNER_CLOSING = {"ok": False, "closing": True, "error": "the pool's owner is closing"}


class KVAllocatorService:
    """Turns JSON-able request dicts into calls on a locked allocator."""

    def __init__(self, allocator: LockedKVAllocator):
        self.allocator = allocator

    def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request.get("op")
        handler = getattr(self, f"_op_{op}", None) if isinstance(op, str) else None
        if handler is None:
            return {"ok": False, "error": f"unknown op {op!r}; see KVAllocatorService._op_*"}
        if self.allocator.closed:
            return _OWNER_CLOSING
        try:
            return {"ok": True, "result": handler(request)}
        except (ValueError, KeyError, TypeError) as exc:
            if self.allocator.closed:  # torn down under the call (its page table)
                return _OWNER_CLOSING
            # A client's mistake must not kill the serving loop of the cold process.
            return {"ok": False, "error": f"{op}: {type(exc).__name__}: {exc}"}

    def _op_allocate_blocks(self, request: dict[str, Any]) -> list[list[Any]] | None:
        blocks = self.allocator.allocate_blocks(request["tenant"], request["num_blocks"])
        if blocks is None:
            return None
        return [[block.block_id, list(block.page_ids)] for block in blocks]

    def _op_free_blocks(self, request: dict[str, Any]) -> None:
        self.allocator.free_blocks(request["tenant"], list(request["block_ids"]))

    def _op_can_allocate(self, request: dict[str, Any]) -> bool:
        return self.allocator.can_allocate(request["tenant"], request["num_blocks"])

    def _op_num_allocatable_blocks(self, request: dict[str, Any]) -> int:
        return self.allocator.num_allocatable_blocks(request["tenant"])

    def _op_num_blocks_to_release(self, request: dict[str, Any]) -> int:
        return self.allocator.num_blocks_to_release(request["tenant"])

    def _op_stats(self, request: dict[str, Any]) -> dict[str, Any]:
        return asdict(self.allocator.stats())

    def _op_sync_lease(self, request: dict[str, Any]) -> dict[str, Any]:
        """One round trip per scheduler step of a remote tenant (``weaver.kv.lease``): give
        back ``release`` block ids, take up to ``want`` new blocks as far as the quota and the
        pool allow, and learn how many blocks a shrink still asks for."""
        tenant = request["tenant"]
        if request.get("report"):
            self.allocator.tenant_reports[tenant] = dict(request["report"])
        if request["release"]:
            self.allocator.free_blocks(tenant, list(request["release"]))
        self.allocator.complete_shrink_if_released(tenant)
        want = int(request["want"])
        num_new = min(want, self.allocator.num_allocatable_blocks(tenant))
        if want > num_new:  # recorded as a failed allocation: ADBS sees the tenant starved
            self.allocator.allocate_blocks(tenant, want)
        blocks = self.allocator.allocate_blocks(tenant, num_new) if num_new > 0 else []
        return {"blocks": [[b.block_id, list(b.page_ids)] for b in blocks or []],
                "to_release": self.allocator.num_blocks_to_release(tenant),
                # What the quota would still grant after this: a hot engine weighs a pool
                # of pages against its other colds' free blocks by it.
                "room": self.allocator.num_allocatable_blocks(tenant)}


class ConnectionLedger:
    """The blocks one connection holds: those it was granted and has not freed. A peer is
    one engine's scheduler; when its connection ends (the engine stopped, or its process
    died and the kernel closed the socket), nobody can free its blocks any more, so the
    service frees them, and the engine's successor starts from an empty lease."""

    def __init__(self) -> None:
        self.held: dict[str, set[int]] = {}

    def record(self, request: dict[str, Any], response: dict[str, Any]) -> None:
        if not response.get("ok"):
            return
        op, tenant, result = request.get("op"), request.get("tenant"), response["result"]
        held = self.held.setdefault(tenant, set()) if tenant is not None else None
        if op == "allocate_blocks" and result:
            held.update(block_id for block_id, _ in result)
        elif op == "free_blocks":
            held.difference_update(request["block_ids"])
        elif op == "sync_lease":
            held.difference_update(request["release"])
            held.update(block_id for block_id, _ in result["blocks"])

    def release_all(self, allocator: LockedKVAllocator) -> int:
        """Free every block still held; returns how many."""
        num_freed = 0
        for tenant, block_ids in self.held.items():
            if not block_ids:
                continue
            try:
                allocator.free_blocks(tenant, sorted(block_ids))
                allocator.complete_shrink_if_released(tenant)
            except ValueError:  # the allocator disagrees: report it, keep serving the rest
                logger.exception("could not free the %d blocks a closed connection of %r "
                                 "held", len(block_ids), tenant)
                continue
            except KeyError:  # the pool closed its page table: it is shutting down
                logger.debug("pool closed before the blocks of %r were freed", tenant)
                return num_freed
            num_freed += len(block_ids)
            logger.info("freed %d KV blocks of %r held by a closed connection",
                        len(block_ids), tenant)
        self.held.clear()
        return num_freed


def serve_connection(service: KVAllocatorService, conn: Connection) -> int:
    """Answer requests on ``conn`` until the peer sends None or hangs up, then free the
    blocks it still holds (``ConnectionLedger``); returns how many requests it answered."""
    num_requests = 0
    ledger = ConnectionLedger()
    try:
        while True:
            try:
                request = conn.recv()
            except (EOFError, OSError):
                break
            if request is None:
                break
            response = service.handle(request)
            ledger.record(request, response)
            conn.send(response)
            num_requests += 1
    finally:
        ledger.release_all(service.allocator)
    logger.debug("KV allocator connection closed after %d requests", num_requests)
    return num_requests


class KVAllocatorClient:
    """The other processes' side of ``serve_connection``."""

    def __init__(self, conn: Connection):
        self._conn = conn

    def call(self, op: str, **kwargs: Any) -> Any:
        self._conn.send({"op": op, **kwargs})
        response = self._conn.recv()
        if response.get("closing"):  # as a broken connection: the owner (its engine) is going
            raise ConnectionResetError(response["error"])
        if not response["ok"]:
            raise ValueError(response["error"])
        return response["result"]

    def allocate_blocks(self, tenant: str, num_blocks: int) -> list[tuple[int, list[int]]] | None:
        """(block id, page ids) per new block, or None when they do not fit."""
        result = self.call("allocate_blocks", tenant=tenant, num_blocks=num_blocks)
        return None if result is None else [(block_id, pages) for block_id, pages in result]

    def free_blocks(self, tenant: str, block_ids: list[int]) -> None:
        self.call("free_blocks", tenant=tenant, block_ids=block_ids)

    def can_allocate(self, tenant: str, num_blocks: int = 1) -> bool:
        return self.call("can_allocate", tenant=tenant, num_blocks=num_blocks)

    def num_allocatable_blocks(self, tenant: str) -> int:
        return self.call("num_allocatable_blocks", tenant=tenant)

    def num_blocks_to_release(self, tenant: str) -> int:
        return self.call("num_blocks_to_release", tenant=tenant)

    def stats(self) -> dict[str, Any]:
        return self.call("stats")

    def close(self) -> None:
        try:
            self._conn.send(None)  # a goodbye; the owner may be gone already
        finally:
            self._conn.close()
