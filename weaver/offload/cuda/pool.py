"""Writing K/V into the remote pool on the device, in the layout the CUDA kernels read.

Layer view [num_blocks, num_kv_heads, block_size, 2*head_size] in one of the region's KV
formats (weaver/offload/layout.py KV_FORMATS): "pages", each (block, head) page K
[block_size, head_size] then V (reference_attention.py key_layout "nd"), or "token", each
token's row K then V (the GPU backends' own cache update writes the same). Plain torch
indexing, so it runs on any device and on the hot side's stream (one-sided writes into
the peer-mapped pool) where no backend kernel does the write.
"""

from __future__ import annotations

import torch


def write_kv(
    kv_layer: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor,
    kv_format: str = "pages",
) -> None:
    """Store key/value [T, num_kv_heads, head_size] at slots block * block_size + offset."""
    num_blocks, num_kv_heads, block_size, two_d = kv_layer.shape
    head_size = two_d // 2
    expected = (key.shape[0], num_kv_heads, head_size)
    if tuple(key.shape) != expected or tuple(value.shape) != expected:
        raise ValueError(
            f"key and value must be [num_tokens, {num_kv_heads}, {head_size}], got "
            f"{tuple(key.shape)} and {tuple(value.shape)}"
        )
    if slot_mapping.shape != (key.shape[0],):
        raise ValueError(f"slot_mapping must be [{key.shape[0]}], got {tuple(slot_mapping.shape)}")
    slots = slot_mapping.to(device=kv_layer.device, dtype=torch.int64)
    blocks = torch.div(slots, block_size, rounding_mode="floor")
    offsets = slots % block_size
    # advanced indices around a slice: the result dims are [T, num_kv_heads, head_size]
    if kv_format == "token":
        kv_layer[blocks, :, offsets, :head_size] = key.to(kv_layer.device, kv_layer.dtype)
        kv_layer[blocks, :, offsets, head_size:] = value.to(kv_layer.device, kv_layer.dtype)
        return
    if kv_format != "pages":
        raise ValueError(f"kv_format must be 'pages' or 'token', got {kv_format!r}")
    pages = kv_layer.view(num_blocks, num_kv_heads, 2, block_size, head_size)
    pages[blocks, :, 0, offsets] = key.to(kv_layer.device, kv_layer.dtype)
    pages[blocks, :, 1, offsets] = value.to(kv_layer.device, kv_layer.dtype)
