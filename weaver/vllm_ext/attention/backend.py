"""Weaver's attention backend: a platform backend whose batch is split by where each
sequence's KV lives (docs/architecture.md, "The weaving path").

Two mixins go in front of a platform backend's classes (cpu.py does it for CPU_ATTN):

- ``WovenMetadataBuilder`` (before its ``AttentionMetadataBuilder``): on a hot engine it
  splits each step's batch into local requests and, per cold engine, remote-prefill and
  remote-decode ones (``weaver.weaving.hot_pairs.classify_requests``) with vLLM's
  micro-batch slicing (partition.py), and the platform's own builder makes each group's
  metadata (the remote ones with block ids rebased to their cold engine's pool); on a
  cold engine whose split plan cuts attention it splits the batch into groups of
  sequences (``weaver.splitting.group_bounds``). Anywhere else, and for a step with
  nothing remote, it is the platform's builder.
- ``WovenAttentionImpl`` (before its ``AttentionImpl``): hands a woven step to the hot
  worker's pairs (weaving/hot_pairs.py) with the platform's own forward and K/V write as the
  ``AttentionOps`` it calls; runs a cold engine's groups with a poll between them; keeps an
  engine's KV in the unified pool (pool.py); and is the platform's impl otherwise.

The worker extension (weaver/vllm_ext/worker.py) attaches the hot pairs to the impls and
the builders when the hot worker connects, so engines that never weave run vLLM's own code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from vllm.v1.attention.backend import AttentionType, CommonAttentionMetadata
from vllm.v1.kv_cache_interface import CrossAttentionSpec, EncoderOnlyAttentionSpec

from weaver.splitting.algorithm import group_bounds
from weaver.vllm_ext.additional_config import split_chunks_of
from weaver.vllm_ext.attention.partition import (
    query_lens,
    rebase_block_table,
    split_contiguous,
    split_requests,
)
from weaver.vllm_ext.layers import ATTN_OP_NAME, AttentionChunks, current_split_chunks
from weaver.weaving.hot import RemoteRows, RowGroup
from weaver.weaving.hot_pairs import HotPairs, StepRows, classify_requests


class _LazyMetadata:
    """A group's backend metadata, built by its own builder on first use (a remote decode
    group needs it only when the cold side failed and the hot side attends it itself)."""

    def __init__(self, builder: Any, common: CommonAttentionMetadata) -> None:
        self._builder = builder
        self._common = common
        self._built: Any = None

    def get(self) -> Any:
        if self._built is None:
            self._built = self._builder.build(0, self._common)
        return self._built


@dataclass
class WovenMetadata:
    """A hot step whose batch has remote requests, split by placement."""

    step: StepRows


@dataclass
class SequenceGroupsMetadata:
    """A cold step cut into groups of whole sequences, each with its rows and metadata."""

    groups: list[tuple[slice, Any]]


class WovenMetadataBuilder:
    """Mixin in front of a platform's AttentionMetadataBuilder (see the module docstring)."""

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any,
                 device: torch.device, **kwargs: Any) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device, **kwargs)
        self._weaver_init_args = (kv_cache_spec, layer_names, vllm_config, device, kwargs)
        # One builder per group, as vLLM keeps one per micro-batch: a backend may keep
        # per-build state (e.g. CUDA-graph buffers) that two groups must not share.
        self._weaver_part_builders: list[Any] = []
        # Set by the hot worker when it attaches a region (worker_hot.py).
        self.weaver_hot: HotPairs | None = None
        self.weaver_num_local_blocks = 0
        is_decoder = not isinstance(kv_cache_spec, CrossAttentionSpec | EncoderOnlyAttentionSpec)
        self.weaver_attn_chunks = (split_chunks_of(vllm_config).get(ATTN_OP_NAME, 1)
                                   if is_decoder else 1)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> Any:
        cm = common_attn_metadata
        if cm.num_reqs:
            if self.weaver_hot is not None:
                step = self._woven_step(cm)
                if step is not None:
                    return WovenMetadata(step)
            elif self.weaver_attn_chunks > 1 and not isinstance(cm.causal, torch.Tensor):
                return self._sequence_groups(cm)
        return super().build(common_prefix_len, cm, fast_build)

    def _part_builder(self, index: int) -> Any:
        while len(self._weaver_part_builders) <= index:
            base = next(cls for cls in type(self).__mro__[1:]
                        if not issubclass(cls, WovenMetadataBuilder))
            kv_cache_spec, layer_names, vllm_config, device, kwargs = self._weaver_init_args
            self._weaver_part_builders.append(
                base(kv_cache_spec, layer_names, vllm_config, device, **kwargs))
        return self._weaver_part_builders[index]

    def _woven_step(self, cm: CommonAttentionMetadata) -> StepRows | None:
        pairs = self.weaver_hot
        # The last step's device waits are long done (vLLM read its sampled tokens).
        pairs.settle_step()
        num_reqs = cm.num_reqs
        lens = query_lens(cm)
        starts = pairs.remote_starts(self.weaver_num_local_blocks)
        split = classify_requests(cm.block_table_tensor[:num_reqs, 0].cpu(), lens,
                                  cm.seq_lens[:num_reqs].cpu(), starts)
        pairs.count_new_remote(split.num_new_remote)
        if not split.has_remote:
            return None
        # Requests of the runner's padding (no query tokens) belong to no group. Groups:
        # the local requests, then each cold's prefill and decode requests.
        has_tokens = lens > 0
        groups = [split.local, *(g for phases in split.remote for g in phases)]
        parts = split_requests(cm, [g[has_tokens[g]] for g in groups])
        local = self._row_group(0, parts[0], first_block_id=None, is_lazy=False)
        remotes = []
        for cold, start in enumerate(starts):
            prefill, decode = parts[1 + 2 * cold], parts[2 + 2 * cold]
            if prefill is None and decode is None:
                continue
            remotes.append(RemoteRows(
                cold, self._row_group(1 + 2 * cold, prefill, first_block_id=start,
                                      is_lazy=False),
                self._row_group(2 + 2 * cold, decode, first_block_id=start, is_lazy=True)))
        return StepRows(local, remotes)

    def _row_group(self, index: int, part: Any, *, first_block_id: int | None,
                   is_lazy: bool) -> RowGroup | None:
        """A group's rows and lazy metadata; a remote group's block ids rebased to its
        cold's pool (`first_block_id`: where its range starts)."""
        if part is None:
            return None
        common = (part.common if first_block_id is None
                  else rebase_block_table(part.common, first_block_id))
        metadata = _LazyMetadata(self._part_builder(index), common)
        if not is_lazy:
            metadata.get()
        return RowGroup(tokens=part.tokens, query_start_loc=common.query_start_loc_cpu,
                        seq_lens=common.seq_lens, block_table=common.block_table_tensor,
                        metadata=metadata, causal=bool(common.causal))

    def _sequence_groups(self, cm: CommonAttentionMetadata) -> SequenceGroupsMetadata:
        num_reqs = cm.num_reqs
        work = (query_lens(cm) * cm.seq_lens[:num_reqs].cpu().to(torch.int64)).tolist()
        bounds = group_bounds(work, self.weaver_attn_chunks)
        return SequenceGroupsMetadata([
            (tokens, self._part_builder(i).build(0, part))
            for i, (tokens, part) in enumerate(split_contiguous(cm, bounds))])


