"""weaver/weaving/hot.py's ``AttentionOps`` over the pure-torch oracle, for one layer.

The caches are the region's "pages" KV format (weaver/offload/layout.py): a layer is
[num_blocks, num_kv_heads, block_size, 2 * head_size], each (block, head) page its K rows
then its V rows. The local cache uses it too, so one oracle reads both pools and an
all-local run is the reference a woven run must match token for token.

Decode rows (one query token) go through ``paged_decode_attention_reference``, the
function the cold side's reference executor runs, so a sequence's attention is the same
computation wherever its KV lives; prefill rows (a prompt) attend causally over the
same gathered K/V (``gather_kv_reference``).
"""

from __future__ import annotations

import torch

from weaver.offload.cuda.pool import write_kv
from weaver.offload.reference_attention import (
    gather_kv_reference,
    paged_decode_attention_reference,
)
from weaver.weaving.hot import RowGroup

KEY_LAYOUT = "nd"  # the "pages" format as Weaver's writers lay K out (token-major)


class ReferenceAttentionOps:
    """One layer's attention and cache writes (hot.py AttentionOps) over any pool."""

    def __init__(self, layer_index: int, local_kv: torch.Tensor, scale: float) -> None:
        self.layer_index = layer_index
        self.local_kv = local_kv
        self.scale = scale

    def attend(self, kv_layer: torch.Tensor, rows: RowGroup, query: torch.Tensor,
               output: torch.Tensor) -> None:
        out = attend_rows(kv_layer, rows, query[rows.tokens], self.scale)
        output[rows.tokens] = out.to(output.device)

    def write(self, kv_layer: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              slots: torch.Tensor) -> None:
        # The oracle's layout in two index_puts on any device (tests/offload/test_layout.py
        # checks it writes the oracle's bytes); the pool may be the cold GPU's region.
        write_kv(kv_layer, key, value, slots)


def attend_rows(kv_layer: torch.Tensor, rows: RowGroup, q: torch.Tensor,
                scale: float) -> torch.Tensor:
    """Attention of a group's query rows q [num_rows, num_q_heads, D] over kv_layer, on
    kv_layer's device."""
    q = q.to(kv_layer.device)
    starts = rows.query_start_loc.tolist()
    seq_lens = rows.seq_lens.tolist()
    out = torch.empty_like(q)
    decodes = [i for i in range(rows.num_reqs) if starts[i + 1] - starts[i] == 1]
    if decodes:
        requests = torch.tensor(decodes)
        decode_rows = torch.tensor([starts[i] for i in decodes])
        out[decode_rows] = paged_decode_attention_reference(
            q[decode_rows], kv_layer, rows.seq_lens[requests], rows.block_table[requests],
            scale, key_layout=KEY_LAYOUT,
        )
    for i in sorted(set(range(rows.num_reqs)) - set(decodes)):
        out[starts[i] : starts[i + 1]] = causal_attention(
            q[starts[i] : starts[i + 1]], kv_layer, rows.block_table[i], seq_lens[i], scale)
    return out


def causal_attention(q: torch.Tensor, kv_layer: torch.Tensor, block_ids: torch.Tensor,
                     seq_len: int, scale: float) -> torch.Tensor:
    """A sequence's last len(q) tokens attending causally over its first seq_len tokens
    (in float32, GQA as vLLM: query head h reads KV head h // group)."""
    num_new, num_q_heads, _ = q.shape
    k, v = gather_kv_reference(kv_layer, block_ids, seq_len, KEY_LAYOUT)  # [Hkv, L, D]
    group = num_q_heads // k.shape[0]
    k = k.float().repeat_interleave(group, dim=0)
    v = v.float().repeat_interleave(group, dim=0)
    scores = torch.einsum("thd,hld->htl", q.float(), k) * scale
    query_pos = torch.arange(seq_len - num_new, seq_len, device=q.device)
    key_pos = torch.arange(seq_len, device=q.device)
    scores = scores.masked_fill(key_pos[None, :] > query_pos[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("htl,hld->thd", probs, v).to(q.dtype)
