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
from typing import Any

from weaver.offload.channel import OffloadReceiver, OffloadSender
from weaver.offload.shm_transport import ShmRegion
from weaver.weaving.plan import PairPlan

logger = logging.getLogger(__name__)

ATTACH_TIMEOUT_S = 30.0


def _attention_layers(worker: Any) -> dict[str, Any]:
    from vllm.model_executor.layers.attention import Attention

    context = worker.model_runner.compilation_config.static_forward_context
    return {name: layer for name, layer in context.items() if isinstance(layer, Attention)}


def _poll_point_modules(model: Any) -> list[Any]:
    """The cold model's operators after which a poll runs (vllm-notes §4: forward hooks
    fire on every step in eager mode; the LM head runs inside LogitsProcessor)."""
    from vllm.model_executor.layers.attention import Attention
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.logits_processor import LogitsProcessor

    kinds = (LinearBase, Attention, LogitsProcessor)
    return [m for m in model.modules() if isinstance(m, kinds)]


class WeaverWorkerExtension:
    _weaver_hot: Any = None  # HotWeavingRuntime of a hot worker
    _weaver_receivers: list | None = None  # (region name, OffloadReceiver) of a cold worker
    _weaver_hooks: list | None = None

    # --- hot side -----------------------------------------------------------------
    def weaver_attach_hot(self, plan_data: dict) -> dict:
        from vllm.model_executor.models.utils import extract_layer_index

        from weaver.vllm_ext.hot_attention import HotWeavingRuntime, WeaverCPUAttentionImpl

        plan = PairPlan.from_dict(plan_data)
        region = ShmRegion.attach(plan.layout(), plan.region_name, wait_s=ATTACH_TIMEOUT_S)
        runtime = HotWeavingRuntime(plan, OffloadSender(region))
        layers = _attention_layers(self)
        for name, layer in layers.items():
            if not isinstance(layer.impl, WeaverCPUAttentionImpl):
                raise RuntimeError(
                    f"layer {name} uses {type(layer.impl).__name__}, not Weaver's attention; "
                    "is the weaver vLLM plugin installed (pip install -e .)?")
            layer.impl.weaver_layer_index = extract_layer_index(name)
            layer.impl.weaving_runtime = runtime
        self._weaver_hot = runtime
        logger.info("hot worker attached region %s to %d attention layers",
                    plan.region_name, len(layers))
        return {"region": plan.region_name, "num_layers": len(layers)}

    # --- cold side ----------------------------------------------------------------
    def weaver_open_cold(self, plans_data: list[dict]) -> dict:
        from weaver.vllm_ext.cpu_paged_attention import CpuPagedAttentionExecutor

        receivers = []
        for data in plans_data:
            plan = PairPlan.from_dict(data)
            region = ShmRegion.create(plan.layout(), plan.region_name)
            receiver = OffloadReceiver(region, CpuPagedAttentionExecutor(plan.shape))
            receiver.start_idle_poller()
            receivers.append((plan.region_name, receiver))
        self._weaver_receivers = receivers
        modules = _poll_point_modules(self.model_runner.get_model())
        self._weaver_hooks = [m.register_forward_hook(self._weaver_poll) for m in modules]
        atexit.register(self.weaver_close)
        logger.info("cold worker serves %d region(s) with %d poll points",
                    len(receivers), len(modules))
        return {"regions": [p["region_name"] for p in plans_data],
                "num_poll_points": len(modules)}

    def _weaver_poll(self, *_: Any) -> None:
        for _, receiver in self._weaver_receivers or ():
            receiver.poll()

    # --- both ---------------------------------------------------------------------
    def weaver_stats(self) -> dict:
        stats: dict[str, Any] = {}
        if self._weaver_hot is not None:
            stats["hot"] = self._weaver_hot.drain_stats()
            stats["hot"]["remote_blocks_used"] = self._weaver_remote_blocks_in_use()
        if self._weaver_receivers:
            stats["cold"] = [{"region": name, **vars(receiver.stats)}
                             for name, receiver in self._weaver_receivers]
        return stats

    def _weaver_remote_blocks_in_use(self) -> int:
        """Remote blocks held by the requests now in the batch (ids >= the local count)."""
        num_local_blocks = int(self.model_runner.kv_caches[0].shape[0])
        table = self.model_runner.input_batch.block_table.block_tables[0]
        first_ids = table.block_table.np[:, 0]
        counts = table.num_blocks_per_row
        return int(counts[(counts > 0) & (first_ids >= num_local_blocks)].sum())

    def weaver_close(self) -> None:
        for hook in self._weaver_hooks or ():
            hook.remove()
        self._weaver_hooks = None
        for _, receiver in self._weaver_receivers or ():
            receiver.close()
        self._weaver_receivers = None