class _LayerCall:
    """One layer's attention call as the hot pairs drive it (weaving.hot.AttentionOps):
    the platform impl's own forward and K/V write, over any cache tensor."""

    def __init__(self, impl: WovenAttentionImpl, layer: Any, key: torch.Tensor | None,
                 value: torch.Tensor | None, kv_cache: torch.Tensor) -> None:
        self.impl = impl
        self.layer = layer
        self.layer_index = impl.weaver_layer_index
        self.local_kv = kv_cache
        self._key = key
        self._value = value

    def attend(self, kv_layer: torch.Tensor, rows: RowGroup, query: torch.Tensor,
               output: torch.Tensor) -> None:
        tokens = rows.tokens
        sub_out = output.new_empty((tokens.numel(), *output.shape[1:]))
        self.impl.weaver_platform_forward(
            self.layer, query[tokens], _rows(self._key, tokens), _rows(self._value, tokens),
            kv_layer, rows.metadata.get(), sub_out)
        output[tokens] = sub_out

    def write(self, kv_layer: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              slots: torch.Tensor) -> None:
        self.impl.weaver_platform_kv_update(self.layer, key, value, kv_layer, slots)


def _rows(tensor: torch.Tensor | None, tokens: torch.Tensor) -> torch.Tensor | None:
    return None if tensor is None else tensor[tokens]


