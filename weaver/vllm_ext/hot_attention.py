"""The hot engine's attention: vLLM's CPU_ATTN, split by where each sequence's KV lives.

`WeaverCPUAttentionBackend` replaces CPU_ATTN in every engine (the plugin registers it),
and behaves exactly like it until a hot worker attaches a `HotWeavingRuntime`. Then, per
layer and step (Weaver §3, architecture part 5):

- new K/V of remote sequences are written into the remote pool (slots at or above
  `num_local_blocks * block_size` belong to it: the region's KV section, or the cold
  device's unified pool when the pair's plan has one), the rest into vLLM's own cache;
- remote *decode* rows are published to the cold side first, local rows and remote
  *prefill* rows (which need the prompt's K/V just written to the shared pool, chunked
  prefill included) run here meanwhile, then the cold side's output is merged back in
  batch order;
- if the cold side times out or is gone, the pair turns degraded and the remote rows are
  computed here from the shared pool: logged once, counted every time.

On a cold engine whose split plan cuts attention (``attn: n``), the same impl runs its
own batch as groups of sequences with a poll between them (split_attention.py).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from weaver.offload.protocol import OffloadError, TaskBatch
from weaver.offload.sender import OffloadSender
from weaver.vllm_ext.attention_rows import BatchRows, attend_rows, select_mask
from weaver.vllm_ext.split_attention import ATTN_OP_NAME, AttentionChunks
from weaver.weaving.plan import PairPlan

if TYPE_CHECKING:
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadata

logger = logging.getLogger(__name__)


@dataclass
class HotWeavingStats:
    num_offloaded_tasks: int = 0  # decode-attention tasks the cold side served
    num_offloaded_rows: int = 0  # sequence-layer rows inside them
    num_fallback_tasks: int = 0  # tasks computed here because the cold side failed
    num_remote_prefill_rows: int = 0
    num_remote_sequences: int = 0  # remote sequences seen starting their prefill
    wait_seconds: list[float] = field(default_factory=list)  # drained by the metrics scrape


class RegionKV:
    """Remote blocks whose K/V live in the region's own KV section (vLLM's layout)."""

    def __init__(self, sender: OffloadSender) -> None:
        self.sender = sender

    def write(self, impl: Any, layer: Any, layer_index: int, key: torch.Tensor,
              value: torch.Tensor, slots: torch.Tensor) -> None:
        CPUAttentionBackendImpl.do_kv_cache_update(impl, layer, key, value,
                                                   self.sender.kv_layer(layer_index), slots)

    def attend(self, impl: Any, layer: Any, layer_index: int, query: torch.Tensor,
               output: torch.Tensor, md: Any, rows: BatchRows) -> None:
        attend_rows(impl, layer, query, output, self.sender.kv_layer(layer_index), md, rows)


class HotWeavingRuntime:
    """Per hot worker: the attached region, where the remote blocks' K/V live (the region,
    or the cold device's unified pool: pool_worker.RemotePoolKV) and the pair's health."""

    def __init__(self, plan: PairPlan, sender: OffloadSender, remote_kv: Any = None) -> None:
        self.plan = plan
        self.sender = sender
        self.remote_kv = remote_kv if remote_kv is not None else RegionKV(sender)
        self.stats = HotWeavingStats()
        self.degraded_reason: str | None = None
        self.step_split: _StepSplit | None = None  # the current step's batch split
        self._slot_split: _SlotSplit | None = None  # the current step's new-K/V split
        self._lock = threading.Lock()

    def slot_split_of(self, slot_mapping: torch.Tensor, boundary: int) -> _SlotSplit:
        split = self._slot_split
        if split is None or not split.is_for(slot_mapping, boundary):
            split = self._slot_split = _SlotSplit.of(slot_mapping, boundary)
        return split

    def mark_degraded(self, reason: str) -> None:
        if self.degraded_reason is None:
            self.degraded_reason = reason
            logger.error(
                "weaving %s -> %s degraded (%s): remote sequences' attention is now computed "
                "on the hot side from the shared pool", self.plan.hot, self.plan.cold, reason)

    def drain_stats(self) -> dict[str, Any]:
        with self._lock:
            waits, self.stats.wait_seconds = self.stats.wait_seconds, []
        return {
            "hot": self.plan.hot, "cold": self.plan.cold,
            "offloaded_tasks": self.stats.num_offloaded_tasks,
            "offloaded_rows": self.stats.num_offloaded_rows,
            "fallback_tasks": self.stats.num_fallback_tasks,
            "remote_prefill_rows": self.stats.num_remote_prefill_rows,
            "remote_sequences": self.stats.num_remote_sequences,
            "degraded_reason": self.degraded_reason,
            "wait_seconds": waits,
        }


@dataclass
class _SlotSplit:
    """Which new tokens' K/V go to the local cache and which to the remote pool (slot ids
    rebased to it). Every layer of a step gets the same slot_mapping tensor, so this is
    computed once per step (the hot path ran the masks per layer before)."""

    slot_mapping: torch.Tensor  # held: the cache key is this very tensor (and its version)
    version: int
    boundary: int
    local_tokens: torch.Tensor | None
    local_slots: torch.Tensor | None
    remote_tokens: torch.Tensor | None
    remote_slots: torch.Tensor | None

    @classmethod
    def of(cls, slot_mapping: torch.Tensor, boundary: int) -> _SlotSplit:
        is_remote = slot_mapping >= boundary
        remote = torch.nonzero(is_remote).flatten()
        local = torch.nonzero(~is_remote).flatten()
        return cls(slot_mapping, slot_mapping._version, boundary,
                   local if local.numel() else None,
                   slot_mapping[local] if local.numel() else None,
                   remote if remote.numel() else None,
                   slot_mapping[remote] - boundary if remote.numel() else None)

    def is_for(self, slot_mapping: torch.Tensor, boundary: int) -> bool:
        # The version counter moves with any in-place write to the tensor or the
        # persistent buffer it views, so a reused buffer never matches a stale split.
        return (self.slot_mapping is slot_mapping and self.version == slot_mapping._version
                and self.boundary == boundary)


@dataclass
class _StepSplit:
    """How one step's batch divides by where each sequence's KV lives. Every layer of a
    step shares the attention metadata object, so this is computed once per step."""

    metadata: Any  # the CPUAttentionMetadata it was computed from (identity = cache key)
    local: BatchRows | None
    remote_prefill: BatchRows | None
    remote_decode: BatchRows | None
    num_new_remote: int  # remote sequences starting their prefill in this step
    # remote_decode as the offload channel sends it, checked once for all layers
    decode_batch: TaskBatch | None = None


def _split_step(md: CPUAttentionMetadata, num_local_blocks: int) -> _StepSplit:
    num_reqs = md.seq_lens.shape[0]
    is_remote = md.block_table[:num_reqs, 0] >= num_local_blocks
    query_lens = md.query_start_loc[1 : num_reqs + 1] - md.query_start_loc[:num_reqs]
    is_decode = query_lens == 1
    is_new = md.seq_lens[:num_reqs] == query_lens  # the first chunk of a prefill
    return _StepSplit(
        metadata=md,
        local=select_mask(md, ~is_remote, 0),
        remote_prefill=select_mask(md, is_remote & ~is_decode, num_local_blocks),
        remote_decode=select_mask(md, is_remote & is_decode, num_local_blocks),
        num_new_remote=int((is_remote & is_new).sum()),
    )


class WeaverCPUAttentionImpl(CPUAttentionBackendImpl):
    # Set by the worker extension when a hot worker attaches its region.
    weaving_runtime: HotWeavingRuntime | None = None
    weaver_layer_index: int = -1
    # Set at KV-cache initialisation when the engine keeps its KV in a unified pool
    # (pool_worker.py): then vLLM's own cache views are never used.
    weaver_pool: Any = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # A cold engine's split plan (read while vLLM builds the model, like the split
        # linear layers) may cut decoder attention into groups of sequences.
        from vllm.v1.attention.backend import AttentionType

        from weaver.vllm_ext.split_layers import current_split_chunks

        num_chunks = current_split_chunks().get(ATTN_OP_NAME, 1)
        self.weaver_attn_chunks = (AttentionChunks(num_chunks)
                                   if num_chunks > 1 and self.attn_type == AttentionType.DECODER
                                   else None)

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        if self.weaver_pool is not None:
            return self.weaver_pool.write(layer, self.weaver_layer_index, key, value,
                                          slot_mapping)
        runtime = self.weaving_runtime
        if runtime is None:
            return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        num_blocks, _, block_size, _ = kv_cache.shape
        slots = runtime.slot_split_of(slot_mapping, num_blocks * block_size)
        if slots.remote_tokens is None:
            return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        if slots.local_tokens is not None:
            super().do_kv_cache_update(layer, key[slots.local_tokens], value[slots.local_tokens],
                                       kv_cache, slots.local_slots)
        runtime.remote_kv.write(self, layer, self.weaver_layer_index, key[slots.remote_tokens],
                                value[slots.remote_tokens], slots.remote_slots)
        return None

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        runtime = self.weaving_runtime
        md = attn_metadata
        if self.weaver_pool is not None and md is not None:
            if output_scale is not None or output_block_scale is not None:
                raise NotImplementedError("fused output quantization is not supported")
            return self.weaver_pool.attend(self, layer, self.weaver_layer_index, query,
                                           output, md)
        if (runtime is None and md is not None and self.weaver_attn_chunks is not None
                and output_scale is None and md.dynamic_causal is None):
            return self.weaver_attn_chunks.run(self, layer, query, output, kv_cache, md)
        if runtime is None or md is None:
            return super().forward(layer, query, key, value, kv_cache, md, output,
                                   output_scale, output_block_scale)
        split = runtime.step_split
        if split is None or split.metadata is not md:
            split = runtime.step_split = _split_step(md, kv_cache.shape[0])
            runtime.stats.num_remote_sequences += split.num_new_remote
        if split.remote_prefill is None and split.remote_decode is None:
            return super().forward(layer, query, key, value, kv_cache, md, output,
                                   output_scale, output_block_scale)
        decode = split.remote_decode
        ticket = None
        if decode is not None and runtime.degraded_reason is None:
            ticket = self._submit(runtime, query, split)
        if split.local is not None:
            attend_rows(self, layer, query, output, kv_cache, md, split.local)
        if split.remote_prefill is not None:
            runtime.stats.num_remote_prefill_rows += len(split.remote_prefill.requests)
            runtime.remote_kv.attend(self, layer, self.weaver_layer_index, query, output, md,
                                     split.remote_prefill)
        if decode is not None and (ticket is None
                                   or not self._collect(runtime, ticket, output, decode)):
            runtime.stats.num_fallback_tasks += 1
            runtime.remote_kv.attend(self, layer, self.weaver_layer_index, query, output, md,
                                     decode)
        return output

    def _submit(self, runtime, query, split: _StepSplit):
        rows = split.remote_decode
        if split.decode_batch is None:
            split.decode_batch = runtime.sender.prepare_batch(rows.seq_lens, rows.block_table)
        try:
            return runtime.sender.submit_batch(
                self.weaver_layer_index, query[rows.tokens], split.decode_batch,
                scale=self.scale, sliding_window=self.sliding_window,
                softcap=float(self.logits_soft_cap))
        except OffloadError as exc:
            runtime.mark_degraded(f"submit failed: {exc}")
            return None

    def _collect(self, runtime, ticket, output, rows: BatchRows) -> bool:
        try:
            result = runtime.sender.wait_with_timing(ticket, runtime.plan.timeout_s)
        except OffloadError as exc:
            runtime.mark_degraded(f"wait failed: {exc}")
            return False
        output[rows.tokens] = result.output  # both [rows, num_heads, head_size]
        runtime.stats.num_offloaded_tasks += 1
        runtime.stats.num_offloaded_rows += len(rows.tokens)
        runtime.stats.wait_seconds.append(result.wait_s)
        return True


class WeaverCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[WeaverCPUAttentionImpl]:
        return WeaverCPUAttentionImpl


