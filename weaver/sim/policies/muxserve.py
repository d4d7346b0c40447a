"""MuxServe (Duan et al., ICML'24, §4.2-4.3) on top of a placement from the planner.

Simplifications, stated: each instance is one GPU; prefill and decode jobs of co-located
models run one at a time (no SM partitioning), so the gain over Mux-Temporal comes from
ADBS: (1) scheduling picks the model with the least service per unit of request rate,
models with prompts to admit first, so a popular model is not starved by round-robin;
(2) KV memory is divided into per-model quotas, re-balanced periodically from each
model's use and backlog."""

from __future__ import annotations

from functools import partial

from weaver.sim.engine import Engine, Event
from weaver.sim.instance import Instance, Job, ModelServer
from weaver.sim.policies.base import Policy
from weaver.sim.profile import blocks_for

MIN_QUOTA_SHARE = 0.05  # no model's quota falls below this share of the pool


class MuxServeInstance(Instance):
    def __init__(self, engine: Engine, name: str, servers: list[ModelServer],
                 weights: dict[str, float]) -> None:
        super().__init__(engine, name, servers)
        self.weights = {m: max(weights[m], 1e-9) for m in self.servers}
        self.served_s = dict.fromkeys(self.servers, 0.0)
        self.set_quotas(self.weights)

    def set_quotas(self, shares: dict[str, float]) -> None:
        if len(self.servers) == 1:
            return
        total = sum(shares.values())
        spare = 1 - MIN_QUOTA_SHARE * len(shares)
        for name, server in self.servers.items():
            share = MIN_QUOTA_SHARE + spare * shares[name] / total
            pool_bytes = server.local.pool.capacity_bytes
            server.local.quota_blocks = int(share * pool_bytes // server.local.block_bytes)

    def rebalance(self) -> None:
        """ADBS: divide memory by each model's current use plus queued demand (bytes)."""
        demand = {}
        for name, server in self.servers.items():
            waiting = sum(blocks_for(r.trace.input_tokens + r.num_done, server.cfg.block_size)
                          for r in server.waiting)
            demand[name] = (server.local.num_blocks + waiting) * server.local.block_bytes
        if sum(demand.values()) > 0:
            self.set_quotas({m: d + 1.0 for m, d in demand.items()})

    def _share(self, name: str) -> float:
        return self.served_s[name] / self.weights[name]

    def select_job(self, exclude: set[str]) -> Job | None:
        names = [n for n in self.servers if n not in exclude]
        admitting = [n for n in names if self.servers[n].can_admit()]
        if admitting:
            return Job(self.servers[min(admitting, key=self._share)])
        ready = [n for n in names if self.servers[n].has_step()]
        if not ready:
            return None
        return Job(self.servers[min(ready, key=self._share)])

    def on_step(self, job: Job, dt: float) -> None:
        self.served_s[job.server.name] += dt


class MuxServePolicy(Policy):
    name = "muxserve"

    def build(self) -> None:
        config = self.cluster.config
        for i, gpu in enumerate(self.plan.gpus):
            weights = {m: config.model(m).rate / len(self.plan.gpus_of(m)) for m in gpu.models}
            factory = partial(MuxServeInstance, weights=weights)
            self.add_instance(self.cluster.make_instance(f"gpu{i}", gpu.models,
                                                         factory=factory))
        interval = config.muxserve.rebalance_interval_s
        self.cluster.engine.schedule(interval, "muxserve.rebalance", self._rebalance)

    def _rebalance(self, now: float) -> list[Event]:
        events: list[Event] = []
        for inst in self.instances:
            inst.rebalance()
            events.extend(inst.kick(now))  # a grown quota may admit what was waiting
        if now > self.cluster.config.duration_s and not any(i.num_queued
                                                             for i in self.instances):
            return events
        interval = self.cluster.config.muxserve.rebalance_interval_s
        return events + [self.cluster.engine.event(now + interval, "muxserve.rebalance",
                                                   self._rebalance)]
