"""Pure-torch paged decode attention over vLLM CPU_ATTN's pool layout: the test oracle.

Pool layer view ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``; each
(block, head) page of ``block_size * 2 * head_size`` elements holds K then V
(``cpu_attn.py`` ``forward``: ``kv_cache.view(B, H, 2N, D).chunk(2, dim=2)``).
Inside the K half the element order depends on who wrote it:

- ``"nd"``: token-major ``[N, D]`` (token-major: what vLLM's other ISAs and this oracle write);
- ``"dn"``: dimension-major ``[D, N]``, which is what vLLM 0.32's
  ``cpu_attn_reshape_and_cache`` writes for the ``vec``/``vec16`` ISAs (checked by
  tests/offload/test_cpu_executor.py). V is ``[N, D]`` in both.

- ``"token"``: the GPU backends' format (layout.KV_FORMATS "token"): each token's row of
  the view holds K then V, ``kv_layer.split(head_size, dim=-1)``.

Other vLLM ISAs (amx, neon) pack K differently, so the oracle is fed a pool written by
``write_kv_reference`` with the same dense K/V, not the kernel's own pool.
"""

from __future__ import annotations

import torch

KEY_LAYOUTS = ("nd", "dn", "token")  # "nd"/"dn": the "pages" KV format; "token": its own


def key_layout_of(kv_format: str) -> str:
    """The oracle's key layout for a region's KV format (layout.KV_FORMATS): pages as
    Weaver's own writers lay them out ("nd"), or the GPU backends' token rows."""
    return "token" if kv_format == "token" else "nd"


def _split_pages(kv_layer: torch.Tensor,
                 key_layout: str = "nd") -> tuple[torch.Tensor, torch.Tensor]:
    """K and V views [num_blocks, num_kv_heads, block_size, D] (K as stored for "dn")."""
    num_blocks, num_kv_heads, block_size, two_d = kv_layer.shape
    if two_d % 2:
        raise ValueError(f"last dim of the KV layer must be 2*head_size, got {two_d}")
    if key_layout == "token":
        return kv_layer[..., : two_d // 2], kv_layer[..., two_d // 2:]
    pages = kv_layer.reshape(num_blocks, num_kv_heads, 2 * block_size, two_d // 2)
    return pages[:, :, :block_size], pages[:, :, block_size:]


def write_kv_reference(
    kv_layer: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    key_layout: str = "nd",
) -> None:
    """Write key/value [T, num_kv_heads, D] into slots (block * block_size + offset)."""
    if key_layout not in KEY_LAYOUTS:
        raise ValueError(f"key_layout must be one of {KEY_LAYOUTS}, got {key_layout!r}")
    block_size = kv_layer.shape[2]
    k_pages, v_pages = _split_pages(kv_layer, key_layout)
    blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")
    offsets = slot_mapping % block_size
    for t in range(key.shape[0]):
        b, o = int(blocks[t]), int(offsets[t])
        if key_layout in ("nd", "token"):
            k_pages[b, :, o, :] = key[t]
        else:
            # [N, D] page memory read as [D, N]: column o holds token o's key
            k_pages[b].view(k_pages.shape[1], -1, block_size)[:, :, o] = key[t]
        v_pages[b, :, o, :] = value[t]


def gather_kv_reference(
    kv_layer: torch.Tensor, block_ids: torch.Tensor, seq_len: int, key_layout: str = "nd"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense K and V [num_kv_heads, seq_len, D] of one sequence."""
    if key_layout not in KEY_LAYOUTS:
        raise ValueError(f"key_layout must be one of {KEY_LAYOUTS}, got {key_layout!r}")
    _, num_kv_heads, block_size, two_d = kv_layer.shape
    head_size = two_d // 2
    k_pages, v_pages = _split_pages(kv_layer, key_layout)
    num_blocks = -(-seq_len // block_size)
    ids = block_ids[:num_blocks].long()
    k = k_pages[ids]  # [nb, H, N, D] as stored
    if key_layout == "dn":
        k = k.reshape(num_blocks, num_kv_heads, head_size, block_size).transpose(2, 3)
    v = v_pages[ids]
    k = k.transpose(0, 1).reshape(num_kv_heads, num_blocks * block_size, head_size)
    v = v.transpose(0, 1).reshape(num_kv_heads, num_blocks * block_size, head_size)
    return k[:, :seq_len], v[:, :seq_len]


def paged_decode_attention_reference(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    *,
    sliding_window: int = -1,
    softcap: float = 0.0,
    key_layout: str = "nd",
) -> torch.Tensor:
    """One decode token per sequence: q [S, Hq, D] -> out [S, Hq, D] (q's dtype).

    Computed in float32. GQA: query head h reads KV head h // (Hq // Hkv), as vLLM does.
    sliding_window > 0 keeps the last `sliding_window` keys (the new token included).
    """
    num_seqs, num_q_heads, head_size = q.shape
    num_kv_heads = kv_layer.shape[1]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads {num_q_heads} not a multiple of num_kv_heads {num_kv_heads}")
    group = num_q_heads // num_kv_heads
    out = torch.empty(num_seqs, num_q_heads, head_size, dtype=torch.float32, device=q.device)
    for i in range(num_seqs):
        seq_len = int(seq_lens[i])
        k, v = gather_kv_reference(kv_layer, block_table[i], seq_len, key_layout)
        if sliding_window > 0:
            k, v = k[:, -sliding_window:], v[:, -sliding_window:]
        k = k.float().repeat_interleave(group, dim=0)  # [Hq, L, D]
        v = v.float().repeat_interleave(group, dim=0)
        scores = torch.einsum("hd,hld->hl", q[i].float(), k) * scale
        if softcap > 0:
            scores = torch.tanh(scores / softcap) * softcap
        probs = torch.softmax(scores, dim=-1)
        out[i] = torch.einsum("hl,hld->hd", probs, v)
    return out.to(q.dtype)