def window_tokens(sliding_window: int | tuple[int, int]) -> int:
    """An impl's sliding window as the offload task carries it: the keys a query sees, -1
    for none. CPU_ATTN keeps that int; the GPU backends keep flash-attention's (left, right)
    bounds with left = window - 1 (``__init__`` of triton_attn.py, flash_attn.py and
    flashinfer.py's impls)."""
    if isinstance(sliding_window, tuple):
        left = sliding_window[0]
        return left + 1 if left >= 0 else -1
    return sliding_window


class WovenAttentionImpl:
    """Mixin in front of a platform's AttentionImpl (see the module docstring)."""

    weaver_layer_index: int = -1
    # Set by the hot worker when it attaches a region: its pairs and the slot count of the
    # engine's own cache (slots at or above it are remote).
    weaver_hot: HotPairs | None = None
    weaver_num_local_slots: int = 0
    # Set at KV-cache initialisation when the engine keeps its KV in a unified pool
    # (pool.py): then vLLM's own cache views are never used.
    weaver_pool: Any = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # A cold engine's split plan (read while vLLM builds the model, as the split
        # linear layers read it) may cut decoder attention into groups of sequences; the
        # chunks hold the poll and the counters.
        num_chunks = current_split_chunks().get(ATTN_OP_NAME, 1)
        self.weaver_attn_chunks = (AttentionChunks(num_chunks)
                                   if num_chunks > 1 and self.attn_type == AttentionType.DECODER
                                   else None)

    def weaver_platform_forward(self, *args: Any) -> torch.Tensor:
        return super().forward(*args)

    def weaver_platform_kv_update(self, *args: Any) -> None:
        super().do_kv_cache_update(*args)

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        if self.weaver_pool is not None:
            return self.weaver_pool.write(layer, self.weaver_layer_index, key, value,
                                          slot_mapping)
        if self.weaver_hot is None:
            return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        self.weaver_hot.write_kv(_LayerCall(self, layer, None, None, kv_cache), key, value,
                                 slot_mapping, self.weaver_num_local_slots)
        return None

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        md = attn_metadata
        is_weaver_md = isinstance(md, WovenMetadata | SequenceGroupsMetadata)
        if (is_weaver_md or self.weaver_pool is not None) and (
                output_scale is not None or output_block_scale is not None):
            raise NotImplementedError("fused output quantization is not supported by "
                                      "Weaver's attention")
        if self.weaver_pool is not None and md is not None:
            return self.weaver_pool.attend(self, layer, self.weaver_layer_index, query,
                                           output, md)
        if isinstance(md, WovenMetadata):
            return self.weaver_hot.attend(
                _LayerCall(self, layer, key, value, kv_cache), self.weaver_layer_index,
                md.step, query, output, scale=self.scale,
                sliding_window=window_tokens(self.sliding_window),
                softcap=float(self.logits_soft_cap or 0.0))
        if isinstance(md, SequenceGroupsMetadata):
            return self._attend_groups(layer, query, key, value, kv_cache, md, output)
        return super().forward(layer, query, key, value, kv_cache, md, output,
                               output_scale, output_block_scale)

    def _attend_groups(self, layer, query, key, value, kv_cache,
                       md: SequenceGroupsMetadata, output) -> torch.Tensor:
        """A cold step's groups of sequences, one kernel call each, the cold worker's poll
        between them (so an offloaded task waits behind one group, not the whole batch)."""
        def attend(group: tuple[slice, Any]) -> None:
            tokens, group_md = group
            self.weaver_platform_forward(layer, query[tokens], _rows(key, tokens),
                                         _rows(value, tokens), kv_cache, group_md,
                                         output[tokens])

        self.weaver_attn_chunks.run_chunks(md.groups, attend)
        return output
