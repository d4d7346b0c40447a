"""Thread-safe wrapper and the request/response service across a real process boundary."""

import multiprocessing
import threading

import pytest
from kv_models import SMOLLM2_135M, TINY_LLAMA

from weaver.kv.allocator import UnifiedKVAllocator
from weaver.kv.pages import choose_page_bytes
from weaver.kv.service import (
    KVAllocatorClient,
    KVAllocatorService,
    LockedKVAllocator,
    serve_connection,
)


def make_locked() -> LockedKVAllocator:
    allocator = UnifiedKVAllocator(2000, choose_page_bytes([SMOLLM2_135M, TINY_LLAMA]))
    allocator.add_tenant("cold", TINY_LLAMA, 800, is_owner=True)
    allocator.add_tenant("hot", SMOLLM2_135M, 1080)
    allocator.add_tenant("hot2", TINY_LLAMA, 120)
    return LockedKVAllocator(allocator)


def churn(locked: LockedKVAllocator, tenant: str, num_rounds: int, errors: list) -> None:
    try:
        held = []
        for i in range(num_rounds):
            blocks = locked.allocate_blocks(tenant, 1 + i % 3)
            if blocks:
                held.extend(b.block_id for b in blocks)
            if len(held) > 4 or blocks is None:
                locked.free_blocks(tenant, held[:2])
                del held[:2]
            if i % 17 == 0:
                locked.rebalance()
        locked.free_blocks(tenant, held)
    except Exception as exc:  # surfaced in the main thread below
        errors.append(exc)


def test_threads_hammering_the_locked_allocator_keep_it_consistent() -> None:
    locked = make_locked()
    errors: list = []
    threads = [
        threading.Thread(target=churn, args=(locked, tenant, 300, errors))
        for tenant in ("cold", "hot", "hot2", "cold")
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    locked.check_invariants()
    stats = locked.stats()
    assert stats.num_free_pages == 2000
    assert all(t.num_blocks == 0 for t in stats.tenants)


def test_service_answers_errors_instead_of_raising() -> None:
    service = KVAllocatorService(make_locked())
    assert service.handle({"op": "nope"})["ok"] is False
    response = service.handle({"op": "allocate_blocks", "tenant": "ghost", "num_blocks": 1})
    assert response["ok"] is False and "unknown tenant" in response["error"]
    response = service.handle({"op": "free_blocks", "tenant": "cold"})
    assert response["ok"] is False and "block_ids" in response["error"]
    response = service.handle({"op": "allocate_blocks", "tenant": "hot", "num_blocks": 7})
    assert response == {"ok": True, "result": None}


def hot_scheduler_process(conn) -> None:
    """Runs in a child process: the hot side's use of the cold side's allocator."""
    client = KVAllocatorClient(conn)
    blocks = client.allocate_blocks("hot", 2)
    assert blocks is not None and [b for b, _ in blocks] == [0, 1]
    assert len(blocks[0][1]) == 180
    assert client.allocate_blocks("hot", 5) is None
    assert client.can_allocate("hot", 4)
    assert client.num_allocatable_blocks("hot") == 4
    client.free_blocks("hot", [0])
    try:
        client.free_blocks("hot", [0])
    except ValueError as exc:
        assert "nothing was freed" in str(exc)
    else:
        raise AssertionError("a double free must come back as ValueError")
    stats = client.stats()
    assert {t["name"]: t["num_blocks"] for t in stats["tenants"]}["hot"] == 1
    client.close()


def test_client_in_another_process_talks_to_the_owning_process() -> None:
    context = multiprocessing.get_context("fork")
    parent_conn, child_conn = context.Pipe()
    locked = make_locked()
    child = context.Process(target=hot_scheduler_process, args=(child_conn,))
    child.start()
    child_conn.close()  # so a crashed child shows up here as EOF instead of a hang
    num_requests = serve_connection(KVAllocatorService(locked), parent_conn)
    child.join(timeout=30)
    assert child.exitcode == 0, "the client process failed an assertion"
    assert num_requests == 7
    # The client closed holding block 1: nobody else can free it, so the service did.
    assert locked._allocator.live_blocks("hot") == []
    locked.check_invariants()


def crashing_scheduler_process(conn) -> None:
    """Leases three blocks, gives one back, then dies without closing the connection."""
    import os

    client = KVAllocatorClient(conn)
    client.call("sync_lease", tenant="hot", release=[], want=3, report={})
    client.call("sync_lease", tenant="hot", release=[2], want=0, report={})
    client.allocate_blocks("hot2", 1)
    os._exit(0)


def test_blocks_of_a_client_that_died_are_freed_and_no_one_elses() -> None:
    context = multiprocessing.get_context("fork")
    parent_conn, child_conn = context.Pipe()
    locked = make_locked()
    kept = locked.allocate_blocks("hot", 1)  # another connection's block (id 0)
    child = context.Process(target=crashing_scheduler_process, args=(child_conn,))
    child.start()
    child_conn.close()
    assert serve_connection(KVAllocatorService(locked), parent_conn) == 3
    child.join(timeout=30)
    assert [b.block_id for b in locked._allocator.live_blocks("hot")] == [kept[0].block_id]
    assert locked._allocator.live_blocks("hot2") == []
    locked.check_invariants()


@pytest.mark.parametrize("op", ["stats", "snapshot"])
def test_locked_read_only_calls_match_the_allocator(op: str) -> None:
    locked = make_locked()
    locked.allocate_blocks("cold", 3)
    assert getattr(locked, op)() == getattr(locked._allocator, op)()
