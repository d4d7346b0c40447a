"""A worker's profiling (weaver/vllm_ext/worker.py is the facade vLLM calls): per-operator
timings of the model's own steps, and timings of attention tasks and of split linears
(weaver/vllm_ext/engine/op_profiler.py), for the split planner and the calibrations."""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)


class WorkerProfiler:
    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.running: Any = None  # weaver.vllm_ext.engine.op_profiler.OpProfiler

    def start(self) -> dict:
        from weaver.vllm_ext.engine.op_profiler import OpProfiler

        if self.running is not None:
            raise RuntimeError("an operator profile is already running; stop it first")
        self.running = OpProfiler(self.worker.model_runner.get_model())
        logger.info("operator profiling started: %d layers", self.running.num_layers)
        return {"num_layers": self.running.num_layers}

    def stop(self) -> dict:
        if self.running is None:
            raise RuntimeError("no operator profile is running: call weaver_profile_start")
        profiler, self.running = self.running, None
        return profiler.stop()

    @staticmethod
    def time_attention(shape_data: dict, num_seqs: int, context_len: int) -> dict:
        from weaver.offload.layout import HotAttentionShape
        from weaver.vllm_ext.engine.op_profiler import time_attention

        return time_attention(HotAttentionShape(**shape_data), num_seqs, context_len)

    @staticmethod
    def time_split_overhead(in_features: int, out_features: int, num_tokens: int) -> float:
        from weaver.vllm_ext.engine.op_profiler import time_split_overhead

        return time_split_overhead(in_features, out_features, num_tokens)
