"""A hot worker's weaving pairs: one step's attention split by where each sequence's KV
lives, locally or on one of the cold engines the hot model weaves into.

The hot scheduler gives the remote sequences of its `i`-th pair block ids in
``[num_local + offset_i, num_local + offset_i + num_remote_blocks_i)`` (``remote_offsets``:
the pairs' remote blocks one after another, in plan order), so the worker tells where a
request's KV lives from its first block id, and where a new token's K/V goes from its slot,
with no side channel. Per layer, each cold side with decode rows gets its task first (all
of them in flight at once), the local rows and every remote prefill run here meanwhile,
then each cold side's output is collected; a cold side that failed falls back alone
(weaving/hot.py), the others keep offloading.

No vLLM here: the attention backend (weaver/vllm_ext/attention/backend.py) builds the
``StepRows`` of a step and calls ``write_kv`` and ``attend`` per layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from weaver.weaving.hot import AttentionOps, HotWeaving, RemoteRows, RowGroup
from weaver.weaving.plan import PairPlan, remote_block_offsets


@dataclass
class StepRows:
    """How one step's batch divides by where each sequence's KV lives. Every layer of the
    step shares it (the backend builds it once per step)."""

    local: RowGroup | None
    remotes: list[RemoteRows]  # one per cold side with rows in the step


@dataclass(frozen=True)
class RequestSplit:
    """Request indices of a step by placement and phase (each ascending): the local ones,
    and per cold side (in plan order) its prefill and decode requests."""

    local: torch.Tensor
    remote: list[tuple[torch.Tensor, torch.Tensor]]
    num_new_remote: list[int]  # per cold side: sequences starting their prefill

    @property
    def has_remote(self) -> bool:
        return any(prefill.numel() or decode.numel() for prefill, decode in self.remote)


def classify_requests(first_block_ids: torch.Tensor, query_lens: torch.Tensor,
                      seq_lens: torch.Tensor, remote_starts: Sequence[int]) -> RequestSplit:
    """Classify a step's requests: a request lives on the `i`-th cold side when its first
    block id is at or above remote_starts[i] (and below the next start; local below the
    first), is a decode when it has one query token, and is new when its first prefill
    chunk is its whole context so far."""
    starts = torch.tensor(list(remote_starts), dtype=first_block_ids.dtype)
    # -1: local; i: the i-th cold side. The ids are a column of the block table: bucketize
    # would copy them anyway, and warn that it did.
    side = torch.bucketize(first_block_ids.contiguous(), starts, right=True) - 1
    is_decode = query_lens == 1
    is_new = seq_lens == query_lens
    remote, num_new = [], []
    for index in range(len(remote_starts)):
        here = side == index
        remote.append((torch.nonzero(here & ~is_decode).flatten(),
                       torch.nonzero(here & is_decode).flatten()))
        num_new.append(int((here & is_new).sum()))
    return RequestSplit(local=torch.nonzero(side < 0).flatten(), remote=remote,
                        num_new_remote=num_new)


@dataclass
class _SlotSplit:
    """Which new tokens' K/V go to the local cache and which to each cold side's pool
    (slot ids rebased to it). Every layer of a step gets the same slot_mapping tensor, so
    this is computed once per step."""

    slot_mapping: torch.Tensor  # held: the cache key is this very tensor (and its version)
    version: int
    starts: tuple[int, ...]
    # (tokens, slots) per destination: the local cache first, then each cold side's pool;
    # None where no token goes.
    parts: list[tuple[torch.Tensor, torch.Tensor] | None]

    @classmethod
    def of(cls, slot_mapping: torch.Tensor, starts: tuple[int, ...]) -> _SlotSplit:
        bounds = torch.tensor(starts, dtype=slot_mapping.dtype, device=slot_mapping.device)
        side = torch.bucketize(slot_mapping, bounds, right=True)  # 0: local, i + 1: cold i
        parts: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        for index in range(len(starts) + 1):
            tokens = torch.nonzero(side == index).flatten()
            base = starts[index - 1] if index else 0
            parts.append((tokens, slot_mapping[tokens] - base) if tokens.numel() else None)
        return cls(slot_mapping, slot_mapping._version, starts, parts)

    def is_for(self, slot_mapping: torch.Tensor, starts: tuple[int, ...]) -> bool:
        # The version counter moves with any in-place write to the tensor or the
        # persistent buffer it views, so a reused buffer never matches a stale split.
        return (self.slot_mapping is slot_mapping and self.version == slot_mapping._version
                and self.starts == starts)


class HotPairs:
    """A hot worker's pairs, one slot per plan (in the hot engine's plan order), each
    holding the pair's HotWeaving once its cold side's region is attached."""

    def __init__(self, plans: Sequence[PairPlan]) -> None:
        if not plans:
            raise ValueError("a hot worker's weaving needs at least one pair plan")
        self.plans = list(plans)
        self.colds: list[HotWeaving | None] = [None] * len(self.plans)
        self.remote_offsets = remote_block_offsets(self.plans)
        self._slot_split: _SlotSplit | None = None

    @classmethod
    def of(cls, *runtimes: HotWeaving) -> HotPairs:
        """Pairs whose regions are attached already (the two-process decode, tests)."""
        pairs = cls([runtime.plan for runtime in runtimes])
        pairs.colds = list(runtimes)
        return pairs

    def index_of(self, cold: str) -> int:
        for index, plan in enumerate(self.plans):
            if plan.cold == cold:
                return index
        raise ValueError(f"this hot engine weaves into {[p.cold for p in self.plans]}, "
                         f"not {cold!r}")

    def attached(self) -> list[HotWeaving]:
        return [runtime for runtime in self.colds if runtime is not None]

    def remote_starts(self, num_local_blocks: int) -> list[int]:
        """The first block id of each cold side's remote range."""
        return [num_local_blocks + offset for offset in self.remote_offsets]

    def cold(self, index: int) -> HotWeaving:
        runtime = self.colds[index]
        if runtime is None:  # the scheduler places nothing there before the link attaches
            raise RuntimeError(f"weaving {self.plans[index].hot} -> {self.plans[index].cold}:"
                               " a sequence lives on a cold side whose region is not attached")
        return runtime

    # --- once per step ------------------------------------------------------------------
    def settle_step(self) -> None:
        for runtime in self.attached():
            runtime.settle_step()

    def count_new_remote(self, num_new_remote: Sequence[int]) -> None:
        for index, count in enumerate(num_new_remote):
            if count:
                self.cold(index).stats.num_remote_sequences += count

    # --- K/V --------------------------------------------------------------------------
    def write_kv(self, ops: AttentionOps, key: torch.Tensor, value: torch.Tensor,
                 slot_mapping: torch.Tensor, num_local_slots: int) -> None:
        starts = tuple(num_local_slots + offset * plan.shape.block_size
                       for offset, plan in zip(self.remote_offsets, self.plans, strict=True))
        split = self._slot_split
        if split is None or not split.is_for(slot_mapping, starts):
            split = self._slot_split = _SlotSplit.of(slot_mapping, starts)
        local, *remote = split.parts
        if local is not None and all(part is None for part in remote):
            ops.write(ops.local_kv, key, value, slot_mapping)
            return
        if local is not None:
            ops.write(ops.local_kv, key[local[0]], value[local[0]], local[1])
        for index, part in enumerate(remote):
            if part is not None:
                self.cold(index).remote_kv.write(ops, key[part[0]], value[part[0]], part[1])

    # --- attention ----------------------------------------------------------------------
    def attend(self, ops: AttentionOps, layer_index: int, step: StepRows, query: torch.Tensor,
               output: torch.Tensor, *, scale: float, sliding_window: int,
               softcap: float) -> torch.Tensor:
        """Attention of every row of the step: each cold side's decode rows there while
        the rest runs here."""
        tickets = [self.cold(rows.cold).submit(layer_index, query, rows, scale=scale,
                                               sliding_window=sliding_window, softcap=softcap)
                   for rows in step.remotes]
        if step.local is not None:
            ops.attend(ops.local_kv, step.local, query, output)
        for rows in step.remotes:
            if rows.prefill is not None:
                self.cold(rows.cold).attend_prefill(ops, rows.prefill, query, output)
        for rows, ticket in zip(step.remotes, tickets, strict=True):
            if rows.decode is not None:
                self.cold(rows.cold).finish_decode(ops, ticket, rows.decode, query, output)
        return output
