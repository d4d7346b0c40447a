import argparse
import json

import pytest

from weaver.cli import simulate as cli
from weaver.sim.config import load_config, packaged_configs


def parse(argv):
    parser = argparse.ArgumentParser(prog="weaver")
    cli.register(parser.add_subparsers())
    return parser.parse_args(argv)


def test_packaged_configs_validate():
    configs = packaged_configs()
    assert {"paper_a100", "kv_bound_a100", "scale_64gpu", "tiny"} <= set(configs)
    for path in configs.values():
        load_config(path)
    scale = load_config(configs["scale_64gpu"])
    assert len(scale.models) == 32 and scale.cluster.num_gpus == 64
    rates = [m.rate for m in scale.models]
    assert rates == sorted(rates, reverse=True) and sum(rates) == pytest.approx(250)


@pytest.mark.parametrize("text, message", [
    ("name: x\n", "cluster"),
    ("name: x\ncluster: {num_gpus: 1}\n", "no models"),
    ("name: x\ncluster: {num_gpus: 1, device: TPU}\nmodels: [{name: a, rate: 1}]\n",
     "unknown device"),
    ("name: x\ncluster: {num_gpus: 1}\nmodels: [{name: a, rate: 1}]\npolicy: best\n",
     "unknown policy"),
    ("name: x\ncluster: {num_gpus: 1}\nmodels: [{name: a, rate: -1}]\n", "rate"),
    ("name: x\ncluster: {num_gpus: 1}\nmodels: [{name: a, rate: 1}]\n"
     "placement: {gpus: [{models: [b]}]}\n", "unknown models"),
    ("name: x\ncluster: {num_gpus: 1}\nmodels: [{name: a, rate: 1, colour: red}]\n",
     "colour"),
    ("- just a list\n", "mapping"),
])
def test_bad_configs_say_what_to_fix(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_config(path)


def test_simulate_command_writes_json_and_a_plot(tmp_path, profile_path, capsys):
    config = tmp_path / "small.yaml"
    config.write_text(
        "name: small\nduration_s: 5\npolicy: weaver\ncluster: {num_gpus: 2}\nmodels:\n"
        f"  - {{name: hot, rate: 8, profile: {profile_path}}}\n"
        f"  - {{name: cold, rate: 1, profile: {profile_path}}}\n")
    args = parse(["simulate", str(config), "--out", str(tmp_path / "out")])
    assert args.handler(args) == 0
    result = json.loads((tmp_path / "out" / "small" / "weaver.json").read_text())
    assert result["policy"] == "weaver" and result["requests"]
    assert (tmp_path / "out" / "small" / "weaver.png").stat().st_size > 0
    assert "hot" in capsys.readouterr().out


def test_sweep_prints_the_ratio_beside_the_paper(tmp_path, profile_path, capsys):
    config = tmp_path / "sweep.yaml"
    config.write_text(
        "name: sw\nduration_s: 5\ncluster: {num_gpus: 2}\nslo: {tpot_ms: 150}\n"
        "workload: {trace: azure-conv}\nmodels:\n"
        f"  - {{name: hot, rate: 8, profile: {profile_path}}}\n"
        f"  - {{name: cold, rate: 1, profile: {profile_path}}}\n"
        "placement: {gpus: [{models: [hot]}, {models: [cold]}], "
        "pairs: [{hot_gpu: 0, cold_gpu: 1}]}\n"
        "sweep: {model: hot, rates: [5, 20], policies: [dedicated, weaver]}\n")
    args = parse(["simulate", str(config), "--out", str(tmp_path / "out")])
    assert args.handler(args) == 0
    out = capsys.readouterr().out
    assert "weaving vs dedicated" in out and "+60%" in out
    sweep = json.loads((tmp_path / "out" / "sw" / "sweep.json").read_text())
    # Every (policy, rate) runs with 3 seeds by default; each seed's max rate is kept.
    assert sorted((p["policy"], p["rate"], p["seed"]) for p in sweep["points"]) == sorted(
        (policy, rate, seed) for policy in ("dedicated", "weaver") for rate in (5, 20)
        for seed in (0, 1, 2))
    assert sweep["max_rate_rps"]["dedicated"] == 5  # rate 20 overloads one GPU
    assert sweep["by_seed"]["dedicated"]["goodput_rps"] == [5, 5, 5]
    assert "3 seeds pooled" in out and "(seeds 5.00-5.00)" in out
    assert all(p["plan"]["gpus"][0]["models"] == ["hot"] for p in sweep["points"])
    # Both definitions, side by side: the paper's reads mean TPOT alone.
    assert set(sweep["max_rate_mean_tpot_rps"]) == {"dedicated", "weaver"}
    assert "goodput" in out and "as the paper reads it" in out
    assert (tmp_path / "out" / "sw" / "sweep.png").exists()


def test_bad_config_exits_2(tmp_path):
    args = parse(["simulate", str(tmp_path / "missing.yaml")])
    assert args.handler(args) == 2


def test_a_sweep_gives_a_policy_its_own_placement(tmp_path, profile_path):
    from weaver.sim.config import SimConfig
    from weaver.sim.runner import rate_sweep

    data = {"name": "own", "duration_s": 3, "drain_s": 0, "cluster": {"num_gpus": 2},
            "workload": {"trace": "azure-conv", "length_scale": 0.1},
            "models": [{"name": n, "rate": 2, "profile": profile_path} for n in ("a", "b")],
            "placement": {"gpus": [{"models": ["a"]}, {"models": ["b"]}]},
            "sweep": {"model": "a", "rates": [2], "policies": ["dedicated", "muxserve"],
                      "placements": {"muxserve": {"gpus": [{"models": ["a", "b"],
                                                            "tp": 2}]}}}}
    sweep = rate_sweep(SimConfig.model_validate(data))
    plans = {p["policy"]: p["plan"]["gpus"] for p in sweep["points"]}
    assert [g["models"] for g in plans["dedicated"]] == [["a"], ["b"]]
    assert [(g["models"], g["tp"]) for g in plans["muxserve"]] == [(["a", "b"], 2)]
    data["sweep"]["placements"] = {"weaver": data["placement"]}
    with pytest.raises(ValueError, match="not one of sweep.policies"):
        SimConfig.model_validate(data)


def _point(rate: float, seed: int, attainment: float, mean_tpot_s: float | None) -> dict:
    return {"policy": "p", "rate": rate, "seed": seed, "summary": {"hot": {
        "slo_attainment": attainment, "tpot_s": {"mean": mean_tpot_s},
        "throughput_rps": rate * attainment}}}


def test_sweep_maxima_pool_the_seeds_and_flag_a_sweep_that_passes_again():
    """Goodput pools the seeds' attainment at each rate and stops at the first failing
    rate (monotone); a higher rate that passes again is reported, not taken."""
    from weaver.sim.runner import sweep_maxima

    points = [_point(1, 0, 1.0, 0.05), _point(1, 1, 1.0, 0.05),
              _point(2, 0, 0.95, 0.08), _point(2, 1, 0.80, 0.09),   # pooled 0.875: fails
              _point(3, 0, 0.95, 0.12), _point(3, 1, 0.95, 0.11)]   # passes again
    maxima = sweep_maxima(points, "hot", tpot_s=0.1)
    assert maxima["goodput_rps"] == 1
    assert maxima["goodput_by_seed"] == [3, 1]
    assert maxima["above_max_passing"] == [3]
    assert maxima["mean_tpot_max_rps"] == 2 and maxima["mean_tpot_max_by_seed"] == [2, 2]
    assert maxima["throughput_rps"] == 1
