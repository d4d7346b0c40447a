"""A shared-memory copy of every tenant's block -> page table, for readers in other processes.

The allocator's decisions stay in the owning (cold) process (``weaver.kv.service``); what
other processes need on their hot path is only the translation of a block id into page ids,
and a round trip per lookup would be too slow there. So the owner mirrors each tenant's
address table into one POSIX shared-memory segment (numpy over
``multiprocessing.shared_memory``) and readers map it once.

Layout: for each tenant, an int32 array ``[max_blocks, pages_per_block]`` at a byte offset
given by ``layout()``; a row holds the block's page ids in (layer, head, sub-page) order
(the same order as ``BlockHandle.page_ids``) and is all -1 while the block is not live.

Ordering: the single writer fills a row *before* the block id leaves the owning process (the
service answers only after ``LockedKVAllocator`` published it, under its lock), and a reader
only looks up ids it was given, so the pipe round trip orders the write before the read.
A row is cleared when the block is freed; a reader must not use a block after freeing it.
The segment name comes from the caller (the deployment config), never from this module;
the creating process unlinks it in ``close``.
"""

from __future__ import annotations

import logging
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import numpy as np

from weaver.kv.allocator import UnifiedKVAllocator
from weaver.kv.records import BlockHandle

logger = logging.getLogger(__name__)

_DTYPE = np.int32
# Where Linux exposes POSIX shared memory; readers map the segment from here read-only.
_SHM_DIR = Path("/dev/shm")


class SharedPageTable:
    """Block -> page-id rows of every tenant in one shared-memory segment."""

    def __init__(
        self,
        layout: dict[str, Any],
        tables: dict[str, np.ndarray],
        shm: shared_memory.SharedMemory | None,
    ):
        self._layout = layout
        self._tables = tables
        self._shm = shm  # set only in the creating (writing) process

    @staticmethod
    def _views(layout: dict[str, Any], buffer: Any) -> dict[str, np.ndarray]:
        return {
            entry["name"]: np.ndarray(
                (entry["max_blocks"], entry["pages_per_block"]),
                dtype=_DTYPE,
                buffer=buffer,
                offset=entry["offset"],
            )
            for entry in layout["tenants"]
        }

    @staticmethod
    def layout_for(name: str, tenants: list[tuple[str, int, int]]) -> dict[str, Any]:
        """The segment's layout for ``(tenant, max_blocks, pages_per_block)`` in order: what
        ``create`` builds and ``attach`` reads, computable by any process that knows the
        pool's plan (so a reader needs nothing from the owner but the segment)."""
        entries, offset = [], 0
        for tenant, max_blocks, pages_per_block in tenants:
            entries.append({"name": tenant, "offset": offset, "max_blocks": max_blocks,
                            "pages_per_block": pages_per_block})
            offset += max_blocks * pages_per_block * np.dtype(_DTYPE).itemsize
        return {"name": name, "tenants": entries, "num_bytes": offset}

    @classmethod
    def create(cls, name: str, allocator: UnifiedKVAllocator) -> SharedPageTable:
        """Create the segment for the allocator's current tenants and fill it from them."""
        if np.iinfo(_DTYPE).max < allocator.num_pages:
            raise ValueError(f"{allocator.num_pages} pages do not fit int32 page ids")
        layout = cls.layout_for(name, [(tenant, allocator.max_blocks(tenant),
                                        allocator.pages_per_block(tenant))
                                       for tenant in allocator.tenant_names])
        shm = shared_memory.SharedMemory(name=name, create=True,
                                         size=max(layout["num_bytes"], 1))
        layout["name"] = shm.name
        table = cls(layout, cls._views(layout, shm.buf), shm)
        table.sync(allocator)
        logger.info("shared KV page table %s: %d bytes, %d tenants", name, layout["num_bytes"],
                    len(layout["tenants"]))
        return table

    @classmethod
    def attach(cls, layout: dict[str, Any]) -> SharedPageTable:
        """Map an existing segment read-only from its ``layout()`` (sent by the owner).

        The file under /dev/shm is mapped directly rather than through ``SharedMemory``:
        on Python < 3.13 an attached ``SharedMemory`` is registered with the reader's
        resource tracker, which would unlink the owner's segment when the reader exits."""
        path = _SHM_DIR / layout["name"]
        if not path.exists():
            raise ValueError(
                f"shared page table {layout['name']!r} does not exist under {_SHM_DIR}; "
                "attach after the owner has created it, on the same machine"
            )
        buffer = np.memmap(path, dtype=np.uint8, mode="r")
        return cls(layout, cls._views(layout, buffer), shm=None)

    def layout(self) -> dict[str, Any]:
        """JSON-able description a reader passes to ``attach``."""
        return self._layout

    def publish(self, block: BlockHandle) -> None:
        """Write the block's row (owner only: a reader's mapping is read-only)."""
        self._tables[block.tenant][block.block_id] = block.page_ids

    def retract(self, tenant: str, block_id: int) -> None:
        self._tables[tenant][block_id] = -1

    def sync(self, allocator: UnifiedKVAllocator) -> None:
        """Rewrite every row from the allocator (after a restore, or at creation)."""
        for tenant, table in self._tables.items():
            table.fill(-1)
            for block in allocator.live_blocks(tenant):
                self.publish(block)

    def table(self, tenant: str) -> np.ndarray:
        """The tenant's whole ``[max_blocks, pages_per_block]`` table: a live view of the
        segment (read-only in a reader), for kernels that gather rows themselves."""
        table = self._tables.get(tenant)
        if table is None:
            raise ValueError(f"unknown tenant {tenant!r}; the table has {sorted(self._tables)}")
        return table

    def page_ids(self, tenant: str, block_id: int) -> np.ndarray:
        """A copy of the block's page ids (all -1 when the block is not live)."""
        table = self._tables.get(tenant)
        if table is None:
            raise ValueError(f"unknown tenant {tenant!r}; the table has {sorted(self._tables)}")
        if not 0 <= block_id < len(table):
            raise ValueError(f"block id {block_id} outside [0, {len(table)}) for {tenant!r}")
        return table[block_id].copy()

    def close(self) -> None:
        """Unmap; the creating process also unlinks the segment."""
        self._tables.clear()  # numpy views must go before the buffer can be closed
        if self._shm is not None:
            self._shm.close()
            self._shm.unlink()
