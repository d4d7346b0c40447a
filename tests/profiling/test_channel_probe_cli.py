from __future__ import annotations

import argparse
import json
import os

import pytest

from weaver.cli import offload_probe as cli
from weaver.profiling.probe_config import ProbeConfig


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="weaver")
    cli.register(parser.add_subparsers())
    return parser


def test_help_explains_every_flag(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["offload-probe", "--help"])
    text = capsys.readouterr().out
    for flag in ("--num-seqs", "--executor", "--output", "--plot", "--shm-prefix"):
        assert flag in text
    assert "round trip" in text


def test_bad_shape_is_reported_without_a_traceback(tmp_path, capsys):
    args = build_parser().parse_args(
        ["offload-probe", "--num-q-heads=10", "--num-kv-heads=4", f"--output={tmp_path}/x.json"]
    )
    assert args.handler(args) == 2
    assert "multiple of num_kv_heads" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_bad_config_is_a_value_error():
    with pytest.raises(ValueError, match="executor must be one of"):
        ProbeConfig(executor="gpu")
    with pytest.raises(ValueError, match="num_tasks must be > 0"):
        ProbeConfig(num_tasks=0)


def test_probe_runs_between_two_processes_and_plots_from_json(tmp_path, capsys):
    out = tmp_path / "probe.json"
    png = tmp_path / "probe.png"
    args = build_parser().parse_args(
        [
            "offload-probe",
            "--num-layers=2",
            "--num-q-heads=4",
            "--num-kv-heads=2",
            "--head-size=32",
            "--block-size=32",
            "--num-seqs=2",
            "--seq-len=40",
            "--num-tasks=30",
            "--num-warmup-tasks=2",
            "--executor=reference",
            "--num-idle-polls=1000",
            f"--shm-prefix=wvtest{os.getpid()}",
            f"--output={out}",
            f"--plot={png}",
            "--no-progress",
        ]
    )
    assert args.handler(args) == 0
    results = json.loads(out.read_text())
    assert len(results["round_trip_samples_us"]) == 30
    rt = results["round_trip_us"]
    assert 0 < rt["p50"] <= rt["p90"] <= rt["p99"] <= rt["max"]
    assert results["receiver_stats"]["num_served"] == 32
    assert results["idle_poll_ns"] > 0
    assert png.stat().st_size > 0
    assert "round trip over 30 tasks" in capsys.readouterr().out
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"wvtest{os.getpid()}-probe")]
