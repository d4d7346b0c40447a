"""Run one simulation, or a rate sweep, and return results as JSON-able dicts."""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterable, Iterator

from weaver.results.goodput import Slo, goodput_rate, mean_tpot_max_rate, passes
from weaver.sim.cluster import Cluster
from weaver.sim.config import SimConfig
from weaver.sim.engine import Engine, Event
from weaver.sim.instance import SimRequest
from weaver.sim.metrics import request_record, summarize
from weaver.sim.plan import Plan, default_plan, plan_from_spec
from weaver.sim.policies import get_policy
from weaver.sim.policies.base import Policy
from weaver.sim.workload import generate, workload_spec
from weaver.workloads.types import TraceRequest

logger = logging.getLogger(__name__)


def generate_requests(config: SimConfig) -> list[TraceRequest]:
    """The config's workload, built by `weaver.workloads` as `weaver bench` builds it: trace
    rows, filter, length scaling and arrivals at each model's rate, from the config seed."""
    rates = {m.name: m.rate for m in config.models}
    return generate(workload_spec(config.workload, rates, config.duration_s, config.seed))


def slo_of(config: SimConfig) -> Slo:
    return Slo(ttft_s=config.slo.ttft_s, tpot_s=config.slo.tpot_ms / 1000)


def simulate(config: SimConfig, policy: str | None = None, plan: Plan | None = None,
             requests: Iterable[TraceRequest] | None = None, progress: bool = False,
             keep_requests: bool = True) -> dict:
    """Simulate `requests` (default: the config's workload) under one policy."""
    policy_name = policy or config.policy
    plan = plan or default_plan(config)
    engine = Engine()
    cluster = Cluster(config, engine)
    pol = get_policy(policy_name)(cluster, plan)
    generated = requests is None
    requests = list(generate_requests(config) if generated else requests)
    _check_models(config, requests)
    sim_requests = [SimRequest(r) for r in requests]
    engine.push(_arrivals(engine, pol, iter(sim_requests)))
    wall = time.perf_counter()
    horizon = config.duration_s + config.drain_s
    _run(engine, horizon, progress, f"{config.name}/{policy_name}")
    wall = time.perf_counter() - wall
    records = [request_record(r) for r in sim_requests]
    submitted = Counter(r.model for r in requests)
    result = {
        "config": config.name, "policy": policy_name, "seed": config.seed,
        "plan": plan.to_dict(),
        "rates": {m.name: m.rate for m in config.models},
        "slo": {"ttft_s": config.slo.ttft_s, "tpot_ms": config.slo.tpot_ms},
        "summary": summarize(records, slo_of(config),
                             {m.name: submitted.get(m.name, 0) for m in config.models},
                             window=(0.0, config.duration_s) if generated else None),
        "sim": {"num_events": engine.num_processed, "end_s": engine.now,
                "horizon_s": horizon, "wall_s": wall,
                "num_unfinished": sum(r.finish_s is None and not r.is_rejected
                                      for r in sim_requests)},
    }
    if lent := lent_kv(pol):
        result["lent_kv"] = lent
    if keep_requests:
        result["requests"] = records
    logger.info("%s/%s: %d events in %.1f s wall", config.name, policy_name,
                engine.num_processed, wall)
    return result


def lent_kv(policy: Policy) -> dict[str, list[dict[str, int]]]:
    """Each weaving model's lent pools, one per (replica, cold GPU) in plan order: the most
    blocks it held at once and how many it had. A pool whose peak reaches its capacity is
    one where the lent KV bound the hot batch."""
    pools: dict[str, list[dict[str, int]]] = {}
    for inst in policy.instances:
        for name, server in inst.servers.items():
            pools.setdefault(name, []).extend(
                {"peak_blocks": r.seqs.num_peak_blocks, "capacity_blocks": r.seqs.capacity_blocks}
                for r in server.remotes)
    return {name: found for name, found in pools.items() if found}


def _check_models(config: SimConfig, requests: list[TraceRequest]) -> None:
    known = {m.name for m in config.models}
    unknown = {r.model for r in requests} - known
    if unknown:
        raise ValueError(f"requests name models {sorted(unknown)} that the config lacks; "
                         f"add them to `models:` (known: {sorted(known)})")


def _arrivals(engine: Engine, policy, requests: Iterator[SimRequest]) -> list[Event]:
    """One pending arrival at a time: each arrival schedules the next."""
    req = next(requests, None)
    if req is None:
        return []

    def arrive(now: float) -> list[Event]:
        return policy.route(req, now) + _arrivals(engine, policy, requests)

    return [engine.event(req.trace.arrival_s, "arrival", arrive)]


def _run(engine: Engine, horizon: float, progress: bool, label: str) -> None:
    if not progress:
        engine.run(until=horizon)
        return
    from tqdm import tqdm

    with tqdm(total=round(horizon, 1), desc=label, unit="sim-s", leave=False) as bar:
        def tick(ev: Event) -> None:
            if engine.num_processed % 2000 == 0:
                bar.update(round(ev.time, 1) - bar.n)

        engine.run(until=horizon, on_event=tick)


