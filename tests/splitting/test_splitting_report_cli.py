"""The report table and `weaver plan-split` (weaver.cli.profile.py), called directly."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from weaver.cli import profile as plan_split_cli
from weaver.splitting.algorithm import SplitPlan, plan_split
from weaver.splitting.profile import SplitProfile
from weaver.splitting.report import format_report


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="weaver")
    plan_split_cli.register(parser.add_subparsers())
    return parser


def _run(argv: list[str]) -> int:
    args = _parser().parse_args(["plan-split", *argv])
    return args.handler(args)


@pytest.fixture
def profile_path(tmp_path, profile_dict):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile_dict))
    return path


def test_report_shows_times_chunks_and_w(profile_dict):
    profile = SplitProfile.model_validate(profile_dict)
    plan = plan_split(profile.operator_specs(), profile.split_config(threshold_frac=0.005))
    text = format_report(profile, plan)
    lm_head_row = next(line for line in text.splitlines() if line.startswith("lm_head"))
    # name, per step, mean us, p50 us, samples, W share, split dim, chunks, chunk us
    cells = lm_head_row.split()
    assert cells[:5] == ["lm_head", "1", "1200.0", "1100.0", "50"]
    assert cells[6:8] == ["49152", str(plan.chunks["lm_head"])]
    assert plan.chunks["lm_head"] > 1
    assert f"{plan.wait_before_s * 1e6:.1f} us -> {plan.wait_after_s * 1e6:.1f} us" in text
    assert "Stopped because W is under the threshold" in text
    # W shares are the quadratic weights and add up to 100 %.
    lines = [line.split() for line in text.splitlines()]
    rows = [cells for cells in lines if cells and cells[0] in plan.chunks]
    assert [row[0] for row in rows] == list(plan.chunks)
    shares = [float(row[5].rstrip("%")) for row in rows]
    assert sum(shares) == pytest.approx(100.0, abs=0.5)


def test_cli_prints_plan_and_writes_json(profile_path, tmp_path, capsys):
    out = tmp_path / "plan.json"
    rc = _run(["--profile", str(profile_path), "--threshold-frac", "0.005", "-o", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    plan = SplitPlan.load(out)
    assert plan.wait_after_s <= plan.threshold_s == pytest.approx(0.005 * 4e-3)
    assert plan.overhead_s == 3e-6  # the profile's measured overhead
    assert "Expected wait W" in printed
    assert f"Plan written to {out}" in printed


def test_cli_options_change_the_plan(profile_path, tmp_path):
    loose, strict = tmp_path / "loose.json", tmp_path / "strict.json"
    assert _run(["--profile", str(profile_path), "--output", str(loose)]) == 0
    args = ["--profile", str(profile_path), "--threshold-frac", "0.001", "--overhead-us", "0"]
    assert _run([*args, "--output", str(strict)]) == 0
    loose_plan, strict_plan = SplitPlan.load(loose), SplitPlan.load(strict)
    assert loose_plan.steps == []  # 5 % of 4 ms is above the unsplit W
    assert strict_plan.overhead_s == 0.0
    assert strict_plan.wait_after_s < loose_plan.wait_after_s


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--threshold-frac", "2"], "threshold_frac"),
        (["--overhead-us", "-3"], "overhead_s"),
        (["--arrival-rate", "1e6"], "offload fewer"),
    ],
)
def test_cli_bad_options_exit_2_with_message(profile_path, capsys, extra, message):
    assert _run(["--profile", str(profile_path), *extra]) == 2
    assert message in capsys.readouterr().err


def test_cli_bad_profile_exits_2(tmp_path, capsys):
    assert _run(["--profile", str(tmp_path / "missing.json")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_cli_help_explains_itself(capsys):
    with pytest.raises(SystemExit) as info:
        _parser().parse_args(["plan-split", "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--profile", "--threshold-frac", "--overhead-us", "--output", "K - N"):
        assert flag in text


def test_imports_without_vllm_or_torch():
    code = (
        "import sys, weaver.splitting.report, weaver.cli.profile;"
        "print([m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch', 'cupy')])"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
