"""The cold model's attention split along the sequence dimension (architecture.md part 7).

With ``attn: n`` in the split plan, each attention layer of the cold engine runs its batch
as ``n`` groups of whole sequences, one CPU_ATTN kernel per group, and calls the cold
worker's poll between groups, so an offloaded task waits behind one group's attention,
not the whole batch's. Groups are contiguous runs of requests cut where the cumulative
work (query tokens × context, what the kernel's time follows) crosses k/n of the total.

Why whole sequences and not parts of one sequence's context: vLLM's CPU kernel returns
the normalised output without its log-sum-exp, so partial results over a cut context
could not be merged exactly; sequences are independent, so groups give the very same
rows (token-identical, tests/splitting). A batch with fewer sequences than chunks runs
as one group per sequence.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from weaver.vllm_ext.attention_rows import BatchRows, attend_rows, select_rows

if TYPE_CHECKING:
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadata

logger = logging.getLogger(__name__)

ATTN_OP_NAME = "attn"


def group_bounds(work: list[int], num_chunks: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) ranges of requests, at most ``num_chunks`` of them, none
    empty, balanced by ``work`` (one positive number per request)."""
    num_reqs = len(work)
    if num_chunks < 1:
        raise ValueError(f"num_chunks must be >= 1, not {num_chunks}")
    if num_reqs == 0:
        return []
    if num_chunks >= num_reqs:
        return [(i, i + 1) for i in range(num_reqs)]
    # Greedy, front to back: close a group before the request that would take it past
    # its fair share of the work still to place (remaining work / groups left).
    cuts, remaining, group_work = [], sum(work), 0
    for i, w in enumerate(work):
        groups_left = num_chunks - len(cuts)
        if group_work and groups_left > 1 and (group_work + w) * groups_left > remaining:
            cuts.append(i)
            remaining -= group_work
            group_work = 0
        group_work += w
    bounds, start = [], 0
    for end in [*cuts, num_reqs]:
        bounds.append((start, end))
        start = end
    return bounds


class _StepGroups:
    """The step's groups; every layer of a step shares the attention metadata object,
    so they (and vLLM's scheduler metadata per group) are built once per step."""

    def __init__(self) -> None:
        self.metadata: Any = None
        self.key: tuple = ()
        self.groups: list[BatchRows] = []

    def of(self, md: CPUAttentionMetadata, num_chunks: int, impl: Any) -> list[BatchRows]:
        key = (num_chunks, impl.num_heads, impl.num_kv_heads, impl.head_size)
        if self.metadata is md and self.key == key:
            return self.groups
        num_reqs = md.seq_lens.shape[0]
        query_lens = (md.query_start_loc[1:num_reqs + 1]
                      - md.query_start_loc[:num_reqs]).to(torch.int64)
        work = (query_lens * md.seq_lens[:num_reqs].to(torch.int64)).tolist()
        self.groups = [select_rows(md, torch.arange(lo, hi, dtype=torch.int64))
                       for lo, hi in group_bounds(work, num_chunks)]
        self.metadata, self.key = md, key
        return self.groups


_step_groups = _StepGroups()  # one engine (one worker) per process


class AttentionChunks:
    """One attention layer's split: ``num_chunks`` groups of sequences, a poll between."""

    op_name = ATTN_OP_NAME

    def __init__(self, num_chunks: int) -> None:
        if num_chunks < 2:
            raise ValueError(f"an attention split needs >= 2 chunks, not {num_chunks}")
        self.num_chunks = num_chunks
        self.poll: Callable[[], Any] | None = None  # set by the cold worker
        self.num_calls = 0
        self.num_chunk_calls = 0
        self.num_polls = 0

    def run(self, impl: Any, layer: Any, query: torch.Tensor, output: torch.Tensor,
            kv_cache: torch.Tensor, md: CPUAttentionMetadata) -> torch.Tensor:
        groups = _step_groups.of(md, self.num_chunks, impl)
        for i, rows in enumerate(groups):
            if i and self.poll is not None:
                self.poll()
                self.num_polls += 1
            attend_rows(impl, layer, query, output, kv_cache, md, rows)
        self.num_calls += 1
        self.num_chunk_calls += len(groups)
        return output

    def stats(self) -> dict[str, int]:
        return {"chunks": self.num_chunks, "calls": self.num_calls,
                "chunk_calls": self.num_chunk_calls, "polls": self.num_polls}
