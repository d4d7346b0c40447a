"""Host wrappers of the offload kernels: validate, then launch on the current stream.

One function per kernel (style.md "Kernels"). Validation happens before anything touches
a device, so the checks run on CPU or meta tensors in the CPU tests. Launches go on
``torch.cuda.current_stream()`` through CuPy (see jit.KernelLibrary), so they follow the
caller's stream order and can be captured into a CUDA graph.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from weaver.offload.cuda.region_desc import (
    BLOCK_SIZE_MULTIPLE,
    HEAD_SIZE_MULTIPLE,
    MAX_HEAD_SIZE,
)
from weaver.offload.layout import KV_FORMATS

if TYPE_CHECKING:
    from weaver.offload.cuda.jit import KernelLibrary

ATTENTION_FILE = "paged_attention.cu"
HOT_FILE = "offload_hot.cu"
COLD_FILE = "offload_cold.cu"
NUM_THREADS = 256  # csrc/paged_attention.cuh kThreads
MAX_GROUP = 4  # csrc/paged_attention.cuh kMaxGroup: query heads one work item serves
SCRATCH_WORDS = 8  # csrc/offload_cold.cu kScratchWords: the cold side's serving state

DTYPE_SUFFIX: dict[torch.dtype, str] = {
    torch.float32: "f32",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
}


def validate_attention_inputs(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    on_one_device: bool = True,
) -> None:
    """Raise ValueError unless the tensors fit weaver_paged_attention_* (see its .cu);
    on_one_device=False lets them live on a peer of the launching device."""
    if q.dtype not in DTYPE_SUFFIX:
        raise ValueError(f"q dtype {q.dtype} unsupported; use float32, float16 or bfloat16")
    if q.dim() != 3:
        raise ValueError(f"q must be [num_seqs, num_q_heads, head_size], got {tuple(q.shape)}")
    num_seqs, num_q_heads, head_size = q.shape
    if kv_layer.dim() != 4 or kv_layer.shape[3] != 2 * head_size:
        raise ValueError(
            "kv_layer must be [num_blocks, num_kv_heads, block_size, 2*head_size] "
            f"(2*head_size = {2 * head_size}), got {tuple(kv_layer.shape)}"
        )
    _, num_kv_heads, block_size, _ = kv_layer.shape
    if kv_layer.dtype != q.dtype:
        raise ValueError(f"kv_layer dtype {kv_layer.dtype} != q dtype {q.dtype}")
    if num_q_heads % num_kv_heads:
        raise ValueError(
            f"num_q_heads {num_q_heads} is not a multiple of num_kv_heads {num_kv_heads}"
        )
    if head_size > MAX_HEAD_SIZE:
        raise ValueError(f"head_size {head_size} > {MAX_HEAD_SIZE}, the kernel's maximum")
    if head_size % HEAD_SIZE_MULTIPLE:
        raise ValueError(
            f"head_size {head_size} is not a multiple of {HEAD_SIZE_MULTIPLE}: the kernel "
            "reads K/V rows in 16-byte vectors"
        )
    if block_size % BLOCK_SIZE_MULTIPLE:
        raise ValueError(f"block_size {block_size} must be a multiple of {BLOCK_SIZE_MULTIPLE}")
    if seq_lens.dtype != torch.int32 or tuple(seq_lens.shape) != (num_seqs,):
        raise ValueError(
            f"seq_lens must be int32 [{num_seqs}], got {seq_lens.dtype} {tuple(seq_lens.shape)}"
        )
    if (
        block_table.dtype != torch.int32
        or block_table.dim() != 2
        or block_table.shape[0] != num_seqs
    ):
        raise ValueError(
            f"block_table must be int32 [{num_seqs}, max_blocks], got {block_table.dtype} "
            f"{tuple(block_table.shape)}"
        )
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype):
        raise ValueError(f"out must match q ({tuple(q.shape)}, {q.dtype})")
    tensors = [q, kv_layer, seq_lens, block_table] + ([out] if out is not None else [])
    for tensor in tensors:
        if not tensor.is_contiguous():
            raise ValueError("every tensor must be contiguous; call .contiguous() first")
    if on_one_device:
        check_same_cuda_device(*tensors)
    elif any(t.device.type != "cuda" for t in tensors):
        raise ValueError("tensors must be on CUDA devices")


def check_same_cuda_device(*tensors: torch.Tensor) -> None:
    devices = {t.device for t in tensors}
    if any(d.type != "cuda" for d in devices):
        raise ValueError(f"tensors must be on a CUDA device, got {sorted(map(str, devices))}")
    if len(devices) != 1:
        raise ValueError(f"tensors must be on one CUDA device, got {sorted(map(str, devices))}")


def paged_decode_attention(
    library: KernelLibrary,
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    *,
    sliding_window: int = -1,
    softcap: float = 0.0,
    out: torch.Tensor | None = None,
    error_flag: torch.Tensor | None = None,
    num_blocks: int | None = None,
    kv_format: str = "pages",
) -> torch.Tensor:
    """out[s, h] = softmax(q[s, h] . K_s^T * scale) V_s over the paged pool, K and V in it
    as kv_format says (weaver/offload/layout.py KV_FORMATS).

    seq_lens must be in [1, block_table columns * block_size] and block ids in range;
    the kernel writes zeros and sets error_flag[0] = 1 for an item that breaks either,
    instead of reading out of bounds (checking here would need a device sync).
    num_blocks: grid size; default one block per work item (attention_items).
    """
    validate_attention_inputs(q, kv_layer, seq_lens, block_table, out)
    out = torch.empty_like(q) if out is None else out
    num_items = attention_items(q.shape[0], q.shape[1], kv_layer.shape[1])
    grid = num_items if num_blocks is None else max(1, min(num_blocks, num_items))
    fn = library.function(
        ATTENTION_FILE, kernel_name("weaver_paged_attention", q.dtype, q.shape[2])
    )
    args = _attention_args(q, kv_layer, seq_lens, block_table, out, scale, sliding_window,
                           softcap, kv_format, error_flag)
    launch(fn, grid, NUM_THREADS, args, q.device)
    return out


def _attention_args(q: torch.Tensor, kv_layer: torch.Tensor, seq_lens: torch.Tensor,
                    block_table: torch.Tensor, out: torch.Tensor, scale: float,
                    sliding_window: int, softcap: float, kv_format: str,
                    error_flag: torch.Tensor | None) -> tuple[Any, ...]:
    """The arguments every weaver_paged_attention* kernel takes first, in its order
    (csrc/paged_attention.cu WEAVER_ATTENTION_PARAMS)."""
    return (
        _ptr(q), _ptr(kv_layer), _ptr(seq_lens), _ptr(block_table), _ptr(out),
        np.int32(q.shape[0]), np.int32(q.shape[1]), np.int32(kv_layer.shape[1]),
        np.int32(q.shape[2]), np.int32(kv_layer.shape[2]), np.int32(block_table.shape[1]),
        np.int32(kv_layer.shape[0]), np.int32(sliding_window), np.float32(scale),
        np.float32(softcap), np.int32(KV_FORMATS[kv_format]), _ptr(error_flag),
    )  # fmt: skip


def paged_decode_attention_if_failed(
    library: KernelLibrary,
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    *,
    wait_status: torch.Tensor,
    num_fallbacks: torch.Tensor,
    sliding_window: int = -1,
    softcap: float = 0.0,
    kv_format: str = "pages",
    error_flag: torch.Tensor | None = None,
) -> None:
    """paged_decode_attention into `out`, only if the device wait that wrote wait_status
    did not end OK; then num_fallbacks[0] += 1. Launched on the current stream of the
    library's device (the hot stream, after the wait); the attention's tensors may live on
    a peer device (the region on the cold GPU, mapped through CUDA IPC)."""
    validate_attention_inputs(q, kv_layer, seq_lens, block_table, out, on_one_device=False)
    device = torch.device("cuda", library.device_index)
    if wait_status.dtype != torch.int32 or wait_status.device != device:
        raise ValueError(f"wait_status must be the int32 status of a device wait on {device}")
    if num_fallbacks.dtype != torch.int64 or num_fallbacks.device != device:
        raise ValueError(f"num_fallbacks must be an int64 counter on {device}")
    fn = library.function(
        ATTENTION_FILE, kernel_name("weaver_paged_attention_if_failed", q.dtype, q.shape[2]))
    args = (*_attention_args(q, kv_layer, seq_lens, block_table, out, scale, sliding_window,
                             softcap, kv_format, error_flag),
            _ptr(wait_status), _ptr(num_fallbacks))
    launch(fn, attention_items(q.shape[0], q.shape[1], kv_layer.shape[1]), NUM_THREADS, args,
           device)


def attention_items(num_seqs: int, num_q_heads: int, num_kv_heads: int) -> int:
    """Thread blocks of work in one attention call: one per (sequence, KV head, chunk of
    up to MAX_GROUP of its query heads), as csrc/paged_attention.cuh splits it."""
    group = num_q_heads // num_kv_heads
    return num_seqs * num_kv_heads * -(-group // MAX_GROUP)


def publish(
    library: KernelLibrary,
    region: torch.Tensor,
    desc: torch.Tensor,
    *,
    seq: int,
    layer: int,
    num_seqs: int,
    scale: float,
    sliding_window: int = -1,
    softcap: float = 0.0,
    stamp: torch.Tensor | None = None,
) -> None:
    """Write the task metadata and release-store task_seq = seq (one thread)."""
    _check_region_args(region, desc)
    if seq < 1 or layer < 0 or num_seqs < 1:
        raise ValueError(f"bad task: seq {seq}, layer {layer}, num_seqs {num_seqs}")
    _check_stamp(stamp, desc.device)
    fn = library.function(HOT_FILE, "weaver_publish")
    args = (
        _ptr(region), _ptr(desc), np.int64(seq), np.int64(layer), np.int64(num_seqs),
        np.int64(sliding_window), np.float64(scale), np.float64(softcap), _ptr(stamp),
    )  # fmt: skip
    launch(fn, 1, 1, args, desc.device)


def wait_done(
    library: KernelLibrary,
    region: torch.Tensor,
    desc: torch.Tensor,
    status: torch.Tensor,
    *,
    seq: int,
    timeout_s: float,
    backoff_ns: int = 0,
    stamp: torch.Tensor | None = None,
) -> None:
    """Spin on the device until done_seq >= seq or timeout_s; writes status[0] (WaitStatus)
    and status[1] (number of polls). Kernels after it read the output only on OK."""
    _check_region_args(region, desc)
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    if status.dtype != torch.int32 or status.numel() < 2 or status.device != desc.device:
        raise ValueError("status must be an int32 tensor of >= 2 words on the caller's device")
    _check_stamp(stamp, desc.device)
    fn = library.function(HOT_FILE, "weaver_wait_done")
    args = (
        _ptr(region), _ptr(desc), np.int64(seq), np.uint64(int(timeout_s * 1e9)),
        np.uint32(backoff_ns), _ptr(status), _ptr(stamp),
    )  # fmt: skip
    launch(fn, 1, 1, args, desc.device)


def poll_and_attend(
    library: KernelLibrary,
    dtype: torch.dtype,
    region: torch.Tensor,
    desc: torch.Tensor,
    scratch: torch.Tensor,
    stop_flag: torch.Tensor,
    *,
    head_size: int,
    num_blocks: int,
    max_spin_s: float = 0.0,
) -> None:
    """Serve a pending task, if any (max_spin_s = 0: return at once when idle), else keep
    polling until stop_flag[0] != 0 or max_spin_s passes."""
    _check_region_args(region, desc)
    if dtype not in DTYPE_SUFFIX:
        raise ValueError(f"dtype {dtype} unsupported")
    _check_scratch(scratch, stop_flag, region)
    if num_blocks < 1 or max_spin_s < 0:
        raise ValueError("num_blocks must be >= 1 and max_spin_s >= 0")
    fn = library.function(COLD_FILE, kernel_name("weaver_poll_and_attend", dtype, head_size))
    args = (
        _ptr(region),
        _ptr(desc),
        _ptr(scratch),
        _ptr(stop_flag),
        np.uint64(int(max_spin_s * 1e9)),
    )
    launch(fn, num_blocks, NUM_THREADS, args, region.device)


def watch(
    library: KernelLibrary,
    region: torch.Tensor,
    desc: torch.Tensor,
    scratch: torch.Tensor,
    stop_flag: torch.Tensor,
    *,
    max_spin_s: float,
    backoff_ns: int = 64,
) -> None:
    """One thread spins until a task is pending, stop_flag[0] != 0 or max_spin_s passes,
    and arms the attend_armed launched after it on the same stream with the pending seq."""
    _check_region_args(region, desc)
    _check_scratch(scratch, stop_flag, region)
    if max_spin_s <= 0 or backoff_ns < 0:
        raise ValueError(f"max_spin_s must be > 0 and backoff_ns >= 0, got {max_spin_s}, "
                         f"{backoff_ns}")
    fn = library.function(COLD_FILE, "weaver_watch")
    args = (_ptr(region), _ptr(desc), _ptr(scratch), _ptr(stop_flag),
            np.uint64(int(max_spin_s * 1e9)), np.uint32(backoff_ns))
    launch(fn, 1, 32, args, region.device)


def attend_armed(
    library: KernelLibrary,
    dtype: torch.dtype,
    region: torch.Tensor,
    desc: torch.Tensor,
    scratch: torch.Tensor,
    partial: torch.Tensor,
    span_count: torch.Tensor,
    *,
    head_size: int,
    num_blocks: int,
    span_tokens: int,
) -> None:
    """Serve the task the watch before it armed (nothing if none) with num_blocks blocks,
    splitting the context of a task of few items into spans of span_tokens tokens.
    partial: float32 [max_units * partial_floats(head_size)]; span_count: int32
    [max_units], zeroed once."""
    _check_region_args(region, desc)
    if dtype not in DTYPE_SUFFIX:
        raise ValueError(f"dtype {dtype} unsupported")
    floats = partial_floats(head_size)
    if (partial.dtype != torch.float32 or partial.device != region.device
            or partial.numel() % floats):
        raise ValueError(f"partial must be float32 [max_units * {floats}] on the region's device")
    max_units = partial.numel() // floats
    if (span_count.dtype != torch.int32 or span_count.device != region.device
            or span_count.numel() < max_units):
        raise ValueError(f"span_count must be int32 [>= {max_units}] on the region's device")
    if num_blocks < 1 or span_tokens < 1:
        raise ValueError("num_blocks and span_tokens must be >= 1")
    fn = library.function(COLD_FILE, kernel_name("weaver_attend_armed", dtype, head_size))
    args = (_ptr(region), _ptr(desc), _ptr(scratch), _ptr(partial), _ptr(span_count),
            np.int32(max_units), np.int32(span_tokens))
    launch(fn, num_blocks, NUM_THREADS, args, region.device)


def partial_floats(head_size: int) -> int:
    """Floats of one span's softmax state (csrc/paged_attention.cuh partial_floats)."""
    return MAX_GROUP * (2 + head_size)


