"""A cold worker's side of weaving (weaver/vllm_ext/worker.py is the facade vLLM calls).

It serves its pairs' regions (weaver.weaving.cold.ColdWeaving), made by a ColdLink thread
for each hot engine that comes (weaver/weaving/pair_link.py); installs the poll points
after its own operators and between split chunks, holds the step lock around its steps
(patches/worker_step_lock.py) and starts the idle poller.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from weaver.patches import worker_step_lock
from weaver.vllm_ext.additional_config import LinkSection
from weaver.vllm_ext.layers import install_split_polls, poll_point_modules
from weaver.weaving.cold import ColdWeaving
from weaver.weaving.plan import PairPlan
from weaver.weaving.poll_points import PollPoints

logger = logging.getLogger(__name__)


class ColdSide:
    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.cold: ColdWeaving | None = None
        self.poll_points: PollPoints | None = None  # over the cold model's operators
        self.num_split = 0  # split operators polling between their chunks
        self.link: Any = None  # weaver.weaving.pair_link.ColdLink

    def join(self, link_data: dict) -> dict:
        """Start serving the pairs of the link section: with no region yet, the ColdLink
        makes one for each hot engine that comes."""
        from weaver.weaving.pair_link import ColdLink
        from weaver.weaving.rendezvous import PairFiles

        link = LinkSection.from_dict(link_data)
        cold = self._start()
        self.link = ColdLink(PairFiles(Path(link.root)), list(link.pairs), link.lend_bytes,
                             link.cold_model, cold, self.executor_for)
        self.link.start()
        logger.info("cold worker waits for the hot engines of pair(s) %s (lends %.3f GiB)",
                    ", ".join(link.pairs), link.lend_bytes / 2**30)
        return {"pairs": list(link.pairs), "num_poll_points": len(self.poll_points),
                "num_split_operators": self.num_split}

    def _start(self) -> ColdWeaving:
        cold = ColdWeaving.open([], self.executor_for)
        model = self.worker.model_runner.get_model()
        modules = poll_point_modules(model)
        self.poll_points = PollPoints(modules, cold.poll)
        # Split operators (additional_config's split plan, applied at load time) poll
        # between their chunks with the same function as the poll points.
        self.num_split = install_split_polls(model, cold.poll)
        worker_step_lock.install(self.worker, cold.step_meter)
        cold.start_idle_poller()
        self.cold = cold
        logger.info("cold worker polls at %d points and in %d split operators",
                    len(modules), self.num_split)
        return cold

    def executor_for(self, plan: PairPlan) -> Any:
        """What serves a hot model's tasks: the polling kernel on this GPU (a CUDA region),
        vLLM's CPU kernels over the region's KV, or over the pool of pages the hot model's
        remote blocks live in (this engine's unified pool, or the loan pool its hot models
        share)."""
        if plan.transport == "cuda":
            from weaver.offload.cuda.transport import CudaPollingExecutor

            return CudaPollingExecutor()
        if plan.pool is None:
            from weaver.vllm_ext.attention.cpu_kernels import CpuPagedAttentionExecutor

            return CpuPagedAttentionExecutor(plan.shape)
        from weaver.vllm_ext.attention.pool import PoolTaskExecutor

        if plan.pool.owner is None:  # a loan pool the gateway hosts: mapped for the tasks
            return PoolTaskExecutor(plan)
        pool = getattr(self.worker.model_runner, "weaver_pool", None)
        if pool is None:
            raise RuntimeError(
                f"weaving {plan.hot} -> {plan.cold} keeps remote KV in the unified pool, "
                "but this cold engine was not started with one")
        return PoolTaskExecutor(plan, pool)

    def close(self) -> None:
        if self.link is not None:
            self.link.close()
            self.link = None
        if self.poll_points is not None:
            self.poll_points.remove()
        self.poll_points = None
        if self.cold is not None:
            self.cold.close()
            self.cold = None
