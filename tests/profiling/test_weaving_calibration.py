"""Woven-step calibration: remote counts, the modelled step by hand, the fit, the
calibrated profile in the simulator, and `weaver profile --calibrate-weaving` with the
server measurement replaced (no server is started here)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path

import pytest
import yaml

from weaver.cli import profile as cli
from weaver.profiling import serving_probe
from weaver.profiling.serving_calibration import NOTES_KEY as SERVING_NOTES_KEY
from weaver.profiling.serving_calibration import ServingDecodePoint
from weaver.profiling.weaving_calibration import (
    NOTES_KEY,
    apply_woven_overhead,
    fit_woven_overhead,
    modelled_woven_step_s,
    num_remote_of,
    require_calibratable,
)
from weaver.sim.perf_model import LinkModel, OffloadCostModel, PerfModel, PollContext
from weaver.sim.profile import Profile

SMOLLM2_PROFILE = (Path(__file__).resolve().parents[2] / "benchmarks" / "profiles"
                   / "smollm2_135m_cpu_vllm_serving.json")
A, K = 0.004, 0.0015  # the overhead the points below are built with
RATIO = 2 / 3


def served(lin) -> Profile:
    """The linear profile, marked serving-calibrated (its numbers stand for served steps)."""
    return dataclasses.replace(lin.profile(), notes={SERVING_NOTES_KEY: "{}"})


def points(lin, a=A, k=K, batch_sizes=(3, 6, 12), per_seq_context=100):
    perf = PerfModel(served(lin))
    out = []
    for b in batch_sizes:
        r = num_remote_of(RATIO, b)
        base = modelled_woven_step_s(perf, b, r, b * per_seq_context)
        out.append(ServingDecodePoint(b, b * per_seq_context, base + a + k * r))
    return out


def calibrated(lin, fit) -> Profile:
    return apply_woven_overhead(served(lin), fit, measured_at="2026-11-25T13:00:00Z",
                                command="weaver profile --calibrate-weaving x.json",
                                conditions="test")


def test_remote_counts_follow_the_hot_schedulers_placement():
    # RatioPlacement: 2/3 places L R R L R R, 1/2 places L R L R (weaving/placement.py).
    assert [num_remote_of(RATIO, b) for b in (1, 2, 3, 6, 12)] == [0, 1, 2, 4, 8]
    assert [num_remote_of(0.5, b) for b in (1, 2, 4)] == [0, 1, 2]
    assert num_remote_of(1.0, 5) == 5 and num_remote_of(0.0, 5) == 0
    assert num_remote_of(0.67, 4) == 2  # benchmarks/deployments/weaving.yaml at b = 4


def test_modelled_woven_step_by_hand(lin):
    # b = 6 at 2/3: 4 remote, 2 local, 100 tokens each. Per layer (4 layers): send q + k/v
    # = 1 ms + (4 x 4 x 64 x 2 + 2 x 4 x 2 x 64 x 2) B / 1 GB/s, wait = half the idle
    # poller's 50 us, remote attention 5e-7 x 400 / 4, receive q's bytes, minus local
    # attention 5e-7 x 200 / 4.
    send = 1e-3 + (2048 + 2048) / 1e9
    receive = 1e-3 + 2048 / 1e9
    per_layer = send + 25e-6 + 5e-7 * 400 / 4 + receive - 5e-7 * 200 / 4
    expected = lin.decode_time(6, 600) + 4 * per_layer
    assert modelled_woven_step_s(PerfModel(served(lin)), 6, 4, 600) == pytest.approx(expected)


def test_points_built_from_a_known_overhead_give_it_back(lin):
    fit = fit_woven_overhead(served(lin), points(lin), RATIO)
    assert fit.intercept_s == pytest.approx(A)
    assert fit.per_remote_seq_s == pytest.approx(K)
    assert [c.num_remote for c in fit.points] == [2, 4, 8]
    assert [c.overhead_s for c in fit.points] == pytest.approx([A + K * r for r in (2, 4, 8)])
    negative = fit_woven_overhead(served(lin), points(lin, a=-0.01, k=0.002), RATIO)
    assert negative.overhead_s(2) == 0.0  # clamped, as in the simulator
    assert negative.overhead_s(8) == pytest.approx(0.006)


def test_the_simulator_adds_the_fit_once_per_woven_step(lin, tmp_path):
    fit = fit_woven_overhead(served(lin), points(lin), RATIO)
    profile = calibrated(lin, fit)
    assert profile.woven_step_intercept_s == pytest.approx(A)
    assert profile.woven_step_per_remote_seq_s == pytest.approx(K)
    record = json.loads(profile.notes[NOTES_KEY])
    assert record["offload_ratio"] == RATIO and len(record["points"]) == 3
    assert "woven-step calibrated 2026-11-25T13:00:00Z" in profile.source
    path = tmp_path / "woven.json"
    profile.save(path)
    assert Profile.load(path) == profile  # the new fields survive a round trip

    link = LinkModel(lin.profile().link_bandwidth_bps, lin.profile().link_latency_s)
    poll = PollContext(0.05, (0.5, 0.5), 0.3, 50e-6)
    before = OffloadCostModel(PerfModel(served(lin)), PerfModel(served(lin)), link)
    after = OffloadCostModel(PerfModel(profile), PerfModel(profile), link)
    for r in (1, 4, 8):
        added = after.step_overhead(r, 100 * r, 300, poll) - before.step_overhead(
            r, 100 * r, 300, poll)
        assert added == pytest.approx(A + K * r)
    assert after.step_overhead(0, 0, 300, poll) == 0.0  # no remote sequence, no woven step
    # The decode table and everything else are untouched.
    assert profile.decode_s == served(lin).decode_s
    assert profile.attention_s == served(lin).attention_s


def test_bad_input_says_what_is_wrong(lin):
    with pytest.raises(ValueError, match="calibrate the serving path first"):
        require_calibratable(lin.profile())
    fit = fit_woven_overhead(served(lin), points(lin), RATIO)
    with pytest.raises(ValueError, match="already has a woven-step calibration"):
        fit_woven_overhead(calibrated(lin, fit), points(lin), RATIO)
    with pytest.raises(ValueError, match="no remote sequence"):
        fit_woven_overhead(served(lin), points(lin, batch_sizes=(1, 6, 12)), RATIO)
    with pytest.raises(ValueError, match="2 distinct"):
        fit_woven_overhead(served(lin), points(lin, batch_sizes=(6, 6)), RATIO)
    with pytest.raises(ValueError, match="finite"):
        dataclasses.replace(lin.profile(), woven_step_per_remote_seq_s=math.nan)


def test_profiles_without_the_fields_load_with_no_woven_overhead():
    profile = Profile.load(SMOLLM2_PROFILE)
    assert "woven_step_intercept_s" not in json.loads(SMOLLM2_PROFILE.read_text())
    assert PerfModel(profile).woven_step_overhead(10) == 0.0


def parse(argv):
    parser = argparse.ArgumentParser(prog="weaver")
    cli.register(parser.add_subparsers())
    return parser.parse_args(argv)


def write_deployment(tmp_path, lin, model_dir, *, lend_blocks=64, weaving=True) -> Path:
    block_bytes = 32 * lin.SHAPE.kv_bytes_per_token
    data = {
        "models": [
            {"name": "hot", "model": str(model_dir), "role": "hot", "kv_cache_gib": 0.25,
             "max_model_len": 512, "block_size": 32, "num_gpu_blocks_override": 65,
             "cpu_cores": "0"},
            {"name": "cold", "model": str(model_dir), "role": "cold", "kv_cache_gib": 0.25,
             "max_model_len": 512, "cpu_cores": "0",
             "lend_kv_gib": lend_blocks * block_bytes / (1 << 30)},
        ],
        "weaving": [{"hot": "hot", "cold": ["cold"], "offload_ratio": RATIO}] if weaving
        else [],
    }
    if not weaving:
        data["models"][0]["role"] = data["models"][1]["role"] = "dedicated"
        del data["models"][1]["lend_kv_gib"]
    path = tmp_path / ("weaving.yaml" if weaving else "dedicated.yaml")
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_calibrate_weaving_refuses_bad_input_before_measuring(tmp_path, lin, lin_model_dir,
                                                              monkeypatch):
    def no_server(*args, **kwargs):
        raise AssertionError("no measurement expected")

    monkeypatch.setattr(serving_probe, "measure_woven_points", no_server)
    profile_path = tmp_path / "served.json"
    served(lin).save(profile_path)
    raw_path = tmp_path / "raw.json"
    lin.profile().save(raw_path)
    out = str(tmp_path / "out.json")
    weaving = str(write_deployment(tmp_path, lin, lin_model_dir))
    for argv in (
        ["--calibrate-weaving", str(profile_path)],  # no deployment
        ["--calibrate-weaving", str(raw_path), "--deployment", weaving],  # not served
        ["--calibrate-weaving", str(profile_path), "--deployment",
         str(write_deployment(tmp_path, lin, lin_model_dir, weaving=False))],  # no pair
        ["--calibrate-weaving", str(profile_path), "--deployment", weaving,
         "--weaving-batch-sizes", "4", "40"],  # 27 remote x 6 blocks > 64 lent
        ["--calibrate-weaving", str(profile_path), "--deployment", weaving,
         "--weaving-batch-sizes", "1", "6"],  # b = 1 has no remote sequence
    ):
        args = parse(["profile", *argv, "--out", out])
        assert args.handler(args) == 2, argv
    assert not Path(out).exists()


def test_calibrate_weaving_command_writes_the_calibrated_profile(tmp_path, lin, lin_model_dir,
                                                                monkeypatch, capsys):
    profile_path = tmp_path / "served.json"
    served(lin).save(profile_path)
    deployment = write_deployment(tmp_path, lin, lin_model_dir)

    def fake_measure(path, hot_model, plan, log_path, serve_cores, on_point):
        assert path == deployment and hot_model == "hot"
        assert plan.batch_sizes == (3, 6, 12) and plan.prompt_tokens == 64
        assert serve_cores is None
        measured = points(lin, batch_sizes=plan.batch_sizes)
        for point in measured:
            on_point(point, "fake")
        return measured

    monkeypatch.setattr(serving_probe, "measure_woven_points", fake_measure)
    out = tmp_path / "woven.json"
    args = parse(["profile", "--calibrate-weaving", str(profile_path), "--deployment",
                  str(deployment), "--weaving-batch-sizes", "3", "6", "12",
                  "--weaving-prompt-tokens", "64", "--serve-cores", "all", "--out", str(out)])
    assert args.handler(args) == 0
    profile = Profile.load(out)
    assert profile.woven_step_intercept_s == pytest.approx(A)
    assert profile.woven_step_per_remote_seq_s == pytest.approx(K)
    printed = capsys.readouterr().out
    assert "a = 4.00 ms, k = 1.500 ms per remote sequence" in printed
    assert printed.count("served TPOT") == 3 and "remote 8" in printed
