from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from weaver.offload.layout import (
    CACHE_LINE_BYTES,
    DONE_SEQ_OFFSET,
    HEADER_BYTES,
    STATUS_OFFSET,
    TASK_SEQ_OFFSET,
    HotAttentionShape,
    RegionLayout,
    read_header_fields,
)
from weaver.offload.naming import region_name

SHAPE = HotAttentionShape(
    num_layers=3, num_q_heads=9, num_kv_heads=3, head_size=64, block_size=32, dtype="bfloat16"
)


def make_layout(**overrides) -> RegionLayout:
    kwargs = dict(shape=SHAPE, num_remote_blocks=10, max_seqs_per_task=5, max_blocks_per_seq=7)
    kwargs.update(overrides)
    return RegionLayout(**kwargs)


def test_sections_are_aligned_ordered_and_sized():
    lay = make_layout()
    offsets = [
        0,
        lay.meta_offset,
        lay.meta_floats_offset,
        lay.seq_lens_offset,
        lay.block_table_offset,
        lay.q_offset,
        lay.out_offset,
        lay.kv_offset,
    ]
    assert all(o % CACHE_LINE_BYTES == 0 for o in offsets + [lay.kv_layer_bytes])
    assert offsets == sorted(offsets) and len(set(offsets)) == len(offsets)
    assert lay.meta_offset >= HEADER_BYTES
    assert lay.block_table_offset - lay.seq_lens_offset >= 4 * 5
    assert lay.q_offset - lay.block_table_offset >= 4 * 5 * 7
    assert lay.staging_shape == (5, 9, 64)
    assert lay.out_offset - lay.q_offset >= 5 * 9 * 64 * 2
    assert lay.kv_layer_shape == (10, 3, 32, 128)
    assert lay.kv_block_bytes == 3 * 32 * 128 * 2
    assert lay.total_bytes == lay.kv_offset + 3 * lay.kv_layer_bytes
    assert lay.kv_layer_offset(2) == lay.kv_offset + 2 * lay.kv_layer_bytes
    assert lay.max_tokens_per_seq == 7 * 32


def test_counters_sit_on_separate_cache_lines():
    lines = {off // CACHE_LINE_BYTES for off in (TASK_SEQ_OFFSET, DONE_SEQ_OFFSET, STATUS_OFFSET)}
    assert len(lines) == 3
    assert TASK_SEQ_OFFSET % 8 == 0 and DONE_SEQ_OFFSET % 8 == 0


def test_header_round_trip_and_mismatch_names_the_fields():
    lay = make_layout()
    header = bytearray(HEADER_BYTES)
    packed = lay.pack_header()
    header[: len(packed)] = packed
    lay.verify_header(header)
    assert read_header_fields(header)["num_kv_heads"] == 3
    other = make_layout(shape=HotAttentionShape(3, 8, 2, 64, 32, "bfloat16"), max_seqs_per_task=6)
    with pytest.raises(ValueError) as err:
        other.verify_header(header)
    message = str(err.value)
    assert "num_q_heads: region has 9, this side expects 8" in message
    assert "num_kv_heads: region has 3, this side expects 2" in message
    assert "max_seqs_per_task" in message and "head_size" not in message
    # A hot engine on a GPU backend lays K/V out per token; a region made for CPU_ATTN's
    # pages would be read wrongly, so the header says which.
    gpu = make_layout(shape=dataclasses.replace(lay.shape, kv_format="token"))
    with pytest.raises(ValueError, match="kv_format_code: region has 0, this side expects 1"):
        gpu.verify_header(header)


def test_foreign_or_short_buffer_is_rejected():
    with pytest.raises(ValueError, match="not a Weaver offload region"):
        make_layout().verify_header(bytearray(HEADER_BYTES))
    with pytest.raises(ValueError, match="too small"):
        read_header_fields(b"\0" * 8)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_q_heads=10, num_kv_heads=4), "multiple of num_kv_heads"),
        (dict(head_size=0), "head_size must be a positive int"),
        (dict(dtype="float64"), "unsupported dtype"),
        (dict(kv_format="nhd"), "kv_format must be one of"),
    ],
)
def test_bad_shape_raises_value_error(kwargs, match):
    base = dict(
        num_layers=1, num_q_heads=4, num_kv_heads=2, head_size=32, block_size=32, dtype="float32"
    )
    base.update(kwargs)
    with pytest.raises(ValueError, match=match):
        HotAttentionShape(**base)


