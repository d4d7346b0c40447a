"""The shared-memory block -> page table that readers in other processes map."""

import multiprocessing
import os
import uuid

import numpy as np
import pytest

from weaver.kv.allocator import UnifiedKVAllocator
from weaver.kv.service import LockedKVAllocator
from weaver.kv.shared_table import SharedPageTable


@pytest.fixture
def table_name() -> str:
    # In a deployment the name comes from the config; here one per test run.
    return f"weaver-test-kv-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def read_rows(layout: dict, requests: list, conn) -> None:
    """Child process: map the table read-only and send back the rows asked for."""
    table = SharedPageTable.attach(layout)
    conn.send([table.page_ids(tenant, block_id).tolist() for tenant, block_id in requests])
    table.close()


def test_rows_follow_allocations_and_reach_another_process(
    allocator: UnifiedKVAllocator, table_name: str
) -> None:
    early = allocator.allocate_blocks("cold", 2)  # live before the table exists: sync copies it
    table = SharedPageTable.create(table_name, allocator)
    try:
        locked = LockedKVAllocator(allocator, page_table=table)
        hot = locked.allocate_blocks("hot", 2)
        cold = locked.allocate_block("cold")
        locked.free_blocks("hot", [hot[0].block_id])
        requests = [("cold", 0), ("cold", 1), ("cold", cold.block_id), ("hot", 0), ("hot", 1)]

        context = multiprocessing.get_context("fork")
        parent_conn, child_conn = context.Pipe()
        child = context.Process(target=read_rows, args=(table.layout(), requests, child_conn))
        child.start()
        child_conn.close()
        rows = parent_conn.recv()
        child.join(timeout=30)
        assert child.exitcode == 0

        assert rows[0] == list(early[0].page_ids)
        assert rows[1] == list(early[1].page_ids)
        assert rows[2] == list(cold.page_ids)
        assert rows[3] == [-1] * 180  # freed
        assert rows[4] == list(hot[1].page_ids)
        # The reader's exit must not have unlinked the owner's segment.
        reader = SharedPageTable.attach(table.layout())
        assert np.array_equal(reader.page_ids("hot", 1), hot[1].page_ids)
        with pytest.raises(ValueError, match="read-only"):
            reader.publish(hot[1])
        with pytest.raises(ValueError, match="outside"):
            reader.page_ids("hot", 5)
        reader.close()
    finally:
        table.close()
    with pytest.raises(ValueError, match="does not exist"):
        SharedPageTable.attach(table.layout())


def test_sync_rewrites_every_row_after_a_restore(
    allocator: UnifiedKVAllocator, table_name: str
) -> None:
    table = SharedPageTable.create(table_name, allocator)
    try:
        blocks = allocator.allocate_blocks("cold", 3)  # behind the table's back
        assert table.page_ids("cold", 1).tolist() == [-1] * 4
        allocator.free_block("cold", blocks[0])
        table.sync(allocator)
        assert table.page_ids("cold", 0).tolist() == [-1] * 4
        assert table.page_ids("cold", 1).tolist() == list(blocks[1].page_ids)
        assert table.page_ids("cold", 2).tolist() == list(blocks[2].page_ids)
    finally:
        table.close()
