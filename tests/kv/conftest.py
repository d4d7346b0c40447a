"""Fixtures shared by the kv tests."""

import pytest
from kv_models import SMOLLM2_135M, TINY_LLAMA

from weaver.kv.allocator import UnifiedKVAllocator
from weaver.kv.pages import choose_page_bytes


@pytest.fixture
def allocator() -> UnifiedKVAllocator:
    """1000 pages of 4 KiB: TINY_LLAMA owner (4 pages/block, quota 280 = 70 blocks) and
    SmolLM2-135M hot (180 pages/block, quota 720 = 4 blocks)."""
    allocator = UnifiedKVAllocator(1000, choose_page_bytes([SMOLLM2_135M, TINY_LLAMA]))
    allocator.add_tenant("cold", TINY_LLAMA, 280, is_owner=True)
    allocator.add_tenant("hot", SMOLLM2_135M, 720)
    return allocator
