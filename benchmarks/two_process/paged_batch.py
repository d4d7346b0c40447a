"""Sequences in a paged KV cache and one decode step's batch, as vLLM's attention backend
would hand it to the weaving runtime (weaver/weaving/hot_pairs.py).

Block ids follow the hot scheduler's convention (hot_pairs.py ``classify_requests``): a
sequence's blocks are ids in its pool, the local cache's or the remote pool's; in the
step's slot mapping and first-block ids the remote pool's ids come after the local
cache's, so ``num_local_blocks`` splits them. The query rows of a step are the sequences'
new tokens in batch order (a whole prompt at a sequence's first step, then one token).
Metadata stays on the host (what a step's bookkeeping reads there anyway); only the row
indices the runtime gathers q with live on the model's device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from weaver.weaving.hot import RemoteRows, RowGroup
from weaver.weaving.hot_pairs import StepRows, classify_requests


@dataclass
class Sequence:
    prompt: list[int]
    join_step: int  # the step whose batch it enters (its prompt is that step's prefill)
    is_remote: bool  # its KV lives in the remote pool
    block_ids: list[int]  # ids in its pool, enough for its whole run
    output: list[int] = field(default_factory=list)
    num_cached: int = 0  # tokens whose K/V are in the cache

    def new_tokens(self) -> list[int]:
        return self.prompt if self.num_cached == 0 else self.output[-1:]


def blocks_per_sequence(max_len: int, block_size: int) -> int:
    return math.ceil(max_len / block_size)


def place_sequences(prompts: list[list[int]], join_steps: list[int], remote: set[int], *,
                    num_blocks_each: int, seed: int) -> list[Sequence]:
    """Sequences with their blocks: local ones from the local cache, the `remote` indices
    from the remote pool, each pool's blocks handed out in a seeded random order (block
    tables that are not the identity catch an id mix-up)."""
    gen = torch.Generator().manual_seed(seed)
    num_remote = len(remote)
    free = {
        False: torch.randperm((len(prompts) - num_remote) * num_blocks_each, generator=gen),
        True: torch.randperm(num_remote * num_blocks_each, generator=gen),
    }
    taken = {False: 0, True: 0}
    sequences = []
    for index, (prompt, join_step) in enumerate(zip(prompts, join_steps, strict=True)):
        is_remote = index in remote
        start = taken[is_remote]
        taken[is_remote] += num_blocks_each
        ids = free[is_remote][start : start + num_blocks_each].tolist()
        sequences.append(Sequence(prompt, join_step, is_remote, ids))
    return sequences


def num_local_blocks_for(sequences: list[Sequence]) -> int:
    return sum(len(s.block_ids) for s in sequences if not s.is_remote)


@dataclass
class StepBatch:
    sequences: list[Sequence]  # the step's sequences, in batch order
    input_ids: torch.Tensor  # [T] on the model's device
    positions: torch.Tensor  # [T] on the model's device
    slot_mapping: torch.Tensor  # int64 [T] on the host; remote slots from num_local_slots on
    sample_rows: torch.Tensor  # [len(sequences)] each sequence's last query row
    rows: StepRows


def build_step(sequences: list[Sequence], *, block_size: int, num_local_blocks: int,
               max_blocks_per_seq: int, device: torch.device) -> StepBatch:
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    starts: list[int] = []
    for seq in sequences:
        offset = num_local_blocks if seq.is_remote else 0  # the remote pool's ids come after
        starts.append(len(input_ids))
        for position in range(seq.num_cached, seq.num_cached + len(seq.new_tokens())):
            block = offset + seq.block_ids[position // block_size]
            slots.append(block * block_size + position % block_size)
            positions.append(position)
        input_ids.extend(seq.new_tokens())
    query_lens = torch.tensor([len(s.new_tokens()) for s in sequences], dtype=torch.int32)
    seq_lens = torch.tensor([s.num_cached + len(s.new_tokens()) for s in sequences],
                            dtype=torch.int32)
    first_blocks = torch.tensor([s.block_ids[0] + (num_local_blocks if s.is_remote else 0)
                                 for s in sequences])
    split = classify_requests(first_blocks, query_lens, seq_lens, [num_local_blocks])
    table = torch.zeros(len(sequences), max_blocks_per_seq, dtype=torch.int32)
    for i, seq in enumerate(sequences):
        table[i, : len(seq.block_ids)] = torch.tensor(seq.block_ids, dtype=torch.int32)

    def group(requests: torch.Tensor) -> RowGroup | None:
        if not requests.numel():
            return None
        rows = [torch.arange(starts[r], starts[r] + int(query_lens[r])) for r in requests]
        lens = query_lens[requests]
        return RowGroup(
            tokens=torch.cat(rows).to(device),
            query_start_loc=torch.cat((torch.zeros(1, dtype=torch.int32),
                                       lens.cumsum(0).to(torch.int32))),
            seq_lens=seq_lens[requests],
            block_table=table[requests],
        )

    last_rows = [start + int(n) - 1 for start, n in zip(starts, query_lens, strict=True)]
    return StepBatch(
        sequences=sequences,
        input_ids=torch.tensor(input_ids, device=device),
        positions=torch.tensor(positions, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        sample_rows=torch.tensor(last_rows, device=device),
        rows=StepRows(local=group(split.local), remotes=[
            RemoteRows(0, prefill=group(prefill), decode=group(decode))
            for prefill, decode in split.remote if prefill.numel() or decode.numel()]),
    )


def advance(batch: StepBatch, next_tokens: list[int]) -> None:
    """The step's K/V are cached; each sequence's sampled token is its next input."""
    for seq, token in zip(batch.sequences, next_tokens, strict=True):
        seq.num_cached += len(seq.new_tokens())
        seq.output.append(token)
