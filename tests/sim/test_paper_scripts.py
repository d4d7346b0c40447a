"""benchmarks/paper_figures.py and benchmarks/regime_map.py on shortened runs: their
arithmetic and their JSON (the figures themselves belong to the benchmarks)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_script", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_compute_ceiling_is_the_gemm_flops_of_a_request_against_the_peak():
    figures = _load("paper_figures")
    config = figures.variant("paper_a100_40gb", "t", workload={"trace": "uniform:500-500:100-100"})
    ceiling = figures.compute_ceiling(config, "hot")
    flops = 2 * figures.get_shape("llama-3-8b").num_params * 600
    assert ceiling["tflop_per_request"] == pytest.approx(flops / 1e12)
    assert ceiling["rate_at_peak_rps"] == pytest.approx(312e12 / flops)
    assert ceiling["rate_at_60%_of_peak_rps"] == pytest.approx(0.6 * 312e12 / flops)


def test_a_regime_map_cell_gives_each_slo_its_goodputs_and_gains(tmp_path):
    regime = _load("regime_map")
    assert regime.main(["--models", "qwen2.5-3b", "--devices", "H100-80GB", "--workloads",
                        "code", "--seeds", "1", "--duration-s", "3", "--jobs", "1",
                        "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "regime_map.json").read_text())
    assert result["verdict"].startswith("tight SLO:")
    (cell,) = result["cells"]
    assert cell["dedicated_capacity_rps"] > 0
    assert set(cell["goodput_rps"]) == {"tight", "loose"}
    assert set(cell["goodput_rps"]["loose"]) == {"dedicated", "muxserve", "weaver"}
    # auto is held to 0.85x each SLO's TPOT, which is a multiple of the TPOT alone.
    slos = cell["slos"]
    assert slos["loose"]["tpot_ms"] == pytest.approx(2 * slos["tight"]["tpot_ms"])
    assert (tmp_path / "regime_map.png").exists()


def test_the_fan_in_column_weaves_the_hot_model_into_two_colds_beside_one(tmp_path):
    regime = _load("regime_map")
    assert regime.main(["--models", "qwen2.5-3b", "--devices", "H100-80GB", "--workloads",
                        "code", "--seeds", "1", "--duration-s", "3", "--jobs", "1",
                        "--fan-in", "all", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "regime_map.json").read_text())
    assert "two colds over one:" in result["verdict"]
    (cell,) = result["cells"]
    for slo in ("tight", "loose"):
        goodput = cell["goodput_rps"][slo]
        assert set(goodput) == {"dedicated", "muxserve", "weaver", "weaver_two_colds"}
        assert cell["fan_in_gain"][slo]["over_one_cold"] == pytest.approx(
            goodput["weaver_two_colds"] / goodput["weaver"] - 1)
        # What each column's weaving used, per rate run: two colds lend twice the blocks.
        use = cell["weaving_use"][slo]
        assert set(use) == {"weaver", "weaver_two_colds"}
        for by_rate in use.values():
            assert all(0 <= u["remote_share"] <= 1 and 0 <= u["lent_kv_peak"] <= 1
                       for u in by_rate.values())
    assert (tmp_path / "regime_map_fan_in.png").exists()
    # The plots come from the saved map alone.
    (tmp_path / "regime_map_fan_in.png").unlink()
    assert regime.main(["--replot", str(tmp_path / "regime_map.json")]) == 0
    assert (tmp_path / "regime_map_fan_in.png").exists()
    # Two cold GPUs, each its own cold model at the one-to-one cell's cold rate, both woven
    # into by the hot GPU under one `auto` policy held to each SLO's target
    # (kv_bound_a100_two_colds.yaml's shape); dedicated and MuxServe are not run again.
    slos = {name: regime.Slo(ttft_s=1.0, tpot_s=tpot_s)
            for name, tpot_s in (("tight", 0.05), ("loose", 0.1))}
    jobs = regime._jobs(("qwen2.5-3b", "H100-80GB", "azure-code", 3.0), slos, 2)
    assert [(column, policy, judged) for column, policy, _, judged in jobs] == [
        ("weaver_two_colds", "weaver", ["tight"]), ("weaver_two_colds", "weaver", ["loose"])]
    for (*_, config, (slo,)) in jobs:
        assert config.cluster.num_gpus == 3
        assert [m.rate for m in config.models] == [1.0, regime.COLD_RATE, regime.COLD_RATE]
        target_ms = regime.SLO_TPOT_SHARE * slos[slo].tpot_s * 1e3
        assert [(p.hot_gpu, p.cold_gpu, p.offload_ratio, p.hot_tpot_ms)
                for p in config.placement.pairs] == [(0, 1, "auto", target_ms),
                                                     (0, 2, "auto", target_ms)]


def test_near_pay_runs_two_colds_only_where_one_cold_raised_goodput(tmp_path):
    regime = _load("regime_map")
    tie = {"tight": {"dedicated": 0.0, "muxserve": 0.5}, "loose": {"dedicated": None,
                                                                   "muxserve": None}}
    assert not regime.is_near_pay(tie)
    assert regime.is_near_pay({**tie, "loose": {"dedicated": 0.2, "muxserve": 0.0}})
    # A GQA cell where one cold ties dedicated: the column is not run, and the map says so.
    assert regime.main(["--models", "qwen2.5-3b", "--devices", "H100-80GB", "--workloads",
                        "code", "--seeds", "1", "--duration-s", "3", "--jobs", "1",
                        "--fan-in", "near-pay", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "regime_map.json").read_text())
    (cell,) = result["cells"]
    assert cell["fan_in_gain"] is None and "weaver_two_colds" not in cell["goodput_rps"]["tight"]
    assert "not run in 1 cells where one cold ties dedicated" in result["verdict"]


@pytest.mark.parametrize(("model", "device", "workload", "slo", "dedicated", "weaver"), [
    # Weaving pays (the map: +50 %); the planner weaves with auto, +11 %.
    ("llama-2-13b", "H100-80GB", "conv", "tight", 4.0, 6.0),
    # Weaving does not pay: auto steps aside (short outputs over the SLO's TPOT), the
    # planner serves the plain placement.
    ("llama-2-13b", "A100-40GB", "code", "loose", 6.0, 6.0),
    # A GQA model: the GEMMs bind before the KV.
    ("llama-3-8b", "H100-80GB", "code", "tight", 20.0, 20.0),
])
def test_the_planner_answers_as_the_regime_map_in_representative_cells(
        model, device, workload, slo, dedicated, weaver):
    """benchmarks/plan_vs_regime_map.py: `weaver plan`'s "weaving pays here" against the
    map's goodputs (benchmarks/results/sim_regime_map/regime_map.json, these cells)."""
    check, regime = _load("plan_vs_regime_map"), _load("regime_map")
    scale = regime.SLOS[slo]
    tpot_ms = scale.tpot_times_isolated * regime.isolated_tpot_s(model, device) * 1e3
    cell = {"model": model, "device": device, "workload": workload,
            "slos": {slo: {"ttft_s": scale.ttft_s, "tpot_ms": tpot_ms}},
            "goodput_rps": {slo: {"dedicated": dedicated, "weaver": weaver}}}
    row = check.ask(cell, slo)
    assert row["plan_pays"] == row["map_pays"] == (weaver > dedicated), row["answer"]


