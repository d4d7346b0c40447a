"""The region descriptor the CUDA kernels read: int64 words derived from a RegionLayout.

Device code gets the region as a base pointer plus this descriptor (``csrc/
offload_region.cuh`` ``DescIndex``), so the byte offsets are written once, in
weaver/offload/layout.py, and both transports share them. Pure Python.
"""

from __future__ import annotations

from weaver.offload.layout import (
    DONE_RESULT_OFFSET,
    DONE_SEQ_OFFSET,
    KV_FORMATS,
    STATUS_OFFSET,
    TASK_SEQ_OFFSET,
    RegionLayout,
)

# Order = csrc/offload_region.cuh DescIndex (tests/gpu/test_region_desc.py checks it).
DESC_FIELDS: tuple[str, ...] = (
    "task_seq",
    "done_seq",
    "done_result",
    "status",
    "meta_ints",
    "meta_floats",
    "seq_lens",
    "block_table",
    "q",
    "out",
    "kv",
    "kv_layer_bytes",
    "num_layers",
    "num_q_heads",
    "num_kv_heads",
    "head_size",
    "block_size",
    "max_seqs",
    "max_blocks",
    "num_blocks",
    "kv_format",
)

# Device code indexes head elements with a fixed per-lane register array
# (csrc/paged_attention.cuh kMaxHeadSize).
MAX_HEAD_SIZE = 256
# K/V rows are read in 16-byte vectors (8 fp16/bf16 elements).
HEAD_SIZE_MULTIPLE = 8
BLOCK_SIZE_MULTIPLE = 16


def region_descriptor(layout: RegionLayout) -> list[int]:
    """The descriptor words, in DESC_FIELDS order, for `layout`."""
    check_kernel_shape(layout)
    s = layout.shape
    values = {
        "task_seq": TASK_SEQ_OFFSET,
        "done_seq": DONE_SEQ_OFFSET,
        "done_result": DONE_RESULT_OFFSET,
        "status": STATUS_OFFSET,
        "meta_ints": layout.meta_offset,
        "meta_floats": layout.meta_floats_offset,
        "seq_lens": layout.seq_lens_offset,
        "block_table": layout.block_table_offset,
        "q": layout.q_offset,
        "out": layout.out_offset,
        "kv": layout.kv_offset,
        "kv_layer_bytes": layout.kv_layer_bytes,
        "num_layers": s.num_layers,
        "num_q_heads": s.num_q_heads,
        "num_kv_heads": s.num_kv_heads,
        "head_size": s.head_size,
        "block_size": s.block_size,
        "max_seqs": layout.max_seqs_per_task,
        "max_blocks": layout.max_blocks_per_seq,
        "num_blocks": layout.num_remote_blocks,
        "kv_format": KV_FORMATS[s.kv_format],
    }
    return [values[name] for name in DESC_FIELDS]


def check_kernel_shape(layout: RegionLayout) -> None:
    """Raise ValueError if the CUDA kernels cannot serve this layout's attention shape."""
    s = layout.shape
    if s.head_size > MAX_HEAD_SIZE:
        raise ValueError(
            f"head_size {s.head_size} > {MAX_HEAD_SIZE}, the largest the CUDA offload kernels "
            "support; use the CPU transport for this model"
        )
    if s.head_size % HEAD_SIZE_MULTIPLE:
        raise ValueError(
            f"head_size {s.head_size} is not a multiple of {HEAD_SIZE_MULTIPLE}, which the "
            "CUDA offload kernels read in 16-byte vectors; use the CPU transport for this model"
        )
    if s.block_size % BLOCK_SIZE_MULTIPLE:
        raise ValueError(
            f"block_size {s.block_size} is not a multiple of {BLOCK_SIZE_MULTIPLE}; the CUDA "
            "transport needs vLLM block sizes like 16, 32 or 64"
        )
    if layout.num_remote_blocks >= 2**31 or layout.max_seqs_per_task * s.num_q_heads >= 2**31:
        raise ValueError("the remote pool or the task is too large for the kernels' int32 indices")
