"""Worker extension (``--worker-extension-cls``) of hot and cold engines.

vLLM mixes this class into its worker (docs/vllm-hooks.md, "Worker"), so the EngineCore
(and a test) reaches it with ``collective_rpc("weaver_...")``. It only connects vLLM's
objects to Weaver's runtimes; a pair links itself while serving, under both launchers (a
ColdLink thread makes regions, HotLink attaches between two steps;
weaver/weaving/pair_link.py):
- a cold worker opens its regions (weaver.weaving.cold.ColdWeaving), installs the poll
  points after its own operators and between split chunks, holds the step lock around its
  steps (patches/worker_step_lock.py) and starts the idle poller;
- a hot worker attaches the region (weaver.weaving.hot.HotWeaving) and hands it to its
  attention impls and metadata builders (weaver/vllm_ext/attention/backend.py).
"""

from __future__ import annotations

import atexit
import logging
import os
from pathlib import Path
from typing import Any

from weaver.patches import worker_step_lock
from weaver.vllm_ext.layers import (
    attention_layers,
    install_split_polls,
    poll_point_modules,
    split_stats,
)
from weaver.weaving.cold import ColdWeaving
from weaver.weaving.hot import HotWeaving
from weaver.weaving.plan import PairPlan
from weaver.weaving.poll_points import PollPoints

logger = logging.getLogger(__name__)


def _metadata_builders(runner: Any) -> list[Any]:
    return [builder for groups in runner.attn_groups for group in groups
            for builder in group.metadata_builders]


