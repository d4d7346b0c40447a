"""Weaver's KV connector: a phase-split request's prompt KV, from the prompt engine that
computed it to the token engine that continues it, through a staging segment in shared
memory (weaver/kv/staging.py), on vLLM's KV-connector API
(vllm/distributed/kv_transfer/kv_connector/v1/base.py).

Why a connector of our own: of the connectors vLLM 0.32 ships, NIXL, Mooncake, P2P-NCCL
and MoRIIO move KV between GPUs (or need their libraries), LMCache needs LMCache, the CPU
offloading connectors keep KV within one engine, and ExampleConnector goes through files,
loads only whole blocks of the prompt (a prompt shorter than a block is recomputed) and
measures nothing.

The gateway (weaver/server/phase_split.py) names a segment per request and passes it in the
request's `kv_transfer_params`:
- ``{"weaver_kv_save": NAME}`` to the prompt engine: its scheduler tells its worker, step
  by step, which of the request's blocks the step computed; the worker copies each layer's
  blocks into the segment right after that layer's attention (`save_kv_layer`), so the
  transfer runs layer by layer inside the prefill (Splitwise §4.2). Blocks that prefix
  caching skipped are copied with the first step's.
- ``{"weaver_kv_load": NAME}`` to the token engine: its scheduler reports all but the
  prompt's last token as already computed (vLLM then computes that one token, and samples
  the first output from it, so the engine needs no sampled token from elsewhere), and its
  worker copies the blocks in before the forward pass (`start_load_kv`). When the segment
  is missing, holds another prompt or too few tokens, nothing is loaded and the prompt is
  computed here: logged, and visible to the gateway as a segment with no load. A segment
  that goes away between that check and the load (the request is over) has its blocks
  reported to vLLM as not loaded (`get_block_ids_with_load_errors`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from weaver.kv.staging import (
    W_BLOCK_BYTES,
    W_CACHED_TOKENS,
    W_LOAD_NS,
    W_LOADED_TOKENS,
    W_NUM_LOADS,
    W_PROMPT_HASH,
    W_PROMPT_TOKENS,
    W_SAVE_NS,
    W_SAVED_TOKENS,
    StagingSegment,
    load_blocks,
    prompt_hash,
    save_blocks,
)

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

# The `kv_transfer_params` keys the gateway sets (weaver/server/phase_split.py).
SAVE_KEY = "weaver_kv_save"
LOAD_KEY = "weaver_kv_load"
# `--kv-transfer-config` of a phase-split engine (its role decides nothing: what a request
# carries does, so one engine class serves both sides).
CONNECTOR_NAME = "WeaverStagingConnector"
CONNECTOR_MODULE = "weaver.vllm_ext.kv_connector"


def kv_transfer_config(role: str) -> dict[str, Any]:
    """The engine's `--kv-transfer-config`: role "kv_producer" (prompt engine) or
    "kv_consumer" (token engine)."""
    return {"kv_connector": CONNECTOR_NAME, "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": role}


@dataclass(frozen=True)
class BlockCopy:
    """One request's blocks to move this step: the engine's `block_ids` are the request's
    logical blocks `first_block`, `first_block + 1`, ..."""

    req_id: str
    segment: str
    block_ids: list[int]
    first_block: int
    num_tokens: int  # save: prompt tokens in the segment after it; load: tokens loaded
    # save only: what creates the segment on the request's first step
    num_blocks: int = 0
    block_size: int = 0
    prompt_tokens: int = 0
    prompt_digest: int = 0


@dataclass
class StagingMetadata(KVConnectorMetadata):
    saves: list[BlockCopy] = field(default_factory=list)
    loads: list[BlockCopy] = field(default_factory=list)


@dataclass
class _Saving:
    """A prompt engine's request whose KV is being staged (scheduler side)."""

    segment: str
    prompt_tokens: int
    prompt_digest: int
    block_ids: list[int] = field(default_factory=list)
    next_block: int = 0  # the first logical block not yet staged whole


class WeaverStagingConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._block_size = vllm_config.cache_config.block_size
        # scheduler side
        self._saving: dict[str, _Saving] = {}
        self._loads: dict[str, BlockCopy] = {}
        self._unscheduled_loads: dict[str, tuple[str, int, int]] = {}
        # worker side
        self._layer_index: dict[str, int] = {}
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._open: dict[str, StagingSegment] = {}
        self._save_ns: dict[str, int] = {}
        self._failed_block_ids: set[int] = set()

    # ==== scheduler side ================================================================
    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params or {}
        if SAVE_KEY in params and request.request_id not in self._saving:
            tokens = list(request.prompt_token_ids or [])
            self._saving[request.request_id] = _Saving(
                str(params[SAVE_KEY]), len(tokens), prompt_hash(tokens))
        if LOAD_KEY not in params:
            return 0, False
        loadable = self._loadable_tokens(request, str(params[LOAD_KEY]), num_computed_tokens)
        if loadable <= num_computed_tokens:
            return 0, False
        self._unscheduled_loads[request.request_id] = (
            str(params[LOAD_KEY]), num_computed_tokens // self._block_size, loadable)
        return loadable - num_computed_tokens, False

    def _loadable_tokens(self, request: Request, name: str, num_cached: int) -> int:
        """The prompt tokens this engine can take from the segment: all but the last
        (computed here so that the engine samples the first output itself), or 0. Notes
        in the segment how many the engine's own prefix cache holds (`num_cached`): a
        decode that loads nothing because of them recomputed nothing."""
        tokens = list(request.prompt_token_ids or [])
        try:
            segment = StagingSegment.open(name)
        except (FileNotFoundError, ValueError) as exc:
            logger.warning("request %s: no KV staged in %s (%s); computing its prompt here",
                           request.request_id, name, exc)
            return 0
        try:
            if (segment.read(W_PROMPT_TOKENS) != len(tokens)
                    or segment.read(W_PROMPT_HASH) != prompt_hash(tokens)):
                logger.warning("request %s: the KV staged in %s is of another prompt; "
                               "computing its prompt here", request.request_id, name)
                return 0
            saved = segment.read(W_SAVED_TOKENS)
            segment.write(W_CACHED_TOKENS, num_cached)
        finally:
            segment.close()
        if saved < len(tokens) - 1:
            logger.warning("request %s: %s holds the KV of %d of its %d prompt tokens; "
                           "computing its prompt here", request.request_id, name, saved,
                           len(tokens))
            return 0
        return len(tokens) - 1

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        pending = self._unscheduled_loads.pop(request.request_id, None)
        if pending is None or num_external_tokens <= 0:
            return
        segment, first_block, loadable = pending
        last_block = -(-loadable // self._block_size)
        block_ids = list(blocks.get_block_ids()[0][first_block:last_block])
        self._loads[request.request_id] = BlockCopy(
            request.request_id, segment, block_ids, first_block, loadable)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> StagingMetadata:
        meta = StagingMetadata(loads=list(self._loads.values()))
        self._loads.clear()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = self._saving.get(new.req_id)
            if state is not None:
                state.block_ids = list(new.block_ids[0])
                state.next_block = 0  # prefix-cache hits are staged too
                self._stage(meta, new.req_id, state,
                            new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._saving.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                # Preempted and rescheduled: its blocks are new, and recomputed from 0.
                state.block_ids, state.next_block = list(new_ids[0]) if new_ids else [], 0
            elif new_ids is not None:
                state.block_ids.extend(new_ids[0])
            self._stage(meta, req_id, state,
                        cached.num_computed_tokens[i] + scheduled.get(req_id, 0))
        return meta

    def _stage(self, meta: StagingMetadata, req_id: str, state: _Saving,
               computed_after_step: int) -> None:
        end = min(computed_after_step, state.prompt_tokens)
        last_block = -(-end // self._block_size)
        if end <= 0 or last_block <= state.next_block:
            return
        meta.saves.append(BlockCopy(
            req_id, state.segment, state.block_ids[state.next_block:last_block],
            state.next_block, end, num_blocks=-(-state.prompt_tokens // self._block_size),
            block_size=self._block_size, prompt_tokens=state.prompt_tokens,
            prompt_digest=state.prompt_digest))
        if end == state.prompt_tokens:
            del self._saving[req_id]  # staged whole: its output tokens are not staged
        else:
            # A partly filled last block is copied again with the next chunk.
            state.next_block = end // self._block_size

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._saving.pop(request.request_id, None)
        self._unscheduled_loads.pop(request.request_id, None)
        self._loads.pop(request.request_id, None)
        return False, None

    # ==== worker side ===================================================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv_caches = dict(kv_caches)
        self._layer_index = {name: i for i, name in enumerate(kv_caches)}

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, StagingMetadata)
        for load in meta.loads:
            try:
                self._load(load, forward_context)
            except (OSError, ValueError) as exc:
                # The segment went away between the check and the load (the gateway
                # unlinks it once the request is over: a client gone at that moment). vLLM
                # is told which blocks hold no KV (its kv_load_failure_policy decides).
                logger.warning("request %s: could not load its KV from %s (%s)",
                               load.req_id, load.segment, exc)
                self._failed_block_ids.update(load.block_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_block_ids = self._failed_block_ids, set()
        return failed

    def _load(self, load: BlockCopy, forward_context: ForwardContext) -> None:
        started = time.perf_counter_ns()
        segment = StagingSegment.open(load.segment)
        try:
            for name, index in self._layer_index.items():
                kv_layer = _layer_cache(forward_context, name, self._kv_caches)
                _check_block_bytes(segment, kv_layer, name)
                load_blocks(segment, index, kv_layer, load.block_ids, load.first_block)
            segment.write(W_LOADED_TOKENS, load.num_tokens)
            segment.write(W_LOAD_NS, time.perf_counter_ns() - started)
            segment.add(W_NUM_LOADS, 1)
        finally:
            segment.close()

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv loaded every layer before the forward pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, StagingMetadata)
        index = self._layer_index.get(layer_name)
        if index is None or not meta.saves:
            return
        for save in meta.saves:
            started = time.perf_counter_ns()
            segment = self._segment_for(save, kv_layer)
            _check_block_bytes(segment, kv_layer, layer_name)
            save_blocks(segment, index, kv_layer, save.block_ids, save.first_block)
            self._save_ns[save.req_id] = (self._save_ns.get(save.req_id, 0)
                                          + time.perf_counter_ns() - started)

    def _segment_for(self, save: BlockCopy, kv_layer: torch.Tensor) -> StagingSegment:
        segment = self._open.get(save.req_id)
        if segment is None:
            try:
                segment = StagingSegment.create(
                    save.segment, len(self._layer_index), save.num_blocks,
                    kv_layer[0].numel() * kv_layer.element_size(), save.block_size,
                    save.prompt_tokens, save.prompt_digest)
            except FileExistsError:  # a preempted prefill staging again
                segment = StagingSegment.open(save.segment)
            self._open[save.req_id] = segment
        return segment

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, StagingMetadata)
        for save in meta.saves:
            segment = self._open.get(save.req_id)
            if segment is None:
                continue
            segment.add(W_SAVE_NS, self._save_ns.pop(save.req_id, 0))
            segment.write(W_SAVED_TOKENS, save.num_tokens)  # after the blocks: readers check it
            if save.num_tokens >= segment.read(W_PROMPT_TOKENS):
                segment.close()
                del self._open[save.req_id]

    def get_finished(self, finished_req_ids: set[str]) -> tuple[None, None]:
        for req_id in finished_req_ids:
            segment = self._open.pop(req_id, None)
            if segment is not None:  # aborted before its prompt was staged whole
                segment.close()
        return None, None


def _layer_cache(forward_context: ForwardContext, name: str,
                 registered: dict[str, torch.Tensor]) -> torch.Tensor:
    """The layer's KV cache as its attention reads it (the view save_kv_layer is given)."""
    layer = forward_context.no_compile_layers.get(name)
    cache = getattr(layer, "kv_cache", None)
    return cache if cache is not None else registered[name]


def _check_block_bytes(segment: StagingSegment, kv_layer: torch.Tensor, name: str) -> None:
    block_bytes = kv_layer[0].numel() * kv_layer.element_size()
    if segment.read(W_BLOCK_BYTES) != block_bytes:
        raise RuntimeError(
            f"KV staging segment {segment.path}: its blocks hold {segment.read(W_BLOCK_BYTES)} "
            f"bytes, layer {name} of this engine {block_bytes}; a phase split's engines must "
            "serve the same model with the same dtype and block_size")
