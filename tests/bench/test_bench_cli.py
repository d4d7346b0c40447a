"""`weaver bench` sub-commands, driven through argparse against local fake servers."""

from __future__ import annotations

import argparse
import socket

import pytest
from bench_fake_server import FakeBehavior

from weaver.bench.compare import compare_deployments, parse_target
from weaver.bench.loadgen import LoadGenConfig
from weaver.bench.report import comparison_table
from weaver.cli import bench
from weaver.results.goodput import Slo
from weaver.results.records import ALL_MODELS, load_result
from weaver.workloads.types import TraceRequest


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="weaver")
    bench.register(parser.add_subparsers())
    args = parser.parse_args(argv)
    return args.handler(args)


WORKLOAD = ["--model", "hot", "--model", "cold", "--power-law-alpha", "1.5",
            "--num-requests", "8", "--length-scale", "0.01", "--max-model-len", "16",
            "--no-progress"]


def test_run_summary_plot(fake_server, tmp_path, capsys, monkeypatch):
    behavior = FakeBehavior(ttft_s=0.02, itl_s=0.005)
    server = fake_server(behavior)
    out = tmp_path / "r.json"
    argv = ["bench", "run", "--url", server.url, "--label", "fake", "--rate", "20", "40",
            "--out", str(out), "--isolated", "hot=20,5", "--isolated", "cold=20,5",
            "--tpot-slo-ms", "50", "--role", "hot=hot", "--role", "cold=cold", *WORKLOAD]
    monkeypatch.setattr("sys.argv", ["weaver", *argv])
    assert _main(argv) == 0
    result = load_result(out)
    assert [run.rate for run in result.runs] == [20.0, 40.0]
    run = result.runs[0]
    assert run.summary[ALL_MODELS].num_ok == 8
    assert run.roles == {"hot": "hot", "cold": "cold"}
    assert run.workload["model_rates"]["hot"] > run.workload["model_rates"]["cold"]
    assert set(run.slo["hot"].attainment) == {"5", "8"}
    # --max-model-len 16 less the prompt margin (BOS, tokenizer drift).
    fits = 16 - bench.PROMPT_TOKEN_MARGIN
    assert all(r.input_tokens + r.output_tokens <= fits for r in run.records)
    assert result.command == ["weaver", *argv]
    # Both rates send request ids 0-7 to the one server: with the same texts the second
    # rate would be served from the prefix cache the first one filled.
    assert [run.loadgen["prompt_salt"] for run in result.runs] == [0, 1]
    prompts = [s["prompt"] for s in behavior.streams]
    assert len(prompts) == 16 and len(set(prompts)) == 16
    assert set(prompts[:8]).isdisjoint(prompts[8:])
    printed = capsys.readouterr().out
    assert "TPOT p90" in printed and "SLO x5" in printed

    assert _main(["bench", "summary", str(out), "--tpot-slo-ms", "50"]) == 0
    printed = capsys.readouterr().out
    assert "fake hot: 40 req/s" in printed  # TPOT ~5 ms meets 50 ms at both rates

    assert _main(["bench", "plot", str(out), "--out-dir", str(tmp_path / "png")]) == 0
    assert (tmp_path / "png" / "tpot_vs_rate.png").stat().st_size > 0
    assert (tmp_path / "png" / "throughput.png").stat().st_size > 0


def test_a_phased_model_is_offered_at_its_rate_over_its_cycles(fake_server, tmp_path):
    """`NAME=RATE@ON/OFF`: the run records the phases, and its offered rate is what the
    phased model sends over whole cycles (40 req/s half the time) plus the steady one's."""
    server = fake_server(FakeBehavior(ttft_s=0.01, itl_s=0.002))
    out = tmp_path / "r.json"
    assert _main(["bench", "run", "--url", server.url, "--model", "hot=40@0.2/0.2",
                  "--model", "cold=20", "--num-requests", "8", "--length-scale", "0.01",
                  "--max-model-len", "16", "--no-progress", "--out", str(out)]) == 0
    run = load_result(out).runs[0]
    assert run.workload["model_phases"] == {"hot": [0.2, 0.2]}
    assert run.workload["model_rates"] == {"hot": 40.0, "cold": 20.0}
    assert run.rate == pytest.approx(40.0)
    hot = [r.scheduled_at_s for r in run.records if r.model == "hot"]
    assert len(hot) == 4 and all(t % 0.4 < 0.2 for t in hot)


