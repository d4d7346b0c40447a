"""Serving calibration: the overhead fit, the calibrated profile, the probe's pure parts
and `weaver profile --calibrate-serving` with the server measurement replaced (no server
is started here)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import yaml

from weaver.cli import profile as cli
from weaver.config.deployment import parse_deployment
from weaver.profiling import serving_probe
from weaver.profiling.engine_profile import least_squares
from weaver.profiling.serving_calibration import (
    NOTES_KEY,
    ServingDecodePoint,
    ServingPlan,
    ServingPrefillPoint,
    apply_serving_overhead,
    fit_serving_overhead,
)
from weaver.results.records import RequestRecord, RequestStatus
from weaver.sim.perf_model import PerfModel
from weaver.sim.profile import Profile

SMOLLM2_PROFILE = (Path(__file__).resolve().parents[2] / "benchmarks" / "profiles"
                   / "smollm2_135m_cpu_vllm.json")
A, K, P = 0.030, 0.002, 0.150  # the overhead the points below are built with


def decode_points(lin, a=A, k=K, batch_sizes=(1, 4, 16, 32), per_seq_context=64):
    return [ServingDecodePoint(b, b * per_seq_context,
                               lin.decode_time(b, b * per_seq_context) + a + k * b)
            for b in batch_sizes]


def prefill_points(lin, p=P):
    return [ServingPrefillPoint(n, lin.prefill_time(n) + p) for n in (64, 256)]


def calibrated(lin, fit):
    return apply_serving_overhead(lin.profile(), fit, measured_at="2026-11-23T10:00:00Z",
                                  command="weaver profile --calibrate-serving x.json",
                                  conditions="test")


def test_points_built_from_a_known_overhead_give_it_back(lin):
    fit = fit_serving_overhead(lin.profile(), decode_points(lin), prefill_points(lin))
    assert fit.intercept_s == pytest.approx(A)
    assert fit.per_seq_s == pytest.approx(K)
    assert fit.prefill_overhead_s == pytest.approx(P)
    assert [c.overhead_s for c in fit.decode] == pytest.approx([A + K * b for b in (1, 4, 16,
                                                                                     32)])
    assert fit.decode_overhead_s(10) == pytest.approx(A + 10 * K)


def test_least_squares_by_hand():
    # x = 0, 1, 2; y = 1, 2, 6: slope = sum(dx dy) / sum(dx^2) = 5 / 2; intercept 3 - 2.5
    assert least_squares([0, 1, 2], [1.0, 2.0, 6.0]) == pytest.approx((0.5, 2.5))


def test_a_negative_line_is_clamped_at_zero_but_kept_where_positive(lin):
    # overhead 40 ms - 1 ms per sequence: 0 from batch 40 on (the profile's row 1000 too)
    fit = fit_serving_overhead(lin.profile(), decode_points(lin, a=0.040, k=-0.001),
                               prefill_points(lin, p=-0.005))
    assert fit.per_seq_s == pytest.approx(-0.001)
    assert fit.decode_overhead_s(1) == pytest.approx(0.039)
    assert fit.decode_overhead_s(1000) == 0.0
    assert fit.prefill_overhead_s == 0.0  # a served TTFT is never below the engine's step
    profile = calibrated(lin, fit)
    assert profile.decode_s[0] == pytest.approx([t + 0.039 for t in lin.profile().decode_s[0]])
    assert profile.decode_s[1] == lin.profile().decode_s[1]
    assert profile.prefill_s == lin.profile().prefill_s


def test_calibrated_profile_is_shifted_exactly_and_says_how(lin, tmp_path):
    base = lin.profile()
    fit = fit_serving_overhead(base, decode_points(lin), prefill_points(lin))
    profile = calibrated(lin, fit)
    for b, old_row, new_row in zip(base.decode_batch_sizes, base.decode_s, profile.decode_s,
                                   strict=True):
        assert new_row == pytest.approx([t + A + K * b for t in old_row])
    assert profile.prefill_s == pytest.approx([t + P for t in base.prefill_s])
    assert profile.attention_s == base.attention_s
    assert profile.decode_batch_sizes == base.decode_batch_sizes
    assert base.decode_s == lin.profile().decode_s  # the input is not modified
    record = json.loads(profile.notes[NOTES_KEY])
    assert record["decode_overhead"]["intercept_s"] == pytest.approx(A)
    assert record["decode_overhead"]["per_seq_s"] == pytest.approx(K)
    assert record["prefill_overhead_s"] == pytest.approx(P)
    assert record["measured_at"] == "2026-11-23T10:00:00Z"
    assert record["command"].startswith("weaver profile --calibrate-serving")
    assert len(record["decode_points"]) == 4 and len(record["prefill_points"]) == 2
    assert record["in_process_source"] == base.source
    assert profile.source.startswith(base.source) and "serving-calibrated" in profile.source
    path = tmp_path / "calibrated.json"  # the format is unchanged: it round-trips
    profile.save(path)
    assert Profile.load(path).decode_s == profile.decode_s


def test_overhead_is_paid_once_per_step_in_mixed_steps(lin):
    """The simulator prices b decodes plus an n-token chunk as decode(b, c) + prefill(n + b)
    - prefill(b): the prefill overhead cancels, the decode overhead is counted once."""
    fit = fit_serving_overhead(lin.profile(), decode_points(lin), prefill_points(lin))
    old, new = PerfModel(lin.profile()), PerfModel(calibrated(lin, fit))

    def mixed(perf, b, c, n):
        return perf.decode_time(b, c) + perf.prefill_time(n + b) - perf.prefill_time(b)

    for b, c, n in [(1, 100, 50), (8, 5000, 300), (600, 10**5, 2000)]:
        assert mixed(new, b, c, n) - mixed(old, b, c, n) == pytest.approx(A + K * b)
        assert new.decode_time(b, c) - old.decode_time(b, c) == pytest.approx(A + K * b)
    assert new.prefill_time(300) - old.prefill_time(300) == pytest.approx(P)


def test_bad_input_says_what_is_wrong(lin):
    profile = lin.profile()
    with pytest.raises(ValueError, match="2 batch sizes"):
        fit_serving_overhead(profile, decode_points(lin, batch_sizes=(4,)) * 3,
                             prefill_points(lin))
    with pytest.raises(ValueError, match="prefill"):
        fit_serving_overhead(profile, decode_points(lin), [])
    with pytest.raises(ValueError, match="TPOT"):
        ServingDecodePoint(4, 256, 0.0)
    with pytest.raises(ValueError, match="TTFT"):
        ServingPrefillPoint(64, -0.1)
    with pytest.raises(ValueError, match="TPOT"):
        ServingDecodePoint(4, 256, float("nan"))
    with pytest.raises(ValueError, match="batch size"):
        ServingDecodePoint(0, 256, 0.1)
    with pytest.raises(ValueError, match="prompt"):
        ServingPrefillPoint(0, 0.1)
    twice = calibrated(lin, fit_serving_overhead(profile, decode_points(lin),
                                                 prefill_points(lin)))
    with pytest.raises(ValueError, match="already serving-calibrated"):
        fit_serving_overhead(twice, decode_points(lin), prefill_points(lin))


def test_plan_checks_and_sizes():
    with pytest.raises(ValueError, match="2 distinct"):
        ServingPlan(batch_sizes=(8, 8))
    with pytest.raises(ValueError, match="max_model_len"):
        ServingPlan(output_tokens=600)
    plan = ServingPlan()
    assert plan.kv_blocks() == 32 * 4  # 32 + 64 (+ 8 slack) tokens in blocks of 32


def test_plan_fits_two_to_three_minutes_for_smollm2():
    profile = Profile.load(SMOLLM2_PROFILE)
    assert 40 < ServingPlan().estimate_s(profile) < 120  # requests only, in-process times


def test_probe_deployment_is_a_valid_pinned_dedicated_engine(lin):
    plan = ServingPlan()
    data = serving_probe.deployment_dict("smollm2-135m-instruct", "1", plan,
                                         lin.SHAPE.kv_bytes_per_token)
    spec = parse_deployment(data).models[0]
    assert spec.cpu_cores == "1" and spec.block_size == 32 and spec.max_model_len == 512
    assert spec.max_num_seqs >= 32
    block_bytes = 32 * lin.SHAPE.kv_bytes_per_token
    assert spec.kv_cache_gib * (1 << 30) >= (plan.kv_blocks() + 1) * block_bytes


def record(i, first_token_at, tpot, output=64, prompt=33):
    return RequestRecord(request_id=i, model="probe", input_tokens=32, output_tokens=output,
                         scheduled_at_s=0.0, sent_at_s=0.01, ttft_s=first_token_at - 0.01,
                         e2e_s=first_token_at - 0.01 + tpot * (output - 1),
                         num_output_tokens=output, num_prompt_tokens=prompt,
                         status=RequestStatus.OK)


def test_decode_point_uses_the_requests_that_decoded_with_the_whole_batch():
    # One request was prefilled alone, then waited out the 3 s prefill of the other three:
    # its TPOT carries that step; the others decoded at 0.1 s a step from the start.
    records = [record(0, 0.2, 0.1 + 3.0 / 63)] + [record(i, 3.2, 0.1) for i in (1, 2, 3)]
    seen = serving_probe.decode_observation(records, 4)
    assert seen.point.tpot_s == pytest.approx(0.1)
    assert seen.num_full_batch == 3
    assert seen.point.mean_context_tokens == pytest.approx(4 * (33 + 32))
    failed = records[:3] + [record(3, 3.2, 0.1).model_copy(update={
        "status": RequestStatus.ERROR, "error": "HTTP 500"})]
    with pytest.raises(RuntimeError, match="HTTP 500"):
        serving_probe.decode_observation(failed, 4)


def test_serve_cores_are_parsed_and_checked():
    assert serving_probe.parse_serve_cores("all", "0") is None
    core = min(serving_probe.os.sched_getaffinity(0))
    assert serving_probe.parse_serve_cores("engine", str(core)) == {core}
    assert serving_probe.parse_serve_cores("engine", "0-1") == {0, 1}
    assert serving_probe.parse_serve_cores(f"{core}-{core}", str(core)) == {core}
    with pytest.raises(ValueError, match="serve-cores"):
        serving_probe.parse_serve_cores("fast", "0")
    with pytest.raises(ValueError, match="machine does not have"):
        serving_probe.parse_serve_cores("100000", "0")


def parse(argv):
    parser = argparse.ArgumentParser(prog="weaver")
    cli.register(parser.add_subparsers())
    return parser.parse_args(argv)


def test_profile_help_explains_the_calibration(capsys):
    with pytest.raises(SystemExit) as exc:
        parse(["profile", "--help"])
    assert exc.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--calibrate-serving" in out and "max(0, a + k b)" in out
    assert "--serve-cores" in out


def test_calibrate_serving_without_engine_exits_2_before_measuring(tmp_path, profile_path,
                                                                    monkeypatch):
    def no_server(*args, **kwargs):
        raise AssertionError("no measurement expected")

    monkeypatch.setattr(serving_probe, "measure_serving_points", no_server)
    args = parse(["profile", "--calibrate-serving", profile_path, "--out",
                  str(tmp_path / "out.json")])
    assert args.handler(args) == 2
    args = parse(["profile", "--calibrate-serving", str(tmp_path / "none.json"), "--engine",
                  "x", "--out", str(tmp_path / "out.json")])
    assert args.handler(args) == 2


def test_calibrate_serving_command_writes_the_calibrated_profile(tmp_path, lin, profile_path,
                                                                  lin_model_dir, monkeypatch,
                                                                  capsys):
    model_dir = lin_model_dir

    def fake_measure(model, core, plan, kv_bytes_per_token, work_dir, serve_cores, on_point,
                     deployment=None):
        assert plan.batch_sizes == (1, 8) and serve_cores is None and deployment is None
        decode = decode_points(lin, batch_sizes=plan.batch_sizes)
        prefill = prefill_points(lin)
        for point in decode + prefill:
            on_point(point, "fake")
        return serving_probe.ServingPoints(decode, prefill, work_dir / "d.yaml",
                                           work_dir / "s.log")

    monkeypatch.setattr(serving_probe, "measure_serving_points", fake_measure)
    out = tmp_path / "calibrated.json"
    core = min(serving_probe.os.sched_getaffinity(0))
    args = parse(["profile", "--calibrate-serving", profile_path, "--engine", str(model_dir),
                  "--cpu-core", str(core), "--serving-batch-sizes", "1", "8",
                  "--serve-cores", "all", "--out", str(out)])
    assert args.handler(args) == 0
    profile = Profile.load(out)
    assert profile.prefill_s == pytest.approx([t + P for t in lin.profile().prefill_s])
    printed = capsys.readouterr().out
    assert "a = 30.00 ms, k = 2.000 ms" in printed and "prefill overhead" in printed
    assert printed.count("served TPOT") == 2 and printed.count("served TTFT") == 2


def test_serving_deployment_is_served_as_it_is_and_checked_first(tmp_path, lin, profile_path,
                                                                 lin_model_dir, monkeypatch):
    model_dir = lin_model_dir
    core = min(serving_probe.os.sched_getaffinity(0))
    spec = {"model": str(model_dir), "role": "dedicated", "kv_cache_gib": 0.25,
            "max_model_len": 512, "block_size": 32, "num_gpu_blocks_override": 65}
    deployment = tmp_path / "dedicated.yaml"
    deployment.write_text(yaml.safe_dump({"models": [
        {"name": "hot", **spec, "cpu_cores": str(core)},
        {"name": "cold", **spec, "cpu_cores": str(core)}], "weaving": []}))
    seen = []

    def fake_measure(model, core, plan, kv_bytes_per_token, work_dir, serve_cores, on_point,
                     deployment=None):
        seen.append(deployment)
        decode = decode_points(lin, batch_sizes=plan.batch_sizes)
        return serving_probe.ServingPoints(decode, prefill_points(lin), work_dir / "d.yaml",
                                           work_dir / "s.log")

    monkeypatch.setattr(serving_probe, "measure_serving_points", fake_measure)
    out = tmp_path / "calibrated.json"

    def run(target, *extra):
        args = parse(["profile", "--calibrate-serving", profile_path, "--engine",
                      str(model_dir), "--cpu-core", str(core), "--serving-batch-sizes", "1",
                      "8", "--serving-deployment", target, *extra, "--out", str(out)])
        return args.handler(args)

    assert run(f"{deployment}:hot") == 0
    assert seen == [(deployment, "hot")]
    notes = json.loads(Profile.load(out).notes[NOTES_KEY])
    assert f"{deployment} as it is, measuring 'hot'" in notes["conditions"]
    # Checked before anything is served: the form, the model, its KV room.
    for bad in (str(deployment), f"{deployment}:nope", f"{tmp_path / 'none.yaml'}:hot"):
        assert run(bad) == 2, bad
    assert run(f"{deployment}:hot", "--serving-batch-sizes", "1", "32") == 2  # 128 > 64 blocks
    # A profile timed on other cores than the model's (one thread against two) is refused.
    wider = tmp_path / "wider.yaml"
    wider.write_text(deployment.read_text().replace(f"cpu_cores: '{core}'", "cpu_cores: 0-1"))
    assert "0-1" in wider.read_text()
    assert run(f"{wider}:hot") == 2
    assert len(seen) == 1


def test_cpu_core_takes_a_deployment_core_list():
    args = parse(["profile", "--engine", "m", "--cpu-core", "0-1", "--out", "p.json"])
    assert args.cpu_core == "0-1"
    for bad in ("x", "1-0", "auto"):
        with pytest.raises(SystemExit):
            parse(["profile", "--engine", "m", "--cpu-core", bad, "--out", "p.json"])
