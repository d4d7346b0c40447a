"""A hot worker's side of weaving (weaver/vllm_ext/worker.py is the facade vLLM calls).

It attaches the region each of its cold engines made (weaver.weaving.hot.HotWeaving, one
per pair, held by a weaver.weaving.hot_pairs.HotPairs) and hands the pairs to the worker's
attention impls and metadata builders (weaver/vllm_ext/attention/backend.py); it answers
its scheduler's adaptive placement with the pairs' load and each pair's HotLink with its
counters.
"""

from __future__ import annotations

import logging
from typing import Any

from weaver.vllm_ext.additional_config import hot_plans
from weaver.vllm_ext.layers import attention_layers
from weaver.weaving.hot import HotWeaving
from weaver.weaving.hot_pairs import HotPairs
from weaver.weaving.plan import PairPlan

logger = logging.getLogger(__name__)


def _metadata_builders(runner: Any) -> list[Any]:
    return [builder for groups in runner.attn_groups for group in groups
            for builder in group.metadata_builders]


class HotSide:
    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.pairs: HotPairs | None = None
        self.placement_report: dict | None = None  # the hot scheduler's adaptive placement

    def attach(self, plan_data: dict, cuda_handle_hex: str | None = None) -> dict:
        from vllm.model_executor.models.utils import extract_layer_index

        from weaver.vllm_ext.attention.backend import WovenAttentionImpl, WovenMetadataBuilder

        plan = PairPlan.from_dict(plan_data)
        if self.pairs is None:
            self.pairs = HotPairs(hot_plans(self.worker.vllm_config))
        pairs = self.pairs
        index = pairs.index_of(plan.cold)
        remote_kv = None
        if plan.pool is not None:  # the region exists, so the cold side's pool does too
            from weaver.vllm_ext.attention.pool import RemotePoolKV

            remote_kv = RemotePoolKV(plan)
        runtime = HotWeaving.attach(
            plan, remote_kv, bytes.fromhex(cuda_handle_hex) if cuda_handle_hex else None)
        previous = pairs.colds[index]
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
            layer.impl.weaver_hot = pairs
        for builder in builders:
            builder.weaver_num_local_blocks = num_local_blocks
            builder.weaver_hot = pairs
        pairs.colds[index] = runtime
        logger.info("hot worker attached region %s of cold %r to %d attention layers (spin "
                    "%.0f us)", plan.region_name, plan.cold, len(layers),
                    runtime.sender.policy.spin_s * 1e6)
        return {"region": plan.region_name, "num_layers": len(layers)}

    def pair_load(self, placement_report: dict) -> list[dict | None] | None:
        """Each pair's load in plan order (None where its region is not attached); None
        before any is."""
        self.placement_report = placement_report
        if self.pairs is None or not self.pairs.attached():
            return None
        return [None if runtime is None else runtime.pair_load()
                for runtime in self.pairs.colds]

    def stats(self, cold: str) -> dict:
        """The counters of the pair with cold engine `cold` (drained), for its HotLink."""
        if self.pairs is None:
            return {}
        index = self.pairs.index_of(cold)
        runtime = self.pairs.colds[index]
        if runtime is None:
            return {}
        hot = runtime.drain_stats()
        hot["remote_blocks_used"] = self._remote_blocks_in_use(index)
        hot["placement"] = self.placement_report
        # The adaptive policy's preemptions for this cold's TPOT budget (a running total).
        shed = (self.placement_report or {}).get("cold_budget_preemptions") or []
        hot["cold_budget_preemptions"] = shed[index] if index < len(shed) else 0
        return {"hot": hot}

    def _remote_blocks_in_use(self, index: int) -> int:
        """Blocks of the `index`-th cold side's range held by the requests now in the batch."""
        runner = self.worker.model_runner
        start = self.pairs.remote_starts(runner.kv_cache_config.num_blocks)[index]
        end = start + self.pairs.plans[index].num_remote_blocks
        table = runner.input_batch.block_table.block_tables[0]
        first_ids = table.block_table.np[:, 0]
        counts = table.num_blocks_per_row
        here = (counts > 0) & (first_ids >= start) & (first_ids < end)
        return int(counts[here].sum())
