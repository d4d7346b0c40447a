"""Greedy decoding of a batch of sequences over a paged KV cache, every sequence local or
the remote ones woven through one cold side's ``HotWeaving`` (weaver/weaving/hot.py), per
layer as the attention backend drives it, through ``HotPairs`` (weaving/hot_pairs.py): new
K/V through ``write_kv``, then ``attend`` over the step's rows (remote decode rows
published to the cold side, the rest attended here).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from benchmarks.two_process.paged_batch import (
    Sequence,
    StepBatch,
    advance,
    build_step,
    num_local_blocks_for,
)
from benchmarks.two_process.reference_ops import ReferenceAttentionOps
from benchmarks.two_process.tiny_llama import TinyLlama
from weaver.weaving.hot import HotWeaving
from weaver.weaving.hot_pairs import HotPairs


@dataclass
class StepOutput:
    tokens: list[int]  # one per sequence of the step, in batch order
    logits: torch.Tensor  # [num_seqs, vocab] float32, on the host


class PagedDecoder:
    def __init__(self, model: TinyLlama, sequences: list[Sequence], *, block_size: int,
                 weaving: HotWeaving | None = None) -> None:
        if weaving is None and any(s.is_remote for s in sequences):
            raise ValueError("remote sequences need a HotWeaving to reach their KV")
        shape = model.shape
        device = model.lm_head.weight.device
        self.model = model
        self.sequences = sequences
        self.block_size = block_size
        self.weaving = weaving
        self.pairs = None if weaving is None else HotPairs.of(weaving)
        self.device = device
        self.num_local_blocks = num_local_blocks_for(sequences)
        self.max_blocks_per_seq = max(len(s.block_ids) for s in sequences)
        self.ops = [
            ReferenceAttentionOps(
                i, torch.zeros(self.num_local_blocks, shape.num_kv_heads, block_size,
                               2 * shape.head_size, device=device), shape.scale)
            for i in range(shape.num_layers)
        ]

    def step(self, step_index: int) -> StepOutput:
        """One step of the sequences that have joined by step_index; the sampled tokens
        come to the host (on a GPU: the step's synchronisation)."""
        active = [s for s in self.sequences if s.join_step <= step_index]
        batch = build_step(active, block_size=self.block_size,
                           num_local_blocks=self.num_local_blocks,
                           max_blocks_per_seq=self.max_blocks_per_seq, device=self.device)
        with torch.no_grad():  # not inference_mode: hot.py reads slot_mapping._version
            logits = self.model(batch.input_ids, batch.positions,
                                lambda layer, q, k, v: self._attend(batch, layer, q, k, v),
                                batch.sample_rows)
        tokens = logits.argmax(dim=-1).tolist()
        advance(batch, tokens)
        return StepOutput(tokens, logits.cpu())

    def _attend(self, batch: StepBatch, layer: int, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> torch.Tensor:
        ops = self.ops[layer]
        output = torch.empty_like(q)
        if self.weaving is None:
            ops.write(ops.local_kv, k, v, batch.slot_mapping)
            ops.attend(ops.local_kv, batch.rows.local, q, output)
            return output
        self.pairs.write_kv(ops, k, v, batch.slot_mapping,
                              self.num_local_blocks * self.block_size)
        return self.pairs.attend(ops, layer, batch.rows, q, output, scale=ops.scale,
                                   sliding_window=-1, softcap=0.0)