def meets_slo(summary: dict) -> bool:
    """A model meets the SLO at this load when >= 90 % of its submitted requests met both
    targets (weaver/results/goodput.py)."""
    share = summary["slo_attainment"]
    return share is not None and passes(share)


def rate_sweep(config: SimConfig, progress: bool = False) -> dict:
    """For each policy, simulate each rate of the swept model with `sweep.num_seeds` seeds.
    Its max rate under the SLO is its goodput (weaver/results/goodput.py: the highest swept
    rate at and below which >= 90 % of the requests meet the SLO, the seeds' attainments
    averaged at each rate); each seed's own goodput gives the spread. Beside it the paper's
    max rate (mean TPOT within the target at that rate and every lower one, the seeds' means
    averaged: `mean_tpot_max_rate`), and the measured throughput at the goodput rate
    (completions over the span to the last one, the seeds' mean). `above_max_passing` lists
    the rates above a max rate that pass again (a sweep that is not monotone there)."""
    if config.sweep is None:
        raise ValueError(f"config {config.name} has no `sweep:` section")
    sweep = config.sweep
    seeds = [config.seed + i for i in range(sweep.num_seeds)]
    points = []
    grid = [(policy, rate, seed) for policy in sweep.policies for rate in sweep.rates
            for seed in seeds]
    if progress:
        from tqdm import tqdm

        grid = tqdm(grid, desc=f"sweep {config.name}", unit="run")
    for policy, rate, seed in grid:
        cfg = config.with_rate(sweep.model, rate).model_copy(update={"seed": seed})
        res = simulate(cfg, policy=policy, plan=sweep_plan(config, policy),
                       keep_requests=False)
        points.append({"policy": policy, "rate": rate, "seed": seed,
                       "summary": res["summary"], "sim": res["sim"], "plan": res["plan"],
                       "meets_slo": meets_slo(res["summary"][sweep.model])})
    maxima = {policy: sweep_maxima([p for p in points if p["policy"] == policy],
                                   sweep.model, slo_of(config).tpot_s)
              for policy in sweep.policies}
    return {"config": config.name, "model": sweep.model, "slo": config.slo.model_dump(),
            "duration_s": config.duration_s, "seed": config.seed, "seeds": seeds,
            "points": points,
            "max_rate_rps": {k: m["goodput_rps"] for k, m in maxima.items()},
            "max_throughput_rps": {k: m["throughput_rps"] for k, m in maxima.items()},
            # The paper's reading (mean TPOT within the TPOT target, TTFT ignored).
            "max_rate_mean_tpot_rps": {k: m["mean_tpot_max_rps"] for k, m in maxima.items()},
            "by_seed": {k: {"goodput_rps": m["goodput_by_seed"],
                            "mean_tpot_max_rps": m["mean_tpot_max_by_seed"]}
                        for k, m in maxima.items()},
            "above_max_passing": {k: m["above_max_passing"] for k, m in maxima.items()}}


def sweep_plan(config: SimConfig, policy: str) -> Plan | None:
    """The placement a sweep gives `policy` (`sweep.placements`); None: the config's."""
    placement = config.sweep.placements.get(policy) if config.sweep else None
    return None if placement is None else plan_from_spec(placement,
                                                         config.weaving.offload_ratio)


def sweep_maxima(points: list[dict], model: str, tpot_s: float) -> dict:
    """Both max rates of one policy's sweep points (any number of seeds per rate), pooled
    and per seed."""
    def attainment(p: dict) -> float:
        return p["summary"][model]["slo_attainment"] or 0.0

    def mean_tpot(p: dict) -> float | None:
        return p["summary"][model]["tpot_s"]["mean"]

    goodput = goodput_rate((p["rate"], attainment(p)) for p in points)
    shares: dict[float, list[float]] = {}
    means: dict[float, list[float | None]] = {}
    for p in points:
        shares.setdefault(p["rate"], []).append(attainment(p))
        means.setdefault(p["rate"], []).append(mean_tpot(p))
    # A seed with no finished request makes its rate fail the paper's reading.
    pooled_tpot = [(rate, None if None in ms else sum(ms) / len(ms))
                   for rate, ms in means.items()]
    of_seed: dict[int, list[dict]] = {}
    for p in points:
        of_seed.setdefault(p["seed"], []).append(p)
    at_goodput = [p["summary"][model]["throughput_rps"] for p in points
                  if p["rate"] == goodput]
    return {
        "goodput_rps": goodput,
        "throughput_rps": sum(at_goodput) / len(at_goodput) if at_goodput else 0.0,
        "mean_tpot_max_rps": mean_tpot_max_rate(pooled_tpot, tpot_s),
        "goodput_by_seed": [goodput_rate((p["rate"], attainment(p)) for p in mine)
                            for _, mine in sorted(of_seed.items())],
        "mean_tpot_max_by_seed": [mean_tpot_max_rate(((p["rate"], mean_tpot(p))
                                                      for p in mine), tpot_s)
                                  for _, mine in sorted(of_seed.items())],
        "above_max_passing": sorted(rate for rate, s in shares.items()
                                    if rate > goodput and passes(sum(s) / len(s))),
    }
