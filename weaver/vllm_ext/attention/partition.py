"""One step's attention batch cut into groups of requests, with vLLM's own micro-batch
slicing (``vllm/v1/worker/ubatch_utils.py: split_attn_metadata``).

``split_attn_metadata`` slices a ``CommonAttentionMetadata`` by contiguous request ranges
for any backend; each backend's builder then makes its own metadata for a slice, as it
does for vLLM's micro-batches. Weaving needs groups that are not contiguous (a hot step's
local and remote requests interleave), so ``reorder_requests`` first puts the batch in
group order, remembering where each token came from; the attention of a request depends
only on its own query rows, KV blocks and length, so the groups give the very rows the
whole batch would.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.worker.ubatch_utils import UBatchSlice, split_attn_metadata

# Per-request fields reorder_requests does not permute: a batch that sets one of them (a
# feature Weaver's engines do not use: context parallelism, multimodal prefix LM, ...)
# cannot be split, and says so instead of attending with misaligned metadata.
_UNSUPPORTED_FIELDS = ("dcp_local_seq_lens", "encoder_seq_lens", "mm_req_doc_ranges",
                       "rswa_prefix_lens", "replayssm_decode_base_cpu",
                       "logits_indices_padded", "req_idx")


@dataclasses.dataclass(frozen=True)
class RequestGroup:
    """One group of a split batch: its own metadata (what split_attn_metadata made) and
    the indices of its query rows in the batch."""

    common: CommonAttentionMetadata
    tokens: torch.Tensor  # int64, on the batch's device


def query_lens(cm: CommonAttentionMetadata) -> torch.Tensor:
    """Query tokens of each request (host tensor)."""
    qsl = cm.query_start_loc_cpu[: cm.num_reqs + 1].to(torch.int64)
    return qsl[1:] - qsl[:-1]


def reorder_requests(cm: CommonAttentionMetadata,
                     order: torch.Tensor) -> tuple[CommonAttentionMetadata, torch.Tensor]:
    """cm with its requests in `order` (int64 host indices), and for each token of the
    reordered batch the index of that token in cm's batch."""
    unsupported = [name for name in _UNSUPPORTED_FIELDS if getattr(cm, name) is not None]
    if unsupported or isinstance(cm.causal, torch.Tensor):
        raise NotImplementedError(
            f"weaving cannot split a batch that uses {unsupported or ['dynamic causal']}; "
            "serve this model without weaving")
    qsl = cm.query_start_loc_cpu.to(torch.int64)
    starts = qsl[order]
    lens = qsl[order + 1] - starts
    new_qsl = torch.zeros(len(order) + 1, dtype=torch.int32)
    torch.cumsum(lens, 0, out=new_qsl[1:])
    num_tokens = int(new_qsl[-1])
    token_index = (torch.arange(num_tokens, dtype=torch.int64)
                   + torch.repeat_interleave(starts - new_qsl[:-1].to(torch.int64), lens))
    device = cm.query_start_loc.device
    order_on, tokens_on = order.to(device), token_index.to(device)

    def host(tensor: torch.Tensor | None) -> torch.Tensor | None:
        return None if tensor is None else tensor[order]

    reordered = dataclasses.replace(
        cm,
        query_start_loc=new_qsl.to(device),
        query_start_loc_cpu=new_qsl,
        seq_lens=cm.seq_lens[order_on],
        seq_lens_cpu_upper_bound=host(cm.seq_lens_cpu_upper_bound),
        is_prefilling=host(cm.is_prefilling),
        num_reqs=len(order),
        num_actual_tokens=num_tokens,
        block_table_tensor=cm.block_table_tensor[order_on],
        slot_mapping=cm.slot_mapping[tokens_on],
        positions=None if cm.positions is None else cm.positions[tokens_on],
    )
    return reordered, tokens_on


def split_requests(cm: CommonAttentionMetadata,
                   groups: Sequence[torch.Tensor]) -> list[RequestGroup | None]:
    """Each group of request indices (ascending, disjoint) as a batch of its own; None for
    an empty group."""
    nonempty = [g for g in groups if g.numel()]
    if not nonempty:
        return [None] * len(groups)
    reordered, token_index = reorder_requests(cm, torch.cat(nonempty))
    qsl = reordered.query_start_loc_cpu
    slices, first = [], 0
    for group in nonempty:
        last = first + group.numel()
        slices.append(UBatchSlice(slice(first, last), slice(int(qsl[first]), int(qsl[last]))))
        first = last
    parts = iter(split_attn_metadata(slices, reordered))
    bounds = iter(slices)
    result: list[RequestGroup | None] = []
    for group in groups:
        if not group.numel():
            result.append(None)
            continue
        tokens = next(bounds).token_slice
        result.append(RequestGroup(next(parts), token_index[tokens.start:tokens.stop]))
    return result


def split_contiguous(cm: CommonAttentionMetadata, bounds: Sequence[tuple[int, int]]
                     ) -> list[tuple[slice, CommonAttentionMetadata]]:
    """Contiguous request ranges [start, end) as batches of their own, each with the slice
    of query rows it owns (no reordering: views of the batch's tensors)."""
    qsl = cm.query_start_loc_cpu
    slices = [UBatchSlice(slice(lo, hi), slice(int(qsl[lo]), int(qsl[hi]))) for lo, hi in bounds]
    return [(s.token_slice, part) for s, part in zip(slices, split_attn_metadata(slices, cm),
                                                      strict=True)]


def rebase_block_table(cm: CommonAttentionMetadata, first_block_id: int) -> CommonAttentionMetadata:
    """cm with block ids counted from first_block_id (the remote pool's first id); the
    padding columns (vLLM's null block 0) become 0 too, as the kernels never read them."""
    table = (cm.block_table_tensor - first_block_id).clamp_(min=0)
    return dataclasses.replace(cm, block_table_tensor=table)
