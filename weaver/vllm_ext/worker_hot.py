"""A hot worker's side of weaving (weaver/vllm_ext/worker.py is the facade vLLM calls).

It attaches the region its cold engine made (weaver.weaving.hot.HotWeaving) and hands it
to the worker's attention impls and metadata builders (weaver/vllm_ext/attention/
backend.py); it answers its scheduler's adaptive placement with the pair's load and its
HotLink with the counters.
"""

from __future__ import annotations

import logging
from typing import Any

from weaver.vllm_ext.layers import attention_layers
from weaver.weaving.hot import HotWeaving
from weaver.weaving.plan import PairPlan

logger = logging.getLogger(__name__)


def _metadata_builders(runner: Any) -> list[Any]:
    return [builder for groups in runner.attn_groups for group in groups
            for builder in group.metadata_builders]


class HotSide:
    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.runtime: HotWeaving | None = None
        self.placement_report: dict | None = None  # the hot scheduler's adaptive placement

    def attach(self, plan_data: dict, cuda_handle_hex: str | None = None) -> dict:
        from vllm.model_executor.models.utils import extract_layer_index

        from weaver.vllm_ext.attention.backend import WovenAttentionImpl, WovenMetadataBuilder

        plan = PairPlan.from_dict(plan_data)
        remote_kv = None
        if plan.pool is not None:  # the region exists, so the cold side's pool does too
            from weaver.vllm_ext.attention.pool import RemotePoolKV

            remote_kv = RemotePoolKV(plan)
        runtime = HotWeaving.attach(
            plan, remote_kv, bytes.fromhex(cuda_handle_hex) if cuda_handle_hex else None)
        previous = self.runtime
        if previous is not None:  # the cold engine restarted and created a new region
            try:
                runtime.take_over_from(previous)
            except ValueError:
                runtime.sender.close()
                raise
        runner = self.worker.model_runner
        # The scheduler's local pool has exactly the blocks of vLLM's KV-cache config;
        # remote ids start there (weaver/vllm_ext/scheduler.py).
        num_local_blocks = runner.kv_cache_config.num_blocks
        layers = attention_layers(runner)
        builders = _metadata_builders(runner)
        for owner in [*(layer.impl for layer in layers.values()), *builders]:
            if not isinstance(owner, WovenAttentionImpl | WovenMetadataBuilder):
                raise RuntimeError(
                    f"{type(owner).__name__} is not Weaver's attention; is the weaver vLLM "
                    "plugin installed (pip install -e .)?")
        for name, layer in layers.items():
            layer.impl.weaver_layer_index = extract_layer_index(name)
            layer.impl.weaver_num_local_slots = num_local_blocks * runner.cache_config.block_size
            layer.impl.weaver_hot = runtime
        for builder in builders:
            builder.weaver_num_local_blocks = num_local_blocks
            builder.weaver_hot = runtime
        self.runtime = runtime
        logger.info("hot worker attached region %s to %d attention layers (spin %.0f us)",
                    plan.region_name, len(layers), runtime.sender.policy.spin_s * 1e6)
        return {"region": plan.region_name, "num_layers": len(layers)}

    def pair_load(self, placement_report: dict) -> dict | None:
        self.placement_report = placement_report
        return None if self.runtime is None else self.runtime.pair_load()

    def stats(self) -> dict:
        if self.runtime is None:
            return {}
        hot = self.runtime.drain_stats()
        hot["remote_blocks_used"] = self._remote_blocks_in_use()
        hot["placement"] = self.placement_report
        return {"hot": hot}

    def _remote_blocks_in_use(self) -> int:
        """Remote blocks held by the requests now in the batch (ids >= the local count)."""
        runner = self.worker.model_runner
        num_local_blocks = runner.kv_cache_config.num_blocks
        table = runner.input_batch.block_table.block_tables[0]
        first_ids = table.block_table.np[:, 0]
        counts = table.num_blocks_per_row
        return int(counts[(counts > 0) & (first_ids >= num_local_blocks)].sum())
