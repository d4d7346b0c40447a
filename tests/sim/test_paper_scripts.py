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
