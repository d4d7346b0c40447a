"""A placement plan: which models each GPU serves, its Splitwise role, and weaving pairs.

Policies read a plan; the planner writes one; configs may give one explicitly."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from weaver.mux.turns import DEFAULT_SKIP_LIMIT
from weaver.sim.config import PlacementSpec, SimConfig
from weaver.weaving.placement import AUTO, SLO_TPOT_SHARE, AdaptiveTargets


@dataclass
class MuxPlan:
    """How a shared GPU's models take turns (config.MuxSpec)."""

    mode: str = "temporal"  # or "spatial-temporal"
    weights: dict[str, float] = field(default_factory=dict)  # unset: rate per replica
    skip_limit: int = DEFAULT_SKIP_LIMIT
    own_kv: bool = False  # each model its own num_blocks, no ADBS quotas


@dataclass
class GpuPlan:
    models: list[str]
    role: str = "both"  # Splitwise pool: "prompt", "token" or "both"
    mux: MuxPlan | None = None
    tp: int = 1  # GPUs the entry spans (tensor parallelism)


@dataclass
class WeavePair:
    hot_gpu: int
    cold_gpu: int
    offload_ratio: float | str  # a share in [0, 1], or "auto"
    remote_blocks: int | None = None  # blocks lent to the hot model; None: region_fraction
    # offload_ratio "auto": the targets it holds weaving to (a deployment's weaving entry).
    hot_tpot_ms: float | None = None
    cold_tpot_budget: float = 1.10
    # A loan pool shared with the cold GPU's other hot models (config.PairSpec): this hot
    # model's bound in it; None: remote_blocks are a region of its own.
    loan_quota_blocks: int | None = None

    def adaptive_targets(self) -> AdaptiveTargets:
        return AdaptiveTargets.of_pair(self.hot_tpot_ms, self.cold_tpot_budget)


@dataclass
class Plan:
    gpus: list[GpuPlan]
    pairs: list[WeavePair] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Plan:
        gpus = [GpuPlan(**{**g, "mux": MuxPlan(**g["mux"]) if g.get("mux") else None})
                for g in data["gpus"]]
        return cls(gpus, [WeavePair(**p) for p in data.get("pairs", [])])

    def gpus_of(self, model: str) -> list[int]:
        return [i for i, g in enumerate(self.gpus) if model in g.models]


def plan_from_spec(spec: PlacementSpec, default_ratio: float) -> Plan:
    gpus = [GpuPlan(list(g.models), g.role,
                    MuxPlan(**g.mux.model_dump()) if g.mux is not None else None, g.tp)
            for g in spec.gpus]
    pairs = [WeavePair(p.hot_gpu, p.cold_gpu,
                       default_ratio if p.offload_ratio is None else p.offload_ratio,
                       p.remote_blocks, p.hot_tpot_ms, p.cold_tpot_budget,
                       p.loan_quota_blocks)
             for p in spec.pairs]
    return Plan(gpus, pairs)


def default_plan(config: SimConfig) -> Plan:
    """The config's placement, or a simple one: models in decreasing rate take GPUs
    round-robin (so with more GPUs than models the popular ones get the extra replicas;
    with fewer, several models share a GPU). Weaving pairs the hottest GPUs with the
    coldest ones."""
    if config.placement is not None:
        return plan_from_spec(config.placement, config.weaving.offload_ratio)
    models = sorted(config.models, key=lambda m: -m.rate)
    num_gpus = config.cluster.num_gpus
    gpus = [GpuPlan([]) for _ in range(num_gpus)]
    for i in range(max(num_gpus, len(models))):
        model = models[i % len(models)].name
        if model not in gpus[i % num_gpus].models:
            gpus[i % num_gpus].models.append(model)
    return Plan(gpus, hot_cold_pairs(config, gpus, config.weaving.offload_ratio))


def hot_cold_pairs(config: SimConfig, gpus: list[GpuPlan],
                   ratio: float | str) -> list[WeavePair]:
    """Pair the GPU with the highest per-replica load with the one with the lowest, and so
    on inwards, while the hot side's load exceeds the cold side's."""
    loads = _loads(config, gpus)
    order = _by_load(loads)
    pairs = []
    for k in range(len(order) // 2):
        hot, cold = order[k], order[-1 - k]
        if loads[hot] <= loads[cold]:
            break
        pairs.append(_pair(config, hot, cold, ratio))
    return pairs


def fan_in_pairs(config: SimConfig, gpus: list[GpuPlan],
                 ratio: float | str) -> list[WeavePair]:
    """The most loaded GPU weaving into every GPU less loaded than half of it (a hot model
    over several colds); empty unless there are two such colds at least."""
    loads = _loads(config, gpus)
    order = _by_load(loads)
    hot = order[0]
    colds = [i for i in order[1:] if loads[i] < 0.5 * loads[hot]]
    if len(colds) < 2:
        return []
    return [_pair(config, hot, cold, ratio) for cold in sorted(colds)]


def _pair(config: SimConfig, hot: int, cold: int, ratio: float | str) -> WeavePair:
    # `auto` held to the SLO's TPOT, as a deployment of the plan would be.
    target = SLO_TPOT_SHARE * config.slo.tpot_ms if ratio == AUTO else None
    return WeavePair(hot, cold, ratio, hot_tpot_ms=target)


def _loads(config: SimConfig, gpus: list[GpuPlan]) -> list[float]:
    """Requests per second each GPU serves: its models' rates, shared among their replicas."""
    replicas = {m: sum(m in g.models for g in gpus) for g in gpus for m in g.models}
    return [sum(config.model(m).rate / replicas[m] for m in g.models) for g in gpus]


def _by_load(loads: list[float]) -> list[int]:
    """GPU indices, the most loaded first (ties: lower index)."""
    return sorted(range(len(loads)), key=lambda i: (-loads[i], i))
