"""Unified KV-block allocator of the cold device's pool (Weaver §4.3): pure bookkeeping."""

from weaver.kv.adbs import AdbsPolicy
from weaver.kv.allocator import UnifiedKVAllocator
from weaver.kv.block_view import TenantBlockView
from weaver.kv.pages import TenantShape, choose_page_bytes
from weaver.kv.records import BlockHandle, ShrinkTicket

__all__ = [
    "AdbsPolicy",
    "BlockHandle",
    "ShrinkTicket",
    "TenantBlockView",
    "TenantShape",
    "UnifiedKVAllocator",
    "choose_page_bytes",
]
