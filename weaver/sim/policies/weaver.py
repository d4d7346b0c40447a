"""Weaver: a hot GPU places a share of its sequences' KV and decode attention on a cold GPU.

For each (hot GPU, cold GPU) pair of the plan, the cold GPU lends `region_fraction` of its
KV memory (or the deployment's lent blocks) as a remote pool; a hot GPU in several pairs
has a pool on each cold GPU, a new remote sequence going to the one the engine's scheduler
would pick (weaving/placement.py cold_order), the step waiting for the slowest cold. The
hot scheduler admits against local and remote capacity, so its batches grow: with
`offload_policy: fixed`, remote first until `offload_ratio` of its running sequences are
remote; with `overflow`, remote only once local KV is full (so weaving costs only the cold
side's polling while local memory suffices).

Costs, from `OffloadCostModel`: per layer the hot step waits for q/kv transfer, the poll
wait on the cold side and the remote attention, minus the local attention it overlaps
with; the cold GPU's steps stretch by the share of time it spends on that attention plus a
per-step polling cost (Weaver §3, §5)."""

from __future__ import annotations

from weaver.sim.instance import BlockPool, Instance, RemotePool, SeqSet
from weaver.sim.perf_model import (
    OffloadCostModel,
    PerfModel,
    PollWaitFn,
    mg1_poll_wait,
    operator_fractions,
    plan_cold_split,
    split_operator_fractions,
)
from weaver.sim.plan import WeavePair
from weaver.sim.policies.muxserve import MuxServePolicy
from weaver.weaving.placement import AUTO, placement_for


class WeaverPolicy(MuxServePolicy):
    """MuxServe's placement and scheduling where GPUs are shared, plus weaving pairs."""

    name = "weaver"
    poll_wait_fn: PollWaitFn = staticmethod(mg1_poll_wait)

    def build(self) -> None:
        super().build()
        self._loan_pools: dict[int, BlockPool] = {}  # cold GPU -> the loan its hots share
        for pair in self.plan.pairs:
            self._weave(pair)

    def _weave(self, pair: WeavePair) -> None:
        spec = self.cluster.config.weaving
        hot_gpu, cold_gpu = pair.hot_gpu, pair.cold_gpu
        ratio, remote_blocks = pair.offload_ratio, pair.remote_blocks
        hot, cold = self.instances[hot_gpu], self.instances[cold_gpu]
        if ratio != AUTO and ratio <= 0:
            return
        if pair.loan_quota_blocks is not None and remote_blocks is not None:
            # A loan pool: one pool of the whole loan for the cold GPU's hot models, each
            # bounded by its quota (ADBS's floor for the others; its rebalancing delay, a
            # second, is not modelled).
            block_bytes = next(iter(hot.servers.values())).local.block_bytes
            loan = self._loan_pools.setdefault(cold_gpu,
                                               BlockPool(remote_blocks * block_bytes))
            regions = [loan] * len(hot.servers)
        elif remote_blocks is not None:
            # A deployment's lent region (lend_kv_gib) is memory of its own, apart from the
            # cold engine's KV cache, sized in the hot model's blocks (weaving/plan.py).
            per_server = [remote_blocks * s.local.block_bytes for s in hot.servers.values()]
            regions = [BlockPool(b / len(per_server)) for b in per_server]
        else:
            cold_pool = next(iter(cold.servers.values())).local.pool
            lent = cold_pool.capacity_bytes * spec.region_fraction
            if lent <= 0:
                return
            cold_pool.capacity_bytes -= lent
            regions = [BlockPool(lent / len(hot.servers))] * len(hot.servers)
        for server, region in zip(hot.servers.values(), regions, strict=True):
            if server.remotes and server.offload_ratio != ratio:
                raise ValueError(f"GPU {hot_gpu} weaves into several cold GPUs with different "
                                 "offload ratios; give its pairs one ratio (one policy)")
            if not server.remotes:  # one policy over every cold the hot model weaves into
                server.offload_ratio = ratio
                server.offload_policy = "ratio" if ratio == AUTO else spec.offload_policy
                server.placement = placement_for(ratio, pair.adaptive_targets())
            # Same device type everywhere, so the hot model's attention costs the same on
            # the cold GPU; a heterogeneous cluster would pass the cold device's profile.
            server.remotes.append(RemotePool(
                SeqSet(region, server.cfg.block_size, server.local.block_bytes,
                       quota_blocks=pair.loan_quota_blocks), cold,
                OffloadCostModel(server.perf, server.perf, self.cluster.link(server.name),
                                 self.poll_wait_fn)))
        cold.idle_poll_interval_s = spec.idle_poll_interval_us * 1e-6
        if spec.control == "cpu":
            # The paper's baseline: the host queues the task behind the kernels it already
            # submitted for the cold step, so the step is one operator to wait out.
            cold.operator_fractions = (1.0,)
            cold.poll_overhead_s = 0.0
            return
        cold.poll_overhead_s = spec.poll_overhead_us * 1e-6
        if spec.split != "none":
            self._split(cold, next(iter(hot.servers.values())).perf)

    def _split(self, cold: Instance, hot_perf: PerfModel) -> None:
        """The cold model's operators cut as the deployment (or Algorithm 1) says: a task
        waits behind a chunk, and each extra chunk lengthens the cold step."""
        spec = self.cluster.config.weaving
        overhead_s = spec.chunk_overhead_us * 1e-6
        cold_perf = next(iter(cold.servers.values())).perf
        chunks = spec.split if isinstance(spec.split, dict) else \
            plan_cold_split(cold_perf, hot_perf, overhead_s)
        shape = cold_perf.shape
        cold.operator_fractions = split_operator_fractions(shape, tuple(sorted(chunks.items())))
        num_extra = len(cold.operator_fractions) - len(operator_fractions(shape))
        cold.poll_overhead_s += num_extra * overhead_s
        cold.split_chunks = dict(chunks)
