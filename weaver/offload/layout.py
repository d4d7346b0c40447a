"""Byte layout of one hot->cold offload region (docs/architecture.md, part 4).

The region is ONE contiguous byte buffer owned by the cold side:

    header | task metadata | q staging | output staging | remote KV pool (layer-outermost)

Every section starts on a 64-byte boundary (one x86 cache line) so that the two
counters the sides poll never share a line with data the other side writes.

The KV pool of one layer is exactly vLLM's per-layer cache view ``[num_blocks,
num_kv_heads, block_size, 2 * head_size]`` (docs/vllm-hooks.md, "KV cache"), holding K and
V the way the hot engine's attention backend does (``KV_FORMATS``), so that backend's own
kernels (CPU_ATTN's ``cpu_attn_reshape_and_cache``, FLASH_ATTN's or TRITON_ATTN's cache
update) write and read views of it as they do the engine's own cache.

This module is pure Python (``struct`` only): the header can be written and checked
without torch, numpy or vLLM.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

CACHE_LINE_BYTES = 64
REGION_MAGIC = b"WEAVRGN\x00"
REGION_VERSION = 3  # 2: kv_in_pool; 3: kv_format
INT64_MAX = 2**63 - 1

# How a KV layer's [num_blocks, num_kv_heads, block_size, 2 * head_size] view holds K and
# V, by the attention backend whose kernels write and read it (code stored in the header):
# - "pages": each (block, kv head) page is K [block_size, head_size] then V, i.e. CPU_ATTN's
#   ``kv_cache.view(B, H, 2 * N, D).chunk(2, dim=2)`` (vllm/v1/attention/backends/cpu_attn.py);
# - "token": each token's row is K then V, i.e. the GPU backends'
#   ``kv_cache.transpose(1, 2).split(head_size, dim=-1)`` (flash_attn.py, triton_attn.py).
KV_FORMATS: dict[str, int] = {"pages": 0, "token": 1}

# dtype name -> (code stored in the header, bytes per element)
_DTYPES: dict[str, tuple[int, int]] = {
    "float32": (1, 4),
    "float16": (2, 2),
    "bfloat16": (3, 2),
}


class RegionStatus(IntEnum):
    """Lifecycle of the cold side, stored in the header's status word."""

    INITIALIZING = 0
    ALIVE = 1
    CLOSING = 2
    CLOSED = 3


# The statuses in which the cold side takes tasks (it may still be starting).
OPEN_STATUSES = frozenset((RegionStatus.INITIALIZING, RegionStatus.ALIVE))


class TaskResult(IntEnum):
    """Outcome of the last served task, published just before done_seq."""

    OK = 0
    FAILED = 1


def align_up(value: int, alignment: int = CACHE_LINE_BYTES) -> int:
    return (value + alignment - 1) // alignment * alignment


def dtype_itemsize(dtype: str) -> int:
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; use one of {sorted(_DTYPES)}")
    return _DTYPES[dtype][1]


@dataclass(frozen=True)
class HotAttentionShape:
    """Attention shape of the HOT model whose sequences are offloaded."""

    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    dtype: str
    kv_format: str = "pages"  # KV_FORMATS: whose kernels write and read the remote pool

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_q_heads", "num_kv_heads", "head_size", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"HotAttentionShape.{name} must be a positive int, got {value!r}")
        if self.num_q_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_q_heads ({self.num_q_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads}) (grouped-query attention); check the hot model config"
            )
        dtype_itemsize(self.dtype)
        if self.kv_format not in KV_FORMATS:
            raise ValueError(f"HotAttentionShape.kv_format must be one of {sorted(KV_FORMATS)}, "
                             f"got {self.kv_format!r}")

    @property
    def itemsize(self) -> int:
        return dtype_itemsize(self.dtype)

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch  # only here: the layout is pure Python otherwise

        return getattr(torch, self.dtype)

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_q_heads // self.num_kv_heads


