import pytest

from weaver.sim.cluster import Cluster
from weaver.sim.config import SimConfig
from weaver.sim.engine import Engine
from weaver.sim.planner import estimate_capacity, place, plan_cluster


def gpu_counts(plan_dict):
    counts = {}
    for gpu in plan_dict["gpus"]:
        for model in gpu["models"]:
            counts[model] = counts.get(model, 0) + 1 / len(gpu["models"])
    return counts


def test_capacity_estimate_shrinks_with_a_tighter_tpot_slo(make_config):
    loose = make_config([("a", 1.0)], slo={"tpot_ms": 200})
    tight = make_config([("a", 1.0)], slo={"tpot_ms": 25})
    cap_loose = estimate_capacity(Cluster(loose, Engine()), loose.models[0])
    cap_tight = estimate_capacity(Cluster(tight, Engine()), tight.models[0])
    assert cap_loose > cap_tight > 0


def test_place_packs_small_models_and_replicates_the_big_one(make_config):
    cfg = make_config([("big", 30.0), ("s1", 0.1), ("s2", 0.1)], num_gpus=3)
    cluster = Cluster(cfg, Engine())
    caps = {"big": 10.0, "s1": 10.0, "s2": 10.0}
    plan = place(cluster, caps, threshold=0.5)
    assert sorted(g.models for g in plan.gpus) == [["big"], ["big"], ["s1", "s2"]]
    # Without packing three models need three GPUs; with two GPUs that plan is impossible.
    two = make_config([("big", 30.0), ("s1", 0.1), ("s2", 0.1)], num_gpus=2)
    assert place(Cluster(two, Engine()), caps, threshold=0.0) is None


def test_planner_finds_the_known_best_split_and_beats_round_robin(make_config):
    # Four GPUs, one model 40x as popular, needing ~2.6 GPUs: the best split is 3 + 1,
    # while the round-robin dedicated placement gives each model 2 GPUs and overloads it.
    cfg = make_config([("hot", 80.0), ("cold", 2.0)], num_gpus=4, plan_candidates=1,
                      slo={"tpot_ms": 60, "ttft_s": 2.0})
    result = plan_cluster(cfg)
    assert gpu_counts(result["chosen"]["plan"]) == {"hot": 3, "cold": 1}
    assert gpu_counts(result["baseline"]["plan"]) == {"hot": 2, "cold": 2}
    assert result["goodput_gain"] > 2.0
    chosen = result["chosen"]["summary"]["_all"]
    assert chosen["goodput_rps"] == pytest.approx(result["goodput_gain"] * result[
        "baseline"]["summary"]["_all"]["goodput_rps"])


def test_small_power_law_cluster_planner_beats_dedicated():
    # A scaled-down version of configs/scale_64gpu.yaml (benchmarks/sim_scale.py runs that),
    # on the roofline A100 profile of Llama-3-8B.
    cfg = SimConfig.model_validate({
        "name": "small-power-law", "duration_s": 8.0, "plan_candidates": 2,
        "cluster": {"device": "A100-80GB", "num_gpus": 8},
        "model_set": {"num_models": 4, "total_rate": 80.0, "alpha": 1.2},
        "workload": {"trace": "azure-conv"},  # 749 / 232 tokens
        "slo": {"tpot_ms": 100, "ttft_s": 3.0},
    })
    result = plan_cluster(cfg)
    counts = gpu_counts(result["chosen"]["plan"])
    assert counts["m00"] > counts["m03"]  # the popular model gets more GPUs
    assert gpu_counts(result["baseline"]["plan"]) == dict.fromkeys(["m00", "m01", "m02", "m03"], 2)
    assert result["goodput_gain"] > 1.5  # the hot model is overloaded on 2 GPUs


def test_a_woven_candidate_is_held_to_its_cold_models_tpot_budget():
    """The cold models' mean TPOT woven over unwoven, per model of the cold device; a
    candidate is within its budget only if each is within the tightest pair's."""
    from weaver.sim.plan import GpuPlan, Plan, WeavePair
    from weaver.sim.planner import Candidate, cold_tpot_factors

    def run(**tpot_s):
        return {"summary": {name: {"tpot_s": {"mean": value}} for name, value in tpot_s.items()}}

    plan = Plan([GpuPlan(["hot"]), GpuPlan(["cold", "cold2"])],
                [WeavePair(0, 1, 0.25, cold_tpot_budget=1.10)])
    plain = run(hot=0.050, cold=0.020, cold2=0.030)
    factors = cold_tpot_factors(run(hot=0.040, cold=0.022, cold2=0.036), plain, plan)
    assert factors == pytest.approx({"cold": 1.10, "cold2": 1.20})
    cand = Candidate(plan, "weaver", 1.0, "woven", cold_tpot_factors=factors)
    assert not cand.is_within_cold_budget  # cold2 1.20x > 1.10
    cand.cold_tpot_factors = {"cold": 1.05, "cold2": 1.10}
    assert cand.is_within_cold_budget
    # a cold model with no second token in the plain run has no factor
    assert cold_tpot_factors(run(cold=0.02), run(cold=None), plan) == {}


def test_the_busiest_gpu_weaves_into_every_gpu_under_half_its_load(make_config):
    """fan_in_pairs: one hot over several colds when two GPUs or more carry under half
    the busiest one's load; the planner simulates that candidate with `auto`."""
    from weaver.sim.plan import GpuPlan, fan_in_pairs

    cfg = make_config([("hot", 8.0), ("a", 1.0), ("b", 3.9), ("c", 4.5)], num_gpus=4)
    gpus = [GpuPlan([m]) for m in ("a", "hot", "b", "c")]
    pairs = fan_in_pairs(cfg, gpus, "auto")
    assert [(p.hot_gpu, p.cold_gpu) for p in pairs] == [(1, 0), (1, 2)]  # c: 4.5 >= 4
    assert all(p.hot_tpot_ms is not None for p in pairs)  # auto held to the SLO
    assert fan_in_pairs(cfg, gpus[:3] + [GpuPlan(["c"])], 0.5)[0].hot_tpot_ms is None
    assert fan_in_pairs(cfg, [GpuPlan(["hot"]), GpuPlan(["c"])], "auto") == []
