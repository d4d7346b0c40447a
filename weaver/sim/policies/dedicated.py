"""Dedicated: every GPU serves exactly one model (the baseline of Weaver §5)."""

from __future__ import annotations

from weaver.sim.policies.base import Policy


class DedicatedPolicy(Policy):
    name = "dedicated"

    def build(self) -> None:
        for i, gpu in enumerate(self.plan.gpus):
            if len(gpu.models) != 1:
                raise ValueError(f"dedicated placement needs one model per GPU, GPU {i} has "
                                 f"{gpu.models}; use mux_temporal or muxserve to share GPUs")
            self.add_instance(self.cluster.make_instance(f"gpu{i}", gpu.models,
                                                          tp=gpu.tp))
