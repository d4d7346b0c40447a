"""Mux-Temporal (MuxServe §5's baseline): models sharing a GPU take turns, one iteration at
a time, over one shared KV pool with no quotas (first come, first served memory)."""

from __future__ import annotations

from weaver.sim.policies.base import Policy


class MuxTemporalPolicy(Policy):
    name = "mux_temporal"

    def build(self) -> None:
        for i, gpu in enumerate(self.plan.gpus):
            self.add_instance(self.cluster.make_instance(f"gpu{i}", gpu.models,
                                                          tp=gpu.tp))
