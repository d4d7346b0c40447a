"""Worker extension (`worker_extension_cls`) of hot and cold engines.

vLLM mixes this class into its worker (vllm-notes §1), so the gateway reaches it with
`collective_rpc("weaver_…")`. Regions are opened here, at start-up, never on the request
path: the cold worker creates and owns each region, installs poll points after its own
operators and starts the idle poller; the hot worker attaches the region and hands it to
its attention layers.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from typing import Any

from weaver.offload.receiver import OffloadReceiver
from weaver.offload.sender import OffloadSender
from weaver.offload.shm import ShmRegion, host_wait_policy
from weaver.vllm_ext.poll_points import PollPoints
from weaver.vllm_ext.split_layers import install_split_polls, split_stats
from weaver.weaving.plan import PairPlan

logger = logging.getLogger(__name__)

ATTACH_TIMEOUT_S = 30.0
IDLE_WAIT_S = 0.05  # the idle poller's longest sleep; a task's doorbell wakes it at once


def _attention_layers(worker: Any) -> dict[str, Any]:
    from vllm.model_executor.layers.attention import Attention

    context = worker.model_runner.compilation_config.static_forward_context
    return {name: layer for name, layer in context.items() if isinstance(layer, Attention)}


def _poll_point_modules(model: Any) -> list[Any]:
    """The cold model's operators after which a poll runs (vllm-notes §4: their forward
    runs on every step in eager mode; the LM head runs inside LogitsProcessor)."""
    from vllm.model_executor.layers.attention import Attention
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.logits_processor import LogitsProcessor

    kinds = (LinearBase, Attention, LogitsProcessor)
    return [m for m in model.modules() if isinstance(m, kinds)]


class WeaverWorkerExtension:
    _weaver_hot: Any = None  # HotWeavingRuntime of a hot worker
    _weaver_receivers: list | None = None  # (region name, OffloadReceiver, task doorbell)
    _weaver_poll_points: Any = None  # PollPoints over the cold model's operators
    _weaver_stop: threading.Event | None = None
    _weaver_idle_served: int = 0

    # --- hot side -----------------------------------------------------------------
    def weaver_attach_hot(self, plan_data: dict) -> dict:
        from vllm.model_executor.models.utils import extract_layer_index

        from weaver.vllm_ext.hot_attention import HotWeavingRuntime, WeaverCPUAttentionImpl

        plan = PairPlan.from_dict(plan_data)
        region = ShmRegion.attach(plan.layout(), plan.region_name, wait_s=ATTACH_TIMEOUT_S)
        policy = host_wait_policy(region)
        remote_kv = None
        if plan.pool is not None:  # the region exists, so the cold side's pool does too
            from weaver.vllm_ext.pool_worker import RemotePoolKV

            remote_kv = RemotePoolKV(plan)
        runtime = HotWeavingRuntime(plan, OffloadSender(region, policy=policy), remote_kv)
        layers = _attention_layers(self)
        for name, layer in layers.items():
            if not isinstance(layer.impl, WeaverCPUAttentionImpl):
                raise RuntimeError(
                    f"layer {name} uses {type(layer.impl).__name__}, not Weaver's attention; "
                    "is the weaver vLLM plugin installed (pip install -e .)?")
            layer.impl.weaver_layer_index = extract_layer_index(name)
            layer.impl.weaving_runtime = runtime
        self._weaver_hot = runtime
        logger.info("hot worker attached region %s to %d attention layers (spin %.0f us)",
                    plan.region_name, len(layers), policy.spin_s * 1e6)
        return {"region": plan.region_name, "num_layers": len(layers)}

    # --- cold side ----------------------------------------------------------------
    def weaver_open_cold(self, plans_data: list[dict]) -> dict:
        from weaver.vllm_ext.cpu_paged_attention import CpuPagedAttentionExecutor

        receivers = []
        for data in plans_data:
            plan = PairPlan.from_dict(data)
            if plan.pool is not None:
                from weaver.vllm_ext.pool_worker import PoolTaskExecutor

                pool = getattr(self.model_runner, "weaver_pool", None)
                if pool is None:
                    raise RuntimeError(
                        f"weaving {plan.hot} -> {plan.cold} keeps remote KV in the unified "
                        "pool, but this cold engine was not started with one")
                executor = PoolTaskExecutor(plan, pool)
            else:
                executor = CpuPagedAttentionExecutor(plan.shape)
            region = ShmRegion.create(plan.layout(), plan.region_name)
            receiver = OffloadReceiver(region, executor)
            receivers.append((plan.region_name, receiver, receiver))
        self._weaver_receivers = receivers
        model = self.model_runner.get_model()
        modules = _poll_point_modules(model)
        self._weaver_poll_points = PollPoints(modules, self._weaver_poll)
        # Split operators (additional_config's split plan, applied at load time) poll
        # between their chunks with the same function as the poll points.
        num_split = install_split_polls(model, self._weaver_poll)
        # The cold model's own steps and the offloaded tasks never run at the same time:
        # vLLM's CPU kernels share scratch buffers across threads (running both at once
        # crashed the worker), and on the GPU the poll kernel is likewise serialised on the
        # cold stream. During a step, tasks are served at the poll points (same thread);
        # between steps, by the idle poller, which takes the step lock to serve.
        self._weaver_step_lock = threading.Lock()
        for name in ("execute_model", "sample_tokens"):
            method = getattr(self, name, None)
            if method is not None:
                setattr(self, name, self._weaver_in_step(method))
        self._weaver_stop = threading.Event()
        self._weaver_idle_thread = threading.Thread(
            target=self._weaver_idle_loop, name="weaver-idle-poller", daemon=True)
        self._weaver_idle_thread.start()
        atexit.register(self.weaver_close)
        logger.info("cold worker serves %d region(s) with %d poll points, %d split operators",
                    len(receivers), len(modules), num_split)
        return {"regions": [p["region_name"] for p in plans_data],
                "num_poll_points": len(modules), "num_split_operators": num_split}

    # --- operator splitting and profiling (architecture.md part 7) ---------------
    def weaver_split_stats(self) -> dict:
        """Per split operator kind: chunks, calls, chunk calls, polls between chunks."""
        return split_stats(self.model_runner.get_model())

    def weaver_profile_start(self) -> dict:
        from weaver.vllm_ext.op_profiler import OpProfiler

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
        from weaver.vllm_ext.op_profiler import time_attention

        return time_attention(HotAttentionShape(**shape_data), num_seqs, context_len)

    def weaver_time_split_overhead(self, in_features: int, out_features: int,
                                   num_tokens: int) -> float:
        from weaver.vllm_ext.op_profiler import time_split_overhead

        return time_split_overhead(in_features, out_features, num_tokens)

    def _weaver_poll(self) -> None:
        for _, receiver, _ in self._weaver_receivers or ():
            receiver.poll()

    def _weaver_in_step(self, method: Any) -> Any:
        def stepping(*args: Any, **kwargs: Any) -> Any:
            with self._weaver_step_lock:
                return method(*args, **kwargs)

        return stepping

    def _weaver_idle_loop(self) -> None:
        receivers = self._weaver_receivers or []
        wait_s = IDLE_WAIT_S / max(1, len(receivers))
        while not self._weaver_stop.is_set():
            for _, receiver, _ in receivers:
                # Sleeps on the region's doorbell (no busy-wait: the machine's other
                # engine needs the core); a published task wakes it at once.
                if not receiver.wait_for_task(wait_s) and not receiver.has_pending():
                    continue
                with self._weaver_step_lock:
                    if receiver.poll(by_idle_poller=True):
                        self._weaver_idle_served += 1

    # --- unified KV pool (pool_worker.py) ------------------------------------------
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

    def weaver_stats(self) -> dict:
        stats: dict[str, Any] = {}
        if self._weaver_hot is not None:
            stats["hot"] = self._weaver_hot.drain_stats()
            stats["hot"]["remote_blocks_used"] = self._weaver_remote_blocks_in_use()
        if self._weaver_receivers:
            stats["cold"] = [{"region": name, **vars(receiver.stats)}
                             for name, receiver, _ in self._weaver_receivers]
            stats["cold_served_by_idle_poller"] = self._weaver_idle_served
        return stats

    def _weaver_remote_blocks_in_use(self) -> int:
        """Remote blocks held by the requests now in the batch (ids >= the local count)."""
        num_local_blocks = int(self.model_runner.kv_caches[0].shape[0])
        table = self.model_runner.input_batch.block_table.block_tables[0]
        first_ids = table.block_table.np[:, 0]
        counts = table.num_blocks_per_row
        return int(counts[(counts > 0) & (first_ids >= num_local_blocks)].sum())

    def weaver_close(self) -> None:
        if self._weaver_poll_points is not None:
            self._weaver_poll_points.remove()
        self._weaver_poll_points = None
        if self._weaver_stop is not None:
            self._weaver_stop.set()
            self._weaver_idle_thread.join(timeout=5)
        for _, receiver, _ in self._weaver_receivers or ():
            receiver.close()
        self._weaver_receivers = None