# Header words, in order. Every field is an int64 so the header is one flat struct.
# Lines 0-2: identity + layout description, written once by the owner before ALIVE.
_LAYOUT_FIELDS = (
    "version",
    "total_bytes",
    "num_layers",
    "num_q_heads",
    "num_kv_heads",
    "head_size",
    "block_size",
    "dtype_code",
    "num_remote_blocks",
    "max_seqs_per_task",
    "max_blocks_per_seq",
    "kv_in_pool",
    "kv_format_code",
)
_LAYOUT_STRUCT = struct.Struct("<8s" + "q" * len(_LAYOUT_FIELDS))
# Counters, each on its own cache line: the hot side writes task_seq, the cold side
# writes done_seq/result and the status line; a shared line would ping-pong.
TASK_SEQ_OFFSET = align_up(_LAYOUT_STRUCT.size)  # int64, written by hot
DONE_SEQ_OFFSET = TASK_SEQ_OFFSET + CACHE_LINE_BYTES  # int64, written by cold
DONE_RESULT_OFFSET = DONE_SEQ_OFFSET + 8  # int64 TaskResult of done_seq
STATUS_OFFSET = DONE_SEQ_OFFSET + CACHE_LINE_BYTES  # int64 RegionStatus, written by cold
OWNER_PID_OFFSET = STATUS_OFFSET + 8  # int64 pid of the owning (cold) process
HEARTBEAT_OFFSET = STATUS_OFFSET + 16  # float64 time.monotonic() of the cold side
# float64 written by cold: its TPOT over its TPOT without the tasks (weaving/cold_load.py)
COLD_INFLATION_OFFSET = STATUS_OFFSET + 24
HEADER_BYTES = STATUS_OFFSET + CACHE_LINE_BYTES

# Fixed part of the task metadata: int64 words then float64 words.
META_TASK_SEQ = 0  # int64: task_seq this metadata belongs to (consistency check)
META_LAYER = 1  # int64: hot layer index
META_NUM_SEQS = 2  # int64
META_SLIDING_WINDOW = 3  # int64, -1 = none (vLLM CPU_ATTN convention)
META_NUM_INT_WORDS = 4
META_SCALE = 0  # float64 softmax scale of the hot layer
META_SOFTCAP = 1  # float64, 0.0 = none (vLLM CPU_ATTN convention)
META_NUM_FLOAT_WORDS = 2


