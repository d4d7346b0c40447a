"""Worker extension (``--worker-extension-cls``) of hot and cold engines: a facade.

vLLM mixes this class into its worker (docs/vllm-hooks.md, "Worker"), so the EngineCore
(and a test) reaches it with ``collective_rpc("weaver_...")``. Each method hands the call to
the part that does the job, made on first use:
- the hot side (worker_hot.py): attaches the region its cold engine made, answers the
  adaptive placement and the pair's HotLink;
- the cold side (worker_cold.py): serves its pairs' regions (a ColdLink thread makes one
  per hot engine that comes), with poll points, split chunks, the step lock and the idle
  poller;
- the profiler (worker_profiler.py): operator, attention and split timings.
A pair links itself while serving, under both launchers (weaver/weaving/pair_link.py).
"""

from __future__ import annotations

import atexit
import os

from weaver.vllm_ext.layers import split_stats
from weaver.vllm_ext.worker_cold import ColdSide
from weaver.vllm_ext.worker_hot import HotSide
from weaver.vllm_ext.worker_profiler import WorkerProfiler


class WeaverWorkerExtension:
    _weaver_hot_side: HotSide | None = None
    _weaver_cold_side: ColdSide | None = None
    _weaver_profiler: WorkerProfiler | None = None

    @property
    def _weaver_hot(self) -> HotSide:
        if self._weaver_hot_side is None:
            self._weaver_hot_side = HotSide(self)
        return self._weaver_hot_side

    @property
    def _weaver_cold(self) -> ColdSide:
        if self._weaver_cold_side is None:
            self._weaver_cold_side = ColdSide(self)
            atexit.register(self.weaver_close)
        return self._weaver_cold_side

    @property
    def _weaver_profiling(self) -> WorkerProfiler:
        if self._weaver_profiler is None:
            self._weaver_profiler = WorkerProfiler(self)
        return self._weaver_profiler

    # --- hot side -----------------------------------------------------------------
    def weaver_attach_hot(self, plan_data: dict, cuda_handle_hex: str | None = None) -> dict:
        return self._weaver_hot.attach(plan_data, cuda_handle_hex)

    def weaver_pair_load(self, placement_report: dict) -> list[dict | None] | None:
        """The hot scheduler's adaptive placement asks how its pairs are doing (each cold
        model's TPOT growth, the offload wait) and leaves its own state for weaver_stats;
        None before any region is attached."""
        return self._weaver_hot.pair_load(placement_report)

    def weaver_stats(self, cold: str) -> dict:
        """A hot worker's counters of its pair with `cold` since the last call, for that
        pair's HotLink to publish (a cold worker's ColdLink publishes its own)."""
        return self._weaver_hot.stats(cold) if self._weaver_hot_side is not None else {}

    # --- cold side ----------------------------------------------------------------
    def weaver_join_pairs(self, link_data: dict) -> dict:
        """Start serving this cold engine's weaving pairs (weaver/vllm_ext/pair_links.py)."""
        return self._weaver_cold.join(link_data)

    def weaver_close(self) -> None:
        if self._weaver_cold_side is not None:
            self._weaver_cold_side.close()

    # --- operator splitting and profiling ------------------------------------------
    def weaver_split_stats(self) -> dict:
        """Per split operator kind: chunks, calls, chunk calls, polls between chunks."""
        return split_stats(self.model_runner.get_model())

    def weaver_profile_start(self) -> dict:
        return self._weaver_profiling.start()

    def weaver_profile_stop(self) -> dict:
        return self._weaver_profiling.stop()

    def weaver_time_attention(self, shape_data: dict, num_seqs: int, context_len: int) -> dict:
        return WorkerProfiler.time_attention(shape_data, num_seqs, context_len)

    def weaver_time_split_overhead(self, in_features: int, out_features: int,
                                   num_tokens: int) -> float:
        return WorkerProfiler.time_split_overhead(in_features, out_features, num_tokens)

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