def _planner_entry(pairs: list[tuple[int, int]], hot_goodput: float, *, tokens: float = 100.0,
                   within_budget: bool = True) -> dict:
    """A planner result's candidate (plan_cluster's _describe), as fan_in_row reads it."""
    return {"label": f"pairs {pairs}", "policy": "weaver" if pairs else "muxserve",
            "plan": {"gpus": [{"models": ["hot"]}, {"models": ["cold"]}, {"models": ["cold2"]}],
                     "pairs": [{"hot_gpu": h, "cold_gpu": c, "offload_ratio": "auto"}
                               for h, c in pairs]},
            "within_cold_budget": within_budget,
            "cold_tpot_factors": {"cold": 1.05, "cold2": 1.2 if not within_budget else 1.05},
            "summary": {"hot": {"goodput_rps": hot_goodput},
                        "_all": {"goodput_rps": hot_goodput + 2, "output_tokens_per_s": tokens}}}


def test_the_fan_in_question_asks_the_planner_about_the_maps_two_colds_deployment():
    """benchmarks/plan_vs_regime_map.py's second question: the planner's choice of one hot
    GPU over two colds against the map's two-colds column (>= +10 % over one cold)."""
    check = _load("plan_vs_regime_map")
    cell = {"model": "llama-2-13b", "device": "H100-80GB", "workload": "conv",
            "slos": {"loose": {"ttft_s": 10.0, "tpot_ms": 120.0}},
            "goodput_rps": {"loose": {"dedicated": 8.0, "weaver": 8.0, "weaver_two_colds": 10.0}},
            "fan_in_gain": {"loose": {"over_one_cold": 0.25, "over_dedicated": 0.25}}}
    assert check.has_fan_in_column(cell, "loose")
    assert not check.has_fan_in_column({**cell, "fan_in_gain": None}, "loose")
    # The map's fan-in deployment at the better column's rate: three GPUs, two colds at 1 req/s.
    config = check.planner_config(cell, "loose", 2)
    assert config.cluster.num_gpus == 3 and config.placement is None
    assert [(m.name, m.rate) for m in config.models] == [("hot", 10.0), ("cold", 1.0),
                                                         ("cold2", 1.0)]
    assert config.slo.tpot_ms == 120.0
    # hot_cold_pairs' pairs of several hot GPUs are no fan-in.
    assert not check.is_fan_in(_planner_entry([(0, 1), (2, 3)], 1.0))
    plain, one_cold = _planner_entry([], 6.0), _planner_entry([(0, 2)], 8.0)
    fan_in = _planner_entry([(0, 1), (0, 2)], 10.0, tokens=120.0)
    chosen = check.fan_in_row(cell, "loose", 10.0, {"candidates": [plain, one_cold, fan_in],
                                                   "chosen": fan_in})
    assert (chosen["map_pays"], chosen["plan_pays"]) == (True, True)
    assert chosen["two_over_one"] == {"hot": 1.25, "_all": 1.2, "tokens": 1.2}
    assert chosen["within_cold_budget"] and chosen["one_cold_within_budget"]
    # Over the colds' TPOT budget the planner serves the plain placement: a disagreement.
    refused = _planner_entry([(0, 1), (0, 2)], 10.0, within_budget=False)
    over = check.fan_in_row(cell, "loose", 10.0, {"candidates": [plain, one_cold, refused],
                                                 "chosen": plain})
    assert over["plan_pays"] is False and not over["within_cold_budget"]
    # No fan-in tried (the colds not under half the hot's load): not asked, counted apart.
    untried = check.fan_in_row(cell, "loose", 2.0, {"candidates": [plain, one_cold],
                                                   "chosen": one_cold})
    assert untried["plan_pays"] is None and "not under half" in untried["not_asked"]
    verdict = check.fan_in_verdict([chosen, over, untried])
    assert "in 1 of 2 cell-SLOs; where the map says they pay: 1 of 2; where it does not: 0 of 0" \
        in verdict
    assert verdict.endswith("not asked in 1 (the hot model at <= 2 req/s: no cold under half "
                            "its load), where the map says they pay in 1")