@dataclass(frozen=True)
class RegionLayout:
    """Offsets (bytes from the region start) of every section of one region."""

    shape: HotAttentionShape
    num_remote_blocks: int
    max_seqs_per_task: int
    max_blocks_per_seq: int
    # The remote blocks' K/V live in the cold device's unified KV pool (weaver.kv), not in
    # this region: the region then has no KV section, and num_remote_blocks is the remote
    # tenant's block-id space.
    kv_in_pool: bool = False
    # derived
    meta_offset: int = field(init=False)
    meta_floats_offset: int = field(init=False)
    seq_lens_offset: int = field(init=False)
    block_table_offset: int = field(init=False)
    q_offset: int = field(init=False)
    out_offset: int = field(init=False)
    kv_offset: int = field(init=False)
    kv_layer_bytes: int = field(init=False)
    total_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        for name in ("num_remote_blocks", "max_seqs_per_task", "max_blocks_per_seq"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"RegionLayout.{name} must be a positive int, got {value!r}")
        offset = HEADER_BYTES
        derived: dict[str, int] = {}
        derived["meta_offset"] = offset
        offset = align_up(offset + 8 * META_NUM_INT_WORDS)
        derived["meta_floats_offset"] = offset
        offset = align_up(offset + 8 * META_NUM_FLOAT_WORDS)
        derived["seq_lens_offset"] = offset
        offset = align_up(offset + 4 * self.max_seqs_per_task)
        derived["block_table_offset"] = offset
        offset = align_up(offset + 4 * self.max_seqs_per_task * self.max_blocks_per_seq)
        derived["q_offset"] = offset
        offset = align_up(offset + self.staging_bytes)
        derived["out_offset"] = offset
        offset = align_up(offset + self.staging_bytes)
        derived["kv_offset"] = offset
        derived["kv_layer_bytes"] = (0 if self.kv_in_pool else
                                     align_up(self.num_remote_blocks * self.kv_block_bytes))
        derived["total_bytes"] = offset + self.shape.num_layers * derived["kv_layer_bytes"]
        for name, value in derived.items():
            object.__setattr__(self, name, value)

    @property
    def staging_shape(self) -> tuple[int, int, int]:
        """[max_seqs_per_task, num_q_heads, head_size] for q and output staging."""
        return (self.max_seqs_per_task, self.shape.num_q_heads, self.shape.head_size)

    @property
    def staging_bytes(self) -> int:
        num_seqs, num_heads, head_size = self.staging_shape
        return num_seqs * num_heads * head_size * self.shape.itemsize

    @property
    def kv_layer_shape(self) -> tuple[int, int, int, int]:
        """vLLM's per-layer cache view [num_blocks, num_kv_heads, block_size, 2*D], K and V
        in it as shape.kv_format says (no blocks when the KV lives in the unified pool)."""
        s = self.shape
        num_blocks = 0 if self.kv_in_pool else self.num_remote_blocks
        return (num_blocks, s.num_kv_heads, s.block_size, 2 * s.head_size)

    @property
    def kv_block_bytes(self) -> int:
        s = self.shape
        return s.num_kv_heads * s.block_size * 2 * s.head_size * s.itemsize

    @property
    def max_tokens_per_seq(self) -> int:
        return self.max_blocks_per_seq * self.shape.block_size

    def kv_layer_offset(self, layer: int) -> int:
        if not 0 <= layer < self.shape.num_layers:
            raise ValueError(f"layer {layer} out of range [0, {self.shape.num_layers})")
        return self.kv_offset + layer * self.kv_layer_bytes

    def _layout_values(self) -> dict[str, int]:
        s = self.shape
        return {
            "version": REGION_VERSION,
            "total_bytes": self.total_bytes,
            "num_layers": s.num_layers,
            "num_q_heads": s.num_q_heads,
            "num_kv_heads": s.num_kv_heads,
            "head_size": s.head_size,
            "block_size": s.block_size,
            "dtype_code": _DTYPES[s.dtype][0],
            "num_remote_blocks": self.num_remote_blocks,
            "max_seqs_per_task": self.max_seqs_per_task,
            "max_blocks_per_seq": self.max_blocks_per_seq,
            "kv_in_pool": int(self.kv_in_pool),
            "kv_format_code": KV_FORMATS[s.kv_format],
        }

    def pack_header(self) -> bytes:
        """Magic + layout description; the counters that follow start at zero."""
        values = self._layout_values()
        return _LAYOUT_STRUCT.pack(REGION_MAGIC, *(values[name] for name in _LAYOUT_FIELDS))

    def initial_header(self, owner_pid: int) -> bytes:
        """The whole header of a region its owner has just created: magic, layout, the
        owner's pid and status INITIALIZING; the counters at zero."""
        header = bytearray(HEADER_BYTES)
        packed = self.pack_header()
        header[: len(packed)] = packed
        struct.pack_into("<q", header, OWNER_PID_OFFSET, owner_pid)
        struct.pack_into("<q", header, STATUS_OFFSET, int(RegionStatus.INITIALIZING))
        return bytes(header)

    def verify_header(self, buffer: bytes | bytearray | memoryview) -> None:
        """Raise ValueError naming every field where the region differs from this layout."""
        found = read_header_fields(buffer)
        expected = self._layout_values()
        mismatches = [
            f"{name}: region has {found[name]}, this side expects {expected[name]}"
            for name in _LAYOUT_FIELDS
            if found[name] != expected[name]
        ]
        if mismatches:
            raise ValueError(
                "offload region layout does not match this side's configuration ("
                + "; ".join(mismatches)
                + "). Configure the hot and cold sides with the same hot-model attention "
                "shape, dtype, num_remote_blocks, max_seqs_per_task and max_blocks_per_seq."
            )


def read_header_fields(buffer: bytes | bytearray | memoryview) -> dict[str, int]:
    """Decode the layout part of a region header; ValueError if it is not a Weaver region."""
    if len(buffer) < HEADER_BYTES:
        raise ValueError(
            f"buffer of {len(buffer)} bytes is too small for a Weaver offload region header "
            f"({HEADER_BYTES} bytes); is the region name right?"
        )
    magic, *values = _LAYOUT_STRUCT.unpack_from(buffer, 0)
    if magic != REGION_MAGIC:
        raise ValueError(
            f"not a Weaver offload region (magic {magic!r}, expected {REGION_MAGIC!r}); "
            "the name may belong to another program or the owner has not finished creating it"
        )
    return dict(zip(_LAYOUT_FIELDS, values, strict=True))
