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
    if keep_requests:
        result["requests"] = records
    logger.info("%s/%s: %d events in %.1f s wall", config.name, policy_name,
                engine.num_processed, wall)
    return result


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
    """For each policy, simulate each rate of the swept model. Its max rate under the SLO
    is its goodput (weaver/results/goodput.py: the highest swept rate at and below which
    >= 90 % of the requests meet the SLO); the measured throughput there (completions over
    the span to the last one) is reported too, and beside it the paper's max rate (mean
    TPOT within the target at that rate and every lower one: `mean_tpot_max_rate`)."""
    if config.sweep is None:
        raise ValueError(f"config {config.name} has no `sweep:` section")
    sweep = config.sweep
    points = []
    grid = [(policy, rate) for policy in sweep.policies for rate in sweep.rates]
    if progress:
        from tqdm import tqdm

        grid = tqdm(grid, desc=f"sweep {config.name}", unit="run")
    for policy, rate in grid:
        models = [m.model_copy(update={"rate": rate}) if m.name == sweep.model else m
                  for m in config.models]
        cfg = config.model_copy(update={"models": models})
        placement = sweep.placements.get(policy)
        plan = None if placement is None else plan_from_spec(
            placement, config.weaving.offload_ratio)
        res = simulate(cfg, policy=policy, plan=plan, keep_requests=False)
        points.append({"policy": policy, "rate": rate, "summary": res["summary"],
                       "sim": res["sim"], "plan": res["plan"],
                       "meets_slo": meets_slo(res["summary"][sweep.model])})
    best, best_rate, paper_rate = {}, {}, {}
    tpot_s = slo_of(config).tpot_s
    for policy in sweep.policies:
        mine = [p for p in points if p["policy"] == policy]
        best_rate[policy] = goodput_rate(
            (p["rate"], p["summary"][sweep.model]["slo_attainment"] or 0.0) for p in mine)
        best[policy] = max((p["summary"][sweep.model]["throughput_rps"] for p in mine
                            if p["rate"] <= best_rate[policy]), default=0.0)
        paper_rate[policy] = mean_tpot_max_rate(
            ((p["rate"], p["summary"][sweep.model]["tpot_s"]["mean"]) for p in mine), tpot_s)
    return {"config": config.name, "model": sweep.model, "slo": config.slo.model_dump(),
            "duration_s": config.duration_s, "seed": config.seed, "points": points,
            "max_rate_rps": best_rate, "max_throughput_rps": best,
            # The paper's reading (mean TPOT within the TPOT target, TTFT ignored).
            "max_rate_mean_tpot_rps": paper_rate}