def test_a_copy_is_sent_the_same_requests_and_offered_at_its_models_rate(fake_server, tmp_path):
    """`NAME=same:OTHER`: NAME gets OTHER's arrivals and lengths (what side_by_side.py needs
    to compare two setups), on top of --num-requests, and the phases and rate of OTHER."""
    server = fake_server(FakeBehavior(ttft_s=0.01, itl_s=0.002))
    out = tmp_path / "r.json"
    assert _main(["bench", "run", "--url", server.url, "--model", "plain=40@0.2/0.2",
                  "--model", "lending=same:plain", "--num-requests", "6", "--length-scale",
                  "0.01", "--max-model-len", "16", "--no-progress", "--out", str(out)]) == 0
    run = load_result(out).runs[0]
    assert run.workload["model_rates"] == {"plain": 40.0, "lending": 40.0}
    assert run.workload["model_phases"] == {"plain": [0.2, 0.2], "lending": [0.2, 0.2]}
    assert run.rate == pytest.approx(40.0)

    def stream(model):
        return sorted((round(r.scheduled_at_s, 3), r.input_tokens, r.output_tokens)
                      for r in run.records if r.model == model)

    assert len(stream("plain")) == 6 and stream("lending") == stream("plain")


def test_compare_two_fake_deployments_reports_ratios(fake_server, tmp_path, capsys):
    fast = fake_server(FakeBehavior(ttft_s=0.02, itl_s=0.01))
    slow = fake_server(FakeBehavior(ttft_s=0.02, itl_s=0.03))
    requests = [TraceRequest(0.02 * i, 8, 8, "m", i) for i in range(4)]
    runs = compare_deployments(
        [("fast", fast.url), ("slow", slow.url)], requests,
        LoadGenConfig(fast.url, show_progress=False), slo=Slo(tpot_s=0.025),
    )
    assert [r.label for r in runs] == ["fast", "slow"]
    assert [r.base_url for r in runs] == [fast.url, slow.url]
    ratio = runs[1].summary["m"].tpot.p(90) / runs[0].summary["m"].tpot.p(90)
    assert 1.5 < ratio < 4.0  # injected 30 ms vs 10 ms; slack for a busy machine
    assert runs[0].slo["m"].slo_attainment == 1.0
    assert runs[1].slo["m"].slo_attainment == 0.0
    assert runs[1].slo["m"].good_requests_per_s == 0
    table = comparison_table(runs)
    assert "relative to fast" in table
    with pytest.raises(ValueError, match="repeat"):
        compare_deployments([("a", fast.url), ("a", slow.url)], requests, LoadGenConfig(fast.url))

    out = tmp_path / "cmp.json"
    fast_behavior, slow_behavior = FakeBehavior(0.0, 0.001), FakeBehavior(0.0, 0.001)
    fast, slow = fake_server(fast_behavior), fake_server(slow_behavior)
    argv = ["bench", "compare", "--target", f"fast={fast.url}", "--target", f"slow={slow.url}",
            "--rate", "50", "100", "--out", str(out), *WORKLOAD]
    assert _main(argv) == 0
    assert [r.label for r in load_result(out).runs] == ["fast", "slow"] * 2
    assert "x TPOT p90" in capsys.readouterr().out
    # The deployments compared at a rate get the same prompts; the next rate other ones.
    by_rate = [[s["prompt"] for s in b.streams] for b in (fast_behavior, slow_behavior)]
    assert sorted(by_rate[0]) == sorted(by_rate[1])
    assert set(by_rate[0][:8]).isdisjoint(by_rate[0][8:])