def kernel_name(base: str, dtype: torch.dtype, head_size: int) -> str:
    """The instantiation for dtype and head size. An fp32 row longer than 128 elements
    takes two 16-byte vectors per lane, so _h256 holds twice the registers of _h128 for
    fp32; fp16/bf16 rows fit one vector per lane at every size (csrc/paged_attention.cu)."""
    if not 1 <= head_size <= MAX_HEAD_SIZE:
        raise ValueError(f"head_size {head_size} outside [1, {MAX_HEAD_SIZE}]")
    return f"{base}_{DTYPE_SUFFIX[dtype]}_{'h128' if head_size <= 128 else 'h256'}"


# --- helpers --------------------------------------------------------------------------
def _check_region_args(region: torch.Tensor, desc: torch.Tensor) -> None:
    if region.dtype != torch.uint8 or region.dim() != 1:
        raise ValueError("region must be the flat uint8 tensor of a CudaRegion")
    if desc.dtype != torch.int64 or desc.dim() != 1:
        raise ValueError("desc must be int64 (see region_desc.region_descriptor)")
    if desc.device.type != "cuda":
        raise ValueError(f"desc must be on a CUDA device, got {desc.device}")


def _check_scratch(scratch: torch.Tensor, stop_flag: torch.Tensor, region: torch.Tensor) -> None:
    if (scratch.dtype != torch.int64 or scratch.numel() < SCRATCH_WORDS
            or scratch.device != region.device):
        raise ValueError(f"scratch must be int64 [>= {SCRATCH_WORDS}] on the region's device, "
                         "zeroed once")
    if stop_flag.dtype != torch.int32 or stop_flag.device != region.device:
        raise ValueError("stop_flag must be an int32 tensor on the region's device")


def _check_stamp(stamp: torch.Tensor | None, device: torch.device) -> None:
    if stamp is not None and (stamp.dtype != torch.int64 or stamp.device != device):
        raise ValueError(f"stamp must be an int64 tensor on {device}")


def _ptr(tensor: torch.Tensor | None) -> np.uint64:
    return np.uint64(0 if tensor is None else tensor.data_ptr())


def launch(fn: Any, grid: int, block: int, args: tuple[Any, ...], device: torch.device) -> None:
    """Launch a cupy.RawKernel on torch's current stream of `device`."""
    import cupy

    index = torch.cuda.current_device() if device.index is None else device.index
    stream = torch.cuda.current_stream(index)
    with cupy.cuda.Device(index), cupy.cuda.ExternalStream(stream.cuda_stream, index):
        fn((grid,), (block,), args)
