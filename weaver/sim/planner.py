"""Placement planner: MuxServe's enumeration + greedy (§4.2) extended with weaving.

1. A throughput estimator gives each model's capacity on one GPU under the TPOT SLO (the
   best batch size whose decode step fits the SLO and whose KV fits in memory).
2. Enumeration: for each threshold of "small" demand, models needing less than that share
   of a GPU are packed together (first-fit decreasing on demand), the rest get replicas,
   and spare GPUs go greedily to the model with the highest demand per replica.
3. The best candidates by estimate are simulated under `muxserve`; the best plan then
   tries weaving (hot GPUs paired with the least loaded ones) at two fixed offload ratios
   and with the engine's adaptive placement (`offload_ratio: auto`), and, where two GPUs
   or more carry under half the busiest one's load, that GPU weaving into all of them
   (a hot model over several colds, `auto`).
The plan with the highest simulated goodput wins (ties: higher token throughput); a woven
plan must beat the plain one by more than 1 %, and keep each cold model's mean TPOT within
its pair's `cold_tpot_budget` of the same placement unwoven (the promise weaving makes to
the cold model, which goodput alone does not see while the cold model still meets its
SLO). The dedicated placement (GPUs dealt round-robin by rate) is simulated as the
baseline.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from weaver.sim.cluster import Cluster
from weaver.sim.config import ModelSpec, SimConfig
from weaver.sim.engine import Engine
from weaver.sim.plan import (
    GpuPlan,
    MuxPlan,
    Plan,
    default_plan,
    fan_in_pairs,
    hot_cold_pairs,
)
from weaver.sim.runner import simulate
from weaver.sim.workload import mean_lengths
from weaver.weaving.placement import AUTO

logger = logging.getLogger(__name__)

SMALL_DEMAND_THRESHOLDS = (0.0, 0.25, 0.5, 0.9)
# (offload policy, offload ratio) pairs tried on the best placement.
# (simulated offload policy, offload_ratio): two fixed shares, and the engine's adaptive
# placement ("auto", weaver/weaving/placement.py), which a written plan serves as such.
WEAVING_CHOICES = (("fixed", 0.25), ("fixed", 0.5), ("ratio", AUTO))
FAN_IN_CHOICE = ("ratio", AUTO)  # the one tried with the busiest GPU over several colds
MIN_WEAVING_GAIN = 0.01  # a woven plan must beat the plain one by this share
MAX_PACKED_DEMAND = 0.9  # leave headroom on shared GPUs: queueing grows near saturation
MIN_KV_SHARE = 0.2  # a shared GPU keeps at least this share of its memory for KV


def estimate_capacity(cluster: Cluster, spec: ModelSpec) -> float:
    """Requests per second one GPU sustains for this model under the TPOT SLO."""
    perf = cluster.perf(spec.name)
    kv_tokens = cluster.kv_capacity_bytes([spec.name]) / perf.shape.kv_bytes_per_token
    tpot_s = cluster.config.slo.tpot_ms / 1000
    budget = cluster.config.server.max_num_batched_tokens
    prefill_per_token = perf.prefill_time(budget) / budget
    mean_input, mean_output = mean_lengths(cluster.config.workload)
    mean_context = mean_input + mean_output / 2
    best = 0.0
    for b in range(1, cluster.config.server.max_num_seqs + 1):
        context = b * mean_context
        step = perf.decode_time(b, int(context))
        if context > kv_tokens or step > tpot_s:
            break
        per_request = mean_output * step / b + mean_input * prefill_per_token
        best = max(best, 1.0 / per_request)
    return best


@dataclass
class Candidate:
    plan: Plan
    policy: str
    estimate_rps: float
    label: str
    result: dict | None = field(default=None, repr=False)
    offload_policy: str | None = None
    # woven candidates: each cold model's mean TPOT over the same placement unwoven
    cold_tpot_factors: dict[str, float] = field(default_factory=dict)

    @property
    def is_within_cold_budget(self) -> bool:
        budget: dict[str, float] = {}
        for pair in self.plan.pairs:  # every model of a cold device; the tightest budget
            for name in self.plan.gpus[pair.cold_gpu].models:
                budget[name] = min(budget.get(name, math.inf), pair.cold_tpot_budget)
        return all(factor <= budget[name] for name, factor in self.cold_tpot_factors.items())

    @property
    def score(self) -> tuple[float, float]:
        """Simulated goodput, ties broken by token throughput."""
        if not self.result:
            return (-1.0, -1.0)
        total = self.result["summary"]["_all"]
        return (round(total["goodput_rps"], 6), total["output_tokens_per_s"])


def place(cluster: Cluster, capacities: dict[str, float], threshold: float) -> Plan | None:
    """Pack models below `threshold` GPUs of demand; give the rest replicas greedily."""
    config = cluster.config
    demand = {m.name: m.rate / max(capacities[m.name], 1e-9) for m in config.models}
    small = sorted((n for n, d in demand.items() if d < threshold), key=lambda n: -demand[n])
    bins: list[list[str]] = []
    loads: list[float] = []
    for name in small:  # first-fit decreasing
        fit = next((i for i, load in enumerate(loads)
                    if load + demand[name] <= MAX_PACKED_DEMAND
                    and _fits(cluster, bins[i] + [name])), None)
        if fit is None:
            bins.append([name])
            loads.append(demand[name])
        else:
            bins[fit].append(name)
            loads[fit] += demand[name]
    large = [n for n in demand if n not in small]
    if len(bins) + len(large) > config.cluster.num_gpus:
        return None
    # On cpu cores a shared device is a deployment's mux group: each engine keeps its own
    # KV blocks, a prefill may run beside a decode (what `--deployments` writes).
    shared = MuxPlan(mode="spatial-temporal", own_kv=True) if cluster.device is None else None
    gpus = [GpuPlan(b, mux=shared if len(b) > 1 else None) for b in bins]
    gpus += [GpuPlan([n]) for n in large]
    # Greedy: each spare GPU becomes one more dedicated replica of the model with the
    # highest demand per GPU it holds (a packed model holds a share of its GPU).
    held = {n: 0.0 for n in demand}
    for gpu in gpus:
        for n in gpu.models:
            held[n] += 1.0 / len(gpu.models)
    for _ in range(config.cluster.num_gpus - len(gpus)):
        name = max(demand, key=lambda n: (demand[n] / held[n], n))
        gpus.append(GpuPlan([name]))
        held[name] += 1.0
    return Plan(gpus)


def _fits(cluster: Cluster, models: list[str]) -> bool:
    """Whether one more model may join a shared GPU: the weights of all of them must
    leave at least MIN_KV_SHARE of the device for KV (MuxServe packs by memory too)."""
    if cluster.device is None:  # cpu cores: each engine brings its own KV blocks
        return True
    try:
        kv = cluster.kv_capacity_bytes(models)
    except ValueError:
        return False
    return kv >= MIN_KV_SHARE * cluster.device.memory_bytes


def estimate_plan(config: SimConfig, plan: Plan, capacities: dict[str, float]) -> float:
    """Estimated served rate: each model gets min(rate, capacity of its GPU shares)."""
    total = 0.0
    for m in config.models:
        gpus = plan.gpus_of(m.name)
        share = sum(1.0 / len(plan.gpus[i].models) for i in gpus)
        total += min(m.rate, share * capacities[m.name])
    return total


def plan_cluster(config: SimConfig, progress: bool = False,
                 exclusive_devices: bool = False) -> dict:
    """Choose a placement (and weaving pairs) for the config's models and cluster.

    exclusive_devices: each device serves one model (replicas and weaving pairs, no
    packing), as a deployment on GPUs must: `weaver serve` runs mux groups on CPU engines
    only."""
    cluster = Cluster(config, Engine())
    capacities = {m.name: estimate_capacity(cluster, m) for m in config.models}
    candidates: dict[str, Candidate] = {}
    # A threshold of 0 packs nothing: every model gets devices of its own.
    thresholds = (0.0,) if exclusive_devices else SMALL_DEMAND_THRESHOLDS
    for threshold in thresholds:
        plan = place(cluster, capacities, threshold)
        if plan is not None:
            key = str(plan.to_dict())
            candidates.setdefault(key, Candidate(plan, "muxserve", estimate_plan(
                config, plan, capacities), f"muxserve(threshold={threshold})"))
    if not candidates:
        how = "with a device each" if exclusive_devices else "even when packed"
        raise ValueError(f"{len(config.models)} models do not fit on "
                         f"{config.cluster.num_gpus} GPUs {how}; add GPUs")
    ranked = sorted(candidates.values(), key=lambda c: -c.estimate_rps)
    simulated = ranked[:config.plan_candidates]
    for cand in simulated:
        cand.result = simulate(config, cand.policy, cand.plan, progress=progress,
                               keep_requests=False)
    best = max(simulated, key=lambda c: c.score)
    woven_choices = [(policy, ratio, hot_cold_pairs(config, best.plan.gpus, ratio), "")
                     for policy, ratio in WEAVING_CHOICES]
    policy, ratio = FAN_IN_CHOICE
    fan_in = fan_in_pairs(config, best.plan.gpus, ratio)
    woven_choices.append((policy, ratio, fan_in, f", over {len(fan_in)} colds"))
    for offload_policy, ratio, pairs, how in woven_choices:
        if not pairs:
            continue
        woven = Candidate(Plan(best.plan.gpus, pairs), "weaver", best.estimate_rps,
                          f"{best.label}+weaving({offload_policy}, ratio={ratio}{how})")
        weaving = config.weaving.model_copy(update={"offload_policy": offload_policy})
        woven.result = simulate(config.model_copy(update={"weaving": weaving}), "weaver",
                                woven.plan, progress=progress, keep_requests=False)
        woven.offload_policy = offload_policy
        woven.cold_tpot_factors = cold_tpot_factors(woven.result, best.result, woven.plan)
        if not woven.is_within_cold_budget:
            logger.info("%s: a cold model's TPOT rises %s, over its budget; not chosen",
                        woven.label, cold_factors_text(woven.cold_tpot_factors))
        simulated.append(woven)
    chosen = best
    for cand in simulated:
        if cand.policy == "weaver" and cand.is_within_cold_budget and \
                is_clearly_better(cand.score, chosen.score):
            chosen = cand
    baseline = _baseline(config, progress)
    return {
        "config": config.name,
        "exclusive_devices": exclusive_devices,
        "capacities_rps": capacities,
        "chosen": _describe(chosen),
        "baseline": baseline,
        "candidates": [_describe(c) for c in simulated],
        "goodput_gain": _ratio(chosen.score[0], baseline["summary"]["_all"]["goodput_rps"]),
        "token_throughput_gain": _ratio(chosen.score[1],
                                        baseline["summary"]["_all"]["output_tokens_per_s"]),
    }


def cold_tpot_factors(woven: dict, plain: dict, plan: Plan) -> dict[str, float]:
    """Each cold model's mean TPOT in the woven run over its mean TPOT in the plain run of
    the same placement (a model that generated no second token in either has none)."""
    factors = {}
    for pair in plan.pairs:
        for name in plan.gpus[pair.cold_gpu].models:
            woven_s = woven["summary"].get(name, {}).get("tpot_s", {}).get("mean")
            plain_s = plain["summary"].get(name, {}).get("tpot_s", {}).get("mean")
            if woven_s is not None and plain_s:
                factors[name] = woven_s / plain_s
    return factors


def cold_factors_text(factors: dict[str, float]) -> str:
    """The cold TPOT factors as people read them: "cold 1.16x, cold2 1.12x"."""
    return ", ".join(f"{name} {factor:.2f}x" for name, factor in sorted(factors.items()))


def is_clearly_better(score: tuple[float, float], than: tuple[float, float]) -> bool:
    """Weaving adds moving parts: take it only for a gain above simulation noise. Scores
    are (goodput, token throughput)."""
    (good, tokens), (good_ref, tokens_ref) = score, than
    if good > good_ref * (1 + MIN_WEAVING_GAIN):
        return True
    return good >= good_ref * (1 - MIN_WEAVING_GAIN) and \
        tokens > tokens_ref * (1 + MIN_WEAVING_GAIN)


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else math.inf


def _baseline(config: SimConfig, progress: bool) -> dict:
    """Dedicated placement with GPUs dealt round-robin by rate (mux_temporal when there
    are fewer GPUs than models)."""
    plain = config.model_copy(update={"placement": None})
    plan = default_plan(plain)
    plan.pairs = []
    policy = "dedicated" if all(len(g.models) == 1 for g in plan.gpus) else "mux_temporal"
    result = simulate(plain, policy, plan, progress=progress, keep_requests=False)
    return {"label": f"{policy}(round-robin)", "policy": policy, "plan": plan.to_dict(),
            "summary": result["summary"], "sim": result["sim"]}


def _describe(cand: Candidate) -> dict:
    return {"label": cand.label, "policy": cand.policy, "plan": cand.plan.to_dict(),
            "offload_policy": cand.offload_policy,
            "cold_tpot_factors": cand.cold_tpot_factors,
            "within_cold_budget": cand.is_within_cold_budget,
            "estimate_rps": cand.estimate_rps, "summary": cand.result["summary"],
            "sim": cand.result["sim"]}

