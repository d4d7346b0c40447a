"""Page arithmetic of tenant shapes (weaver/kv/pages.py)."""

import pytest
from kv_models import SMOLLM2_135M, TINY_LLAMA

from weaver.kv.pages import TenantShape, choose_page_bytes, headwise_block_size


def test_head_block_bytes_is_k_plus_v_of_one_head() -> None:
    # 32 tokens x (K + V) x 64 dims x 2 bytes
    assert SMOLLM2_135M.head_block_bytes == 32 * 2 * 64 * 2 == 8192
    assert SMOLLM2_135M.num_head_blocks_per_block == 90
    assert SMOLLM2_135M.block_bytes() == 90 * 8192


def test_gcd_page_wastes_nothing_and_splits_larger_heads() -> None:
    page_bytes = choose_page_bytes([SMOLLM2_135M, TINY_LLAMA])
    assert page_bytes == 4096  # TINY's head-block; SMOL's is twice that
    assert SMOLLM2_135M.pages_per_head_block(page_bytes) == 2
    assert SMOLLM2_135M.pages_per_block(page_bytes) == 180
    assert TINY_LLAMA.pages_per_block(page_bytes) == 4
    for shape in (SMOLLM2_135M, TINY_LLAMA):
        assert shape.num_wasted_bytes_per_block(page_bytes) == 0


def test_page_that_does_not_divide_rounds_up_and_reports_waste() -> None:
    # A 6000-byte page: TINY's 4096-byte head-block takes one page and wastes 1904 bytes;
    # SMOL's 8192-byte head-block takes two pages and wastes 3808 bytes.
    assert TINY_LLAMA.pages_per_head_block(6000) == 1
    assert TINY_LLAMA.num_wasted_bytes_per_block(6000) == 4 * 1904
    assert SMOLLM2_135M.pages_per_head_block(6000) == 2
    assert SMOLLM2_135M.num_wasted_bytes_per_block(6000) == 90 * 3808


def test_gcd_of_mixed_dtypes_and_block_sizes() -> None:
    fp32_block16 = TenantShape(4, 1, 128, 16, 4)  # 16384-byte head-blocks
    fp8_block32 = TenantShape(4, 1, 96, 32, 1)  # 6144-byte head-blocks
    page_bytes = choose_page_bytes([fp32_block16, fp8_block32])
    assert page_bytes == 2048
    assert fp32_block16.pages_per_head_block(page_bytes) == 8
    assert fp8_block32.pages_per_head_block(page_bytes) == 3


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, None])
def test_bad_shape_field_raises_value_error_naming_the_field(bad: object) -> None:
    with pytest.raises(ValueError, match="num_kv_heads"):
        TenantShape(num_layers=2, num_kv_heads=bad, head_size=64, block_size=16, dtype_bytes=2)


def test_bad_page_bytes_and_empty_shapes_raise() -> None:
    with pytest.raises(ValueError, match="page_bytes"):
        TINY_LLAMA.pages_per_block(0)
    with pytest.raises(ValueError, match="at least one"):
        choose_page_bytes([])


def test_headwise_block_size_fills_one_page_per_head_block() -> None:
    # A 32 KiB page: fp32 head size 64 takes 64 tokens, head size 128 takes 32.
    assert headwise_block_size(32768, 64, 4) == 64
    assert headwise_block_size(32768, 128, 4) == 32
    shape = TenantShape(num_layers=30, num_kv_heads=3, head_size=64, block_size=64, dtype_bytes=4)
    assert shape.pages_per_head_block(32768) == 1
    assert shape.num_wasted_bytes_per_block(32768) == 0


def test_headwise_block_size_refuses_a_page_that_splits_a_token() -> None:
    with pytest.raises(ValueError, match="whole number of tokens"):
        headwise_block_size(1000, 64, 4)