def test_bad_region_sizes_raise_value_error():
    with pytest.raises(ValueError, match="num_remote_blocks"):
        make_layout(num_remote_blocks=0)
    with pytest.raises(ValueError, match="layer 3 out of range"):
        make_layout().kv_layer_offset(3)


def test_region_name_is_sanitised_and_unique():
    name = region_name("weaver", "meta-llama/Llama-3-8B", "Qwen/Qwen2 0.5B")
    assert name.startswith("weaver-meta-llama_Llama-3-8B-Qwen_Qwen2_0.5B-")
    assert "/" not in name and " " not in name
    # sanitising makes these look alike; the hash keeps them apart
    assert region_name("w", "a/b", "c") != region_name("w", "a_b", "c")
    assert region_name("w", "a/b", "c") == region_name("w", "a/b", "c")
    assert len(region_name("w", "x" * 500, "y" * 500)) <= 200
    with pytest.raises(ValueError, match="cold_model must be a non-empty"):
        region_name("w", "hot", "")


def test_offload_package_imports_without_vllm():
    code = (
        "import sys\n"
        "import weaver.offload.layout, weaver.offload.protocol, weaver.offload.naming\n"
        "import weaver.offload.sender, weaver.offload.receiver, weaver.offload.shm\n"
        "import weaver.offload.reference_attention, weaver.offload.cuda.transport\n"
        "import weaver.profiling.channel_probe, weaver.cli.offload_probe\n"
        "import torch\n"
        "assert not any(m == 'vllm' or m.startswith('vllm.') for m in sys.modules), 'vllm'\n"
        "assert 'cupy' not in sys.modules\n"
        "assert not torch.cuda.is_initialized()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cli_and_naming_import_without_torch():
    # `weaver --help` imports every CLI module; region names are computed by config code.
    code = (
        "import sys\n"
        "import weaver.cli.offload_probe, weaver.offload.naming, weaver.offload.layout\n"
        "import weaver.profiling.probe_config\n"
        "assert 'torch' not in sys.modules and 'numpy' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_reference_reads_back_what_it_wrote_in_either_kv_format():
    """The oracle's two KV formats hold the same K/V in different places: the GPU backends'
    token rows (K then V in each token's row) and CPU_ATTN's pages (K rows then V rows)."""
    import torch

    from weaver.offload.cuda.pool import write_kv
    from weaver.offload.reference_attention import gather_kv_reference, write_kv_reference

    gen = torch.Generator().manual_seed(0)
    key, value = torch.randn(2, 5, 2, 8, generator=gen)
    slots = torch.tensor([17, 18, 19, 0, 1])  # a sequence over blocks 1 and 0 (block_size 16)
    layers = {}
    for layout_name in ("token", "nd"):
        kv_layer = torch.zeros(3, 2, 16, 16)
        write_kv_reference(kv_layer, key, value, slots, key_layout=layout_name)
        k, v = gather_kv_reference(kv_layer, torch.tensor([1, 0]), 18, key_layout=layout_name)
        # slots 17-19 are positions 1-3 (block 1 comes first), slots 0-1 positions 16-17
        assert torch.equal(k[:, 1:4], key[:3].transpose(0, 1))
        assert torch.equal(k[:, 16:18], key[3:].transpose(0, 1))
        assert torch.equal(v[:, 1:4], value[:3].transpose(0, 1))
        layers[layout_name] = kv_layer
        # The CUDA transport's writer (plain torch, so it runs here) writes the same bytes.
        written = torch.zeros_like(kv_layer)
        write_kv(written, key, value, slots, "token" if layout_name == "token" else "pages")
        assert torch.equal(written, kv_layer)
    assert torch.equal(layers["token"][1, :, 1, :8], key[0])  # token row: K then V
    assert torch.equal(layers["token"][1, :, 1, 8:], value[0])
    assert not torch.equal(layers["token"], layers["nd"])