@pytest.mark.parametrize(("argv", "message"), [
    (["bench", "run", "--url", "localhost:1", "--model", "a", "--rate", "1"], "http://"),
    (["bench", "run", "--url", "http://127.0.0.1:9", "--model", "a"], "--rate is required"),
    (["bench", "run", "--url", "http://127.0.0.1:9", "--model", "a=1", "--rate", "1"], "not both"),
    (["bench", "run", "--url", "http://127.0.0.1:9", "--model", "a", "--rate", "1",
      "--trace", "sharegpt"], "unknown trace"),
    (["bench", "compare", "--target", "nourl", "--model", "a", "--rate", "1"], "LABEL=URL"),
    (["bench", "summary", "/nonexistent.json"], "does not exist"),
    (["bench", "run", "--config", "/nonexistent.yaml", "--model", "a", "--rate", "1"],
     "neither an http:// or https:// URL nor an existing deployment file"),
])
def test_user_errors_exit_2_with_a_message(argv, message, capsys):
    assert _main(argv) == 2
    assert message in capsys.readouterr().err


def test_unreachable_server_warns_and_missing_isolated_fails_early(tmp_path, capsys):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    out = tmp_path / "down.json"
    assert _main(["bench", "run", "--url", url, "--rate", "50", "--out", str(out), *WORKLOAD]) == 0
    assert "no request" in capsys.readouterr().err
    assert load_result(out).runs[0].summary[ALL_MODELS].num_errors == 8
    argv = ["bench", "run", "--url", url, "--rate", "50", "--isolated", "hot=1,1", *WORKLOAD]
    assert _main(argv) == 2
    assert "['cold']" in capsys.readouterr().err


def test_parse_target():
    assert parse_target("weaver=http://127.0.0.1:8000") == ("weaver", "http://127.0.0.1:8000")


def test_bench_without_subcommand_prints_help(capsys):
    assert _main(["bench"]) == 2
    assert "bench commands" in capsys.readouterr().out


def test_registers_through_weaver_main(monkeypatch, capsys):
    # What the merge does: main imports the module by name and calls register().
    from weaver.cli import main

    monkeypatch.setattr(main, "SUBCOMMAND_MODULES", ("weaver.cli.bench",))
    assert main.main(["bench", "summary", "/nonexistent.json"]) == 2
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main.main(["bench", "plot", "--help"])
    assert "tpot_vs_rate.png" in capsys.readouterr().out


def test_frontend_cores_the_machine_lacks_stop_the_run_before_it_sends(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert _main(["bench", "run", "--url", "http://127.0.0.1:9", *WORKLOAD,
                  "--frontend-cores", "4096", "--out", str(out)]) == 2
    assert "--frontend-cores: cpu_cores '4096' names cores [4096]" in capsys.readouterr().err
    assert not out.exists()


def test_bench_with_options_and_no_action_means_run(fake_server, tmp_path, monkeypatch):
    # `weaver bench --config D ...` (the short spelling) is `weaver bench run ...`.
    from weaver.cli import main

    server = fake_server(FakeBehavior(ttft_s=0.01, itl_s=0.002))
    out = tmp_path / "short.json"
    monkeypatch.setattr(main, "SUBCOMMAND_MODULES", ("weaver.cli.bench",))
    argv = ["bench", "--url", server.url, "--rate", "50", "--out", str(out), *WORKLOAD]
    assert main.main(argv) == 0
    (run,) = load_result(out).runs
    assert run.label == "deployment"
    assert run.summary[ALL_MODELS].num_ok == 8


def test_run_needs_exactly_one_of_url_and_config(capsys):
    with pytest.raises(SystemExit):
        _main(["bench", "run", "--model", "a", "--rate", "1"])
    assert "one of the arguments --url --config is required" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _main(["bench", "run", "--url", "http://x", "--config", "d.yaml", "--model", "a"])
    assert "not allowed with argument" in capsys.readouterr().err
