"""Tenant shapes and the page arithmetic of the unified KV pool (Weaver §4.3).

The pool on the cold device is carved into fixed-size pages. Like MuxServe's unified
head-wise KV cache (MuxServe §4.2.4), the unit a tenant stores is a *head-block*: the K and
the V of one KV head of one layer for ``block_size`` tokens, i.e.
``block_size * 2 * head_size * dtype_bytes`` bytes. This matches the layout vLLM's CPU_ATTN
kernel already reads, where each (block, head) page is ``[K: N x D | V: N x D]``
(``vllm/v1/attention/backends/cpu_attn.py``, ``kv_cache.view(B, H, 2N, D)``).

One logical block of a model with L layers and H KV heads is therefore L * H head-blocks.

Page size choice. Tenants may differ in head size, block size or dtype, so their
head-blocks differ in bytes. We map one head-block onto ``ceil(head_block_bytes /
page_bytes)`` whole pages. ``choose_page_bytes`` picks the greatest common divisor of the
tenants' head-block sizes: every head-block is then an exact multiple of the page and no
byte is wasted, at the price of more page ids per block for the larger head-blocks (e.g.
head size 64 next to head size 32 gives two pages per head-block). A caller that passes
its own ``page_bytes`` (for instance to keep page tables short) pays the rounding waste
``num_wasted_bytes_per_block`` reports. The pages of one head-block need not be
contiguous: the address table in a ``BlockHandle`` lists every page.

Addressing: page ``p`` is bytes ``[p * page_bytes, (p + 1) * page_bytes)`` of the pool
region, and sub-page ``j`` of a head-block holds its bytes ``[j * page_bytes, ...)``; with
two pages per head-block, sub-page 0 is exactly K and sub-page 1 exactly V. The cost of
head-wise pages is table length: L * H * pages_per_head_block ids per block (1024 for a
Llama-2-7B block), which the attention side ships or reads from ``SharedPageTable``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class TenantShape:
    """The KV geometry of one model that stores its cache in the pool."""

    num_layers: int
    num_kv_heads: int
    head_size: int
    block_size: int  # tokens per logical block, as the tenant's scheduler sees it
    dtype_bytes: int  # bytes per K or V element (2 for fp16/bf16, 4 for fp32, 1 for fp8)

    def __post_init__(self) -> None:
        for field_name in ("num_layers", "num_kv_heads", "head_size", "block_size", "dtype_bytes"):
            value = getattr(self, field_name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(
                    f"TenantShape.{field_name} must be a positive integer, got {value!r}; "
                    "read it from the model's config (e.g. num_hidden_layers, "
                    "num_key_value_heads, head_dim) and the engine's block_size/dtype"
                )

    @property
    def head_block_bytes(self) -> int:
        """Bytes of K plus V of one head of one layer for one block of tokens."""
        return self.block_size * 2 * self.head_size * self.dtype_bytes

    @property
    def num_head_blocks_per_block(self) -> int:
        return self.num_layers * self.num_kv_heads

    def block_bytes(self) -> int:
        """Bytes the tenant really needs per logical block (no rounding)."""
        return self.num_head_blocks_per_block * self.head_block_bytes

    def pages_per_head_block(self, page_bytes: int) -> int:
        check_page_bytes(page_bytes)
        return -(-self.head_block_bytes // page_bytes)

    def pages_per_block(self, page_bytes: int) -> int:
        return self.num_head_blocks_per_block * self.pages_per_head_block(page_bytes)

    def num_wasted_bytes_per_block(self, page_bytes: int) -> int:
        """Bytes lost to rounding each head-block up to whole pages."""
        return self.pages_per_block(page_bytes) * page_bytes - self.block_bytes()


def check_page_bytes(page_bytes: int) -> None:
    if not isinstance(page_bytes, int) or isinstance(page_bytes, bool) or page_bytes < 1:
        raise ValueError(
            f"page_bytes must be a positive integer, got {page_bytes!r}; "
            "use choose_page_bytes(shapes) for a size that wastes nothing"
        )


def choose_page_bytes(shapes: Iterable[TenantShape]) -> int:
    """The largest page size that divides every tenant's head-block exactly (zero waste)."""
    sizes = [shape.head_block_bytes for shape in shapes]
    if not sizes:
        raise ValueError("choose_page_bytes needs at least one TenantShape")
    return math.gcd(*sizes)


def headwise_block_size(page_bytes: int, head_size: int, dtype_bytes: int) -> int:
    """The tenant block size (tokens) whose head-block fills exactly one page.

    Kernels that read a head-block as one ``[K | V]`` slab (vLLM's CPU_ATTN, through
    ``weaver.vllm_ext.attention.headwise``) need one page per head-block; tenants with other
    head sizes or dtypes then get other block sizes over the same pages (head size 64 at
    block 64 next to head size 128 at block 32, for instance)."""
    check_page_bytes(page_bytes)
    token_bytes = 2 * head_size * dtype_bytes
    if head_size < 1 or dtype_bytes < 1 or page_bytes % token_bytes:
        raise ValueError(
            f"a {page_bytes}-byte page does not hold a whole number of tokens of K+V at "
            f"head_size {head_size}, {dtype_bytes} bytes per element ({token_bytes} bytes per "
            "token); pick a page size that is a multiple of it"
        )
    return page_bytes // token_bytes