class WeaverWorkerExtension:
    _weaver_hot: HotWeaving | None = None
    _weaver_cold: ColdWeaving | None = None
    _weaver_poll_points: PollPoints | None = None  # over the cold model's operators
    _weaver_num_split = 0  # split operators polling between their chunks
    _weaver_cold_link: Any = None  # weaver.weaving.pair_link.ColdLink
    _weaver_placement_report: dict | None = None  # the hot scheduler's adaptive placement

    # --- hot side -----------------------------------------------------------------
    def weaver_attach_hot(self, plan_data: dict, cuda_handle_hex: str | None = None) -> dict:
        from vllm.model_executor.models.utils import extract_layer_index

        from weaver.vllm_ext.attention.backend import WovenAttentionImpl, WovenMetadataBuilder

        plan = PairPlan.from_dict(plan_data)
        remote_kv = None
        if plan.pool is not None:  # the region exists, so the cold side's pool does too
            from weaver.vllm_ext.attention.pool import RemotePoolKV

            remote_kv = RemotePoolKV(plan)
        runtime = HotWeaving.attach(
            plan, remote_kv, bytes.fromhex(cuda_handle_hex) if cuda_handle_hex else None)
        previous = self._weaver_hot
        if previous is not None:  # the cold engine restarted and created a new region
            try:
                runtime.take_over_from(previous)
            except ValueError:
                runtime.sender.close()
                raise
        runner = self.model_runner
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
        self._weaver_hot = runtime
        logger.info("hot worker attached region %s to %d attention layers (spin %.0f us)",
                    plan.region_name, len(layers),
                    runtime.sender.policy.spin_s * 1e6)
        return {"region": plan.region_name, "num_layers": len(layers)}

    # --- cold side ----------------------------------------------------------------
    def weaver_join_pairs(self, link_data: dict) -> dict:
        """Start serving this cold engine's weaving pairs (weaver/vllm_ext/pair_links.py):
        with no region yet, a ColdLink thread makes one for each hot engine that comes."""
        from weaver.vllm_ext.additional_config import LinkSection
        from weaver.weaving.pair_link import ColdLink
        from weaver.weaving.rendezvous import PairFiles

        link = LinkSection.from_dict(link_data)
        cold = self._weaver_start_cold()
        self._weaver_cold_link = ColdLink(PairFiles(Path(link.root)), list(link.pairs),
                                          link.lend_bytes, link.cold_model, cold,
                                          self._weaver_executor_for)
        self._weaver_cold_link.start()
        logger.info("cold worker waits for the hot engines of pair(s) %s (lends %.3f GiB)",
                    ", ".join(link.pairs), link.lend_bytes / 2**30)
        return {"pairs": list(link.pairs), "num_poll_points": len(self._weaver_poll_points),
                "num_split_operators": self._weaver_num_split}

    def _weaver_start_cold(self) -> ColdWeaving:
        cold = ColdWeaving.open([], self._weaver_executor_for)
        model = self.model_runner.get_model()
        modules = poll_point_modules(model)
        self._weaver_poll_points = PollPoints(modules, cold.poll)
        # Split operators (additional_config's split plan, applied at load time) poll
        # between their chunks with the same function as the poll points.
        num_split = install_split_polls(model, cold.poll)
        worker_step_lock.install(self, cold.step_meter)
        cold.start_idle_poller()
        self._weaver_cold = cold
        self._weaver_num_split = num_split
        atexit.register(self.weaver_close)
        logger.info("cold worker polls at %d points and in %d split operators",
                    len(modules), num_split)
        return cold

    def _weaver_executor_for(self, plan: PairPlan) -> Any:
        """What serves a hot model's tasks: the polling kernel on this GPU (a CUDA region),
        vLLM's CPU kernels over the region's KV, or over this engine's unified pool when the
        hot model's remote blocks live there."""
        if plan.transport == "cuda":
            from weaver.offload.cuda.transport import CudaPollingExecutor

            return CudaPollingExecutor()
        if plan.pool is None:
            from weaver.vllm_ext.attention.cpu_kernels import CpuPagedAttentionExecutor

            return CpuPagedAttentionExecutor(plan.shape)
        from weaver.vllm_ext.attention.pool import PoolTaskExecutor

        pool = getattr(self.model_runner, "weaver_pool", None)
        if pool is None:
            raise RuntimeError(
                f"weaving {plan.hot} -> {plan.cold} keeps remote KV in the unified pool, "
                "but this cold engine was not started with one")
        return PoolTaskExecutor(plan, pool)

    # --- operator splitting and profiling ------------------------------------------
    def weaver_split_stats(self) -> dict:
        """Per split operator kind: chunks, calls, chunk calls, polls between chunks."""
        return split_stats(self.model_runner.get_model())

    def weaver_profile_start(self) -> dict:
        from weaver.vllm_ext.engine.op_profiler import OpProfiler

        if getattr(self, "_weaver_profiler", None) is not None:
            raise RuntimeError("an operator profile is already running; stop it first")
        self._weaver_profiler = OpProfiler(self.model_runner.get_model())
        logger.info("operator profiling started: %d layers", self._weaver_profiler.num_layers)
        return {"num_layers": self._weaver_profiler.num_layers}

    def weaver_profile_stop(self) -> dict:
        profiler = getattr(self, "_weaver_profiler", None)
        if profiler is None:
            raise RuntimeError("no operator profile is running: call weaver_profile_start")
        self._weaver_profiler = None
        return profiler.stop()

    def weaver_time_attention(self, shape_data: dict, num_seqs: int, context_len: int) -> dict:
        from weaver.offload.layout import HotAttentionShape
        from weaver.vllm_ext.engine.op_profiler import time_attention

        return time_attention(HotAttentionShape(**shape_data), num_seqs, context_len)

    def weaver_time_split_overhead(self, in_features: int, out_features: int,
                                   num_tokens: int) -> float:
        from weaver.vllm_ext.engine.op_profiler import time_split_overhead

        return time_split_overhead(in_features, out_features, num_tokens)

    # --- unified KV pool (weaver/vllm_ext/attention/pool.py) --------------------------
    def weaver_pool_stats(self) -> dict:
        """The engine's tenant of its unified KV pool: steps, writes, live/peak blocks."""
        pool = getattr(self.model_runner, "weaver_pool", None)
        if pool is None:
            raise RuntimeError("this engine does not keep its KV in a unified pool")
        return pool.stats()

    # --- both ---------------------------------------------------------------------
    def weaver_info(self) -> dict:
        """Which Weaver this worker runs (a checkout or the installed one) and its pid."""
        import weaver

        return {"weaver_file": weaver.__file__, "pid": os.getpid()}

    def weaver_pair_load(self, placement_report: dict) -> dict | None:
        """The hot scheduler's adaptive placement asks how its pair is doing (cold TPOT
        growth, offload wait) and leaves its own state for weaver_stats; None before the
        region is attached."""
        self._weaver_placement_report = placement_report
        return None if self._weaver_hot is None else self._weaver_hot.pair_load()

    def weaver_stats(self) -> dict:
        """A hot worker's counters since the last call, for its HotLink to publish (a cold
        worker's ColdLink publishes its own)."""
        stats: dict[str, Any] = {}
        if self._weaver_hot is not None:
            stats["hot"] = self._weaver_hot.drain_stats()
            stats["hot"]["remote_blocks_used"] = self._weaver_remote_blocks_in_use()
            stats["hot"]["placement"] = self._weaver_placement_report
        return stats

    def _weaver_remote_blocks_in_use(self) -> int:
        """Remote blocks held by the requests now in the batch (ids >= the local count)."""
        runner = self.model_runner
        num_local_blocks = runner.kv_cache_config.num_blocks
        table = runner.input_batch.block_table.block_tables[0]
        first_ids = table.block_table.np[:, 0]
        counts = table.num_blocks_per_row
        return int(counts[(counts > 0) & (first_ids >= num_local_blocks)].sum())

    def weaver_close(self) -> None:
        if self._weaver_cold_link is not None:
            self._weaver_cold_link.close()
            self._weaver_cold_link = None
        if self._weaver_poll_points is not None:
            self._weaver_poll_points.remove()
        self._weaver_poll_points = None
        if self._weaver_cold is not None:
            self._weaver_cold.close()
