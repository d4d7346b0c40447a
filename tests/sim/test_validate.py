"""Sim vs measured: replay of bench runs, deployment-built clusters, `simulate --validate`."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from weaver.cli.main import build_parser
from weaver.config.deployment import load_deployment, parse_deployment
from weaver.results.metrics import summarize
from weaver.results.records import BenchResult, RequestRecord, RequestStatus, RunResult
from weaver.sim.deployment import sim_config_from_deployment
from weaver.sim.metrics import bench_duration_s, bench_record
from weaver.sim.runner import simulate
from weaver.sim.validate import validate_results
from weaver.sim.workload import replay_run
from weaver.workloads.types import TraceRequest

DEPLOYMENTS = Path(__file__).resolve().parents[2] / "benchmarks" / "deployments"


def _requests() -> list[TraceRequest]:
    # Enough hot requests at once that 64 local blocks of 32 tokens do not hold them all.
    hot = [TraceRequest(0.1 * i, 200, 60, "hot", i) for i in range(16)]
    cold = [TraceRequest(0.5 + i, 150, 40, "cold", 100 + i) for i in range(3)]
    return sorted(hot + cold, key=lambda r: r.arrival_s)


def test_replay_run_uses_what_the_server_saw():
    records = [
        RequestRecord(request_id=0, model="hot", input_tokens=100, output_tokens=20,
                      scheduled_at_s=1.0, sent_at_s=1.01, ttft_s=0.1, e2e_s=1.0,
                      num_output_tokens=20, num_prompt_tokens=103, status=RequestStatus.OK),
        RequestRecord(request_id=1, model="cold", input_tokens=50, output_tokens=10,
                      scheduled_at_s=0.5, sent_at_s=0.5, status=RequestStatus.ERROR),
        RequestRecord(request_id=2, model="hot", input_tokens=50, output_tokens=10,
                      scheduled_at_s=9.0),  # never sent
    ]
    run = RunResult(label="x", base_url="u", rate=1.0, started_at="t", duration_s=2.0,
                    workload={}, loadgen={}, records=records, summary={})
    assert replay_run(run) == [TraceRequest(0.5, 50, 10, "cold", 1),
                               TraceRequest(1.01, 103, 20, "hot", 0)]


def test_weaving_deployment_becomes_a_pair_with_the_lent_blocks(cpu_profile):
    deployment = load_deployment(DEPLOYMENTS / "weaving.yaml")
    config = sim_config_from_deployment(deployment, {"hot": cpu_profile, "cold": cpu_profile},
                                        _requests())
    hot, cold = config.models
    assert (hot.num_blocks, hot.block_size) == (64, 32)  # override 65 minus the null block
    assert (cold.block_size, cold.num_blocks) == (128, 44)  # 0.25 GiB of 128-token blocks
    assert config.policy == "weaver" and config.weaving.offload_policy == "ratio"
    pair = config.placement.pairs[0]
    assert (pair.remote_blocks, pair.offload_ratio) == (128, 0.67)
    dedicated = sim_config_from_deployment(load_deployment(DEPLOYMENTS / "dedicated.yaml"),
                                           {"hot": cpu_profile, "cold": cpu_profile},
                                           _requests())
    assert dedicated.policy == "dedicated" and not dedicated.placement.pairs


def test_weaving_places_remote_by_the_hot_schedulers_ratio(cpu_profile):
    deployment = load_deployment(DEPLOYMENTS / "weaving.yaml")
    config = sim_config_from_deployment(deployment, {"hot": cpu_profile, "cold": cpu_profile},
                                        _requests())
    result = simulate(config, requests=_requests())
    hot = [r for r in result["requests"] if r["model"] == "hot"]
    assert all(r["e2e_s"] is not None for r in result["requests"])
    # r = 0.67 of the running set: about two in three hot sequences are remote.
    assert 0.5 <= sum(r["is_remote"] for r in hot) / len(hot) <= 0.8


def test_mux_group_becomes_one_instance_taking_turns_with_its_own_kv(cpu_profile):
    profiles = {"hot": cpu_profile, "cold": cpu_profile}
    for name, mode in (("muxserve", "spatial-temporal"), ("mux_temporal", "temporal")):
        config = sim_config_from_deployment(load_deployment(DEPLOYMENTS / f"{name}.yaml"),
                                            profiles, _requests())
        assert config.policy == "muxserve" and config.cluster.num_gpus == 1
        (gpu,) = config.placement.gpus
        assert gpu.models == ["hot", "cold"] and gpu.mux.own_kv and gpu.mux.mode == mode
        assert gpu.mux.weights == {"hot": 0.74, "cold": 0.26} and gpu.mux.skip_limit == 4
        assert [m.num_blocks for m in config.models] == [64, 44]  # as the engines have
        result = simulate(config, requests=_requests())
        assert all(r["e2e_s"] is not None for r in result["requests"])


def _measured_by_the_sim(deployment_file: Path, profile: str) -> RunResult:
    """A 'measured' run whose records are the simulator's own: validation must match it."""
    config = sim_config_from_deployment(load_deployment(deployment_file),
                                        {"hot": profile, "cold": profile}, _requests())
    records = [bench_record(r) for r in simulate(config, requests=_requests())["requests"]]
    duration = bench_duration_s(records)
    return RunResult(label=deployment_file.stem, base_url="sim", rate=1.0, started_at="t",
                     duration_s=duration, workload={}, loadgen={}, records=records,
                     summary=summarize(records, duration))


COMPARED = ("dedicated", "mux_temporal", "muxserve", "weaving")


def test_validation_of_runs_the_simulator_produced_is_exact(cpu_profile):
    runs = [_measured_by_the_sim(DEPLOYMENTS / f"{n}.yaml", cpu_profile) for n in COMPARED]
    result = BenchResult(command=["weaver", "bench", "compare"], created_at="t", machine={},
                         runs=runs)
    deployments = {n: load_deployment(DEPLOYMENTS / f"{n}.yaml") for n in COMPARED}
    report = validate_results([result], deployments, {"hot": cpu_profile, "cold": cpu_profile})
    assert report["all_within"] and report["num_checked"] == 4 * 2 * 2  # runs x models x 2
    assert [r["policy"] for r in report["runs"]] == ["dedicated", "muxserve", "muxserve",
                                                     "weaver"]
    for run in report["runs"]:
        for c in run["comparisons"]:
            assert c["ratio"] == pytest.approx(1.0, rel=1e-9)


def _slower_hot(run: RunResult, factor: float) -> RunResult:
    """The same run with every hot request's decode FACTOR times longer (TTFT kept)."""
    slower = run.model_copy(deep=True)
    for rec in slower.records:
        if rec.model == "hot" and rec.e2e_s is not None:
            rec.e2e_s = rec.ttft_s + factor * (rec.e2e_s - rec.ttft_s)
    slower.summary = summarize(slower.records, slower.duration_s)
    return slower


def _results(*runs: RunResult) -> list[BenchResult]:
    return [BenchResult(command=["weaver", "bench", "compare"], created_at="t", machine={},
                        runs=[run]) for run in runs]


def test_repeats_are_compared_by_their_mean_with_the_measured_spread(cpu_profile):
    exact = _measured_by_the_sim(DEPLOYMENTS / "weaving.yaml", cpu_profile)
    deployments = {"weaving": load_deployment(DEPLOYMENTS / "weaving.yaml")}
    profiles = {"hot": cpu_profile, "cold": cpu_profile}
    # Alone, the slow repeat misses (1/1.3); with the exact one its mean is 1.15x the sim.
    alone = validate_results(_results(_slower_hot(exact, 1.3)), deployments, profiles)
    both = validate_results(_results(exact, _slower_hot(exact, 1.3)), deployments, profiles)
    assert both["num_results"] == 2 and [r["num_runs"] for r in both["runs"]] == [2]

    def hot_tpot(report):
        return next(c for c in report["runs"][0]["comparisons"]
                    if c["model"] == "hot" and c["metric"] == "mean_tpot_s")

    assert not hot_tpot(alone)["is_within"] and hot_tpot(alone)["measured_spread"] == 0
    mean = hot_tpot(both)
    assert mean["ratio"] == pytest.approx(1 / 1.15) and mean["is_within"]
    assert len(mean["measured_runs"]) == 2
    assert mean["measured_runs"][1] == pytest.approx(1.3 * mean["measured_runs"][0])
    assert mean["simulated_runs"][0] == pytest.approx(mean["simulated_runs"][1])
    assert mean["measured_spread"] == pytest.approx(0.3 / 1.15)
    assert both["num_measured_spread_over_tolerance"] >= 1
    cold = next(c for c in both["runs"][0]["comparisons"]
                if c["model"] == "cold" and c["metric"] == "mean_tpot_s")
    assert cold["measured_spread"] == pytest.approx(0) and cold["is_within"]


def test_repeats_of_different_workloads_are_refused_other_seeds_are_not(cpu_profile):
    exact = _measured_by_the_sim(DEPLOYMENTS / "weaving.yaml", cpu_profile)
    exact = exact.model_copy(update={"workload": {"trace": "azure-conv", "seed": 0}})
    deployments = {"weaving": load_deployment(DEPLOYMENTS / "weaving.yaml")}
    profiles = {"hot": cpu_profile, "cold": cpu_profile}
    other = exact.model_copy(update={"workload": {"trace": "azure-code", "seed": 0}})
    with pytest.raises(ValueError, match="different workloads"):
        validate_results(_results(exact, other), deployments, profiles)
    # A goodput search's runs of one rate at several seeds: compared by their mean.
    seed_1 = exact.model_copy(update={"workload": {"trace": "azure-conv", "seed": 1}})
    assert validate_results(_results(exact, seed_1), deployments, profiles)["runs"][0][
        "num_runs"] == 2


class _TokensPerSecond:
    """A stand-in for the goodput search's judge (`regrade`, tested in tests/bench): a
    label's 'goodput' is the inverse of its hot requests' mean TPOT, so a slower decode
    reads lower."""

    def __init__(self, runs: list[RunResult]) -> None:
        self.runs = runs

    def _rate(self, run: RunResult) -> float:
        hot = [r for r in run.records if r.model == "hot" and r.e2e_s is not None]
        return 1 / statistics.fmean((r.e2e_s - r.ttft_s) / (r.output_tokens - 1) for r in hot)

    def goodput(self, label: str) -> float:
        return statistics.fmean(self._rate(r) for r in self.runs if r.label == label)

    def seed_goodputs(self, label: str) -> dict[int, float]:
        return {i: self._rate(r) for i, r in enumerate(self.runs) if r.label == label}


def test_a_goodput_search_is_judged_again_on_its_simulated_runs(cpu_profile):
    """validate_goodput replays every run and hands the judge the simulated records: the
    simulator's own runs come back equal; a run measured slower does not."""
    from weaver.sim.validate import validate_goodput

    exact = _measured_by_the_sim(DEPLOYMENTS / "weaving.yaml", cpu_profile)
    deployments = {"weaving": load_deployment(DEPLOYMENTS / "weaving.yaml")}
    profiles = {"hot": cpu_profile, "cold": cpu_profile}
    search = {"labels": ["weaving"], "slo": {"ttft_ms": 10000.0, "tpot_ms": 60.0},
              "judged_model": "hot"}
    same = validate_goodput(search, [exact], _TokensPerSecond, deployments, profiles)
    (row,) = same["goodput"]
    assert row["ratio"] == pytest.approx(1.0) and same["num_within"] == 1
    slow = validate_goodput(search, [_slower_hot(exact, 3.0)], _TokensPerSecond, deployments,
                            profiles)
    (row,) = slow["goodput"]
    assert row["measured"] < row["simulated"] == pytest.approx(same["goodput"][0]["simulated"])


def test_an_auto_pair_is_simulated_with_the_deployments_targets(cpu_profile):
    from weaver.sim.cluster import Cluster
    from weaver.sim.engine import Engine
    from weaver.sim.plan import default_plan
    from weaver.sim.policies import get_policy
    from weaver.weaving.placement import AdaptivePlacement

    deployment = load_deployment(DEPLOYMENTS / "kv_bound" / "weaving_auto.yaml")
    config = sim_config_from_deployment(deployment, {"hot": cpu_profile, "cold": cpu_profile},
                                        _requests())
    pair = config.placement.pairs[0]
    assert (pair.offload_ratio, pair.hot_tpot_ms, pair.cold_tpot_budget) == ("auto", 170, 1.10)
    policy = get_policy("weaver")(Cluster(config, Engine()), default_plan(config))
    (hot,) = policy.instances[0].servers.values()
    assert isinstance(hot.placement, AdaptivePlacement)
    assert hot.placement.hot_tpot_target_s == pytest.approx(0.170)
    assert hot.placement.targets.cold_budget == pytest.approx(1.10)


def test_validate_command_takes_repeats(tmp_path, cpu_profile, capsys):
    exact = _measured_by_the_sim(DEPLOYMENTS / "weaving.yaml", cpu_profile)
    files = []
    for index, run in enumerate((exact, _slower_hot(exact, 1.3))):
        result = BenchResult(command=["weaver", "bench", "compare",
                                      str(DEPLOYMENTS / "weaving.yaml")],
                             created_at="t", machine={}, runs=[run])
        files.append(tmp_path / f"repeat{index}.json")
        files[-1].write_text(result.model_dump_json())
    args = build_parser().parse_args(["simulate", "--validate", *map(str, files),
                                      "--profile", cpu_profile, "--out", str(tmp_path)])
    assert args.handler(args) == 0
    out = capsys.readouterr().out
    assert "meas. spread" in out and "of the mean of up to 2 measured runs" in out
    report = json.loads((tmp_path / "validate_repeat0_x2.json").read_text())
    assert report["results"] == [str(f) for f in files]
    assert report["runs"][0]["num_runs"] == 2


def test_validate_command_reads_deployments_from_the_results_command(tmp_path, cpu_profile,
                                                                     capsys):
    run = _measured_by_the_sim(DEPLOYMENTS / "weaving.yaml", cpu_profile)
    # Hand-edit the "measurement": the hot model's TPOTs 30 % longer than simulated.
    for rec in run.records:
        if rec.model == "hot" and rec.e2e_s is not None:
            rec.e2e_s = rec.ttft_s + 1.3 * (rec.e2e_s - rec.ttft_s)
    run.summary = summarize(run.records, run.duration_s)
    result = BenchResult(command=["weaver", "bench", "compare",
                                  str(DEPLOYMENTS / "weaving.yaml")],
                         created_at="t", machine={}, runs=[run])
    results_file = tmp_path / "measured.json"
    results_file.write_text(result.model_dump_json())
    args = build_parser().parse_args(["simulate", "--validate", str(results_file),
                                      "--profile", cpu_profile, "--out", str(tmp_path)])
    assert args.handler(args) == 0
    out = capsys.readouterr().out
    assert "mean_tpot_s" in out and "NO" in out
    report = json.loads((tmp_path / "validate_measured.json").read_text())
    hot_tpot = next(c for c in report["runs"][0]["comparisons"]
                    if c["model"] == "hot" and c["metric"] == "mean_tpot_s")
    assert hot_tpot["ratio"] == pytest.approx(1 / 1.3) and not hot_tpot["is_within"]
    cold_tpot = next(c for c in report["runs"][0]["comparisons"]
                     if c["model"] == "cold" and c["metric"] == "mean_tpot_s")
    assert cold_tpot["is_within"]


def test_validate_command_takes_a_profile_per_deployment_model(tmp_path, cpu_profile,
                                                               smollm2_profile, capsys):
    runs = [_measured_by_the_sim(DEPLOYMENTS / f"{n}.yaml", cpu_profile)
            for n in ("dedicated", "muxserve")]
    result = BenchResult(command=["weaver", "bench", "compare",
                                  *(str(DEPLOYMENTS / f"{n}.yaml")
                                    for n in ("dedicated", "muxserve"))],
                         created_at="t", machine={}, runs=runs)
    results_file = tmp_path / "measured.json"
    results_file.write_text(result.model_dump_json())
    slower = smollm2_profile
    slower.decode_s = [[2 * t for t in row] for row in slower.decode_s]
    slower_path = tmp_path / "two_threads.json"
    slower.save(slower_path)

    def validate(*profiles):
        args = build_parser().parse_args(["simulate", "--validate", str(results_file),
                                          "--out", str(tmp_path), *profiles])
        return args.handler(args)

    assert validate("--profile", cpu_profile, "--profile", f"muxserve:hot={slower_path}") == 0
    report = json.loads((tmp_path / "validate_measured.json").read_text())
    assert report["label_profiles"] == {"muxserve": {"hot": str(slower_path)}}
    ratios = {(r["label"], c["model"], c["metric"]): c["ratio"]
              for r in report["runs"] for c in r["comparisons"]}
    # Only the muxed hot model was replayed with the slower profile.
    assert ratios[("muxserve", "hot", "mean_tpot_s")] > 1.3
    assert ratios[("dedicated", "hot", "mean_tpot_s")] == pytest.approx(1.0)
    capsys.readouterr()
    assert validate("--profile", cpu_profile, "--profile", f"nope:hot={slower_path}") == 2
    assert validate("--profile", cpu_profile, "--profile", f"muxserve:x={slower_path}") == 2


def test_validate_without_profile_exits_2(tmp_path):
    result = BenchResult(command=[], created_at="t", machine={}, runs=[])
    path = tmp_path / "r.json"
    path.write_text(result.model_dump_json())
    args = build_parser().parse_args(["simulate", "--validate", str(path)])
    assert args.handler(args) == 2


def test_a_phase_split_becomes_splitwise_prompt_and_token_instances(cpu_profile):
    deployment = load_deployment(DEPLOYMENTS / "splitwise.yaml")
    requests = [TraceRequest(0.2 * i, 120, 30, "chat", i) for i in range(8)]
    config = sim_config_from_deployment(deployment, {"chat": cpu_profile}, requests)
    assert config.policy == "splitwise" and config.splitwise.first_token == "token"
    assert [m.name for m in config.models] == ["chat"]
    assert [(g.models, g.role) for g in config.placement.gpus] == [(["chat"], "prompt"),
                                                                   (["chat"], "token")]
    split = simulate(config, requests=requests, keep_requests=True)["requests"]
    # The first token comes from the token instance, after the prefill and the transfer.
    paper = simulate(config.model_copy(update={"splitwise": config.splitwise.model_copy(
        update={"first_token": "prompt"})}), requests=requests, keep_requests=True)["requests"]
    assert all(r["e2e_s"] is not None for r in split)
    assert all(s["ttft_s"] > p["ttft_s"] for s, p in zip(split, paper, strict=True))
    # ... which computes the prompt's last token: one more token of work per request.
    assert all(s["e2e_s"] >= p["e2e_s"] for s, p in zip(split, paper, strict=True))
    single = sim_config_from_deployment(load_deployment(DEPLOYMENTS / "single_dedicated.yaml"),
                                        {"chat": cpu_profile}, requests)
    assert single.policy == "dedicated" and single.cluster.num_gpus == 1


def test_a_hot_model_over_two_colds_becomes_two_pairs_of_one_hot_gpu(cpu_profile):
    data = load_deployment(DEPLOYMENTS / "weaving.yaml").model_dump()
    cold2 = {**next(m for m in data["models"] if m["name"] == "cold"), "name": "cold2"}
    data["models"].append(cold2)
    data["weaving"][0]["cold"] = ["cold", "cold2"]
    profiles = {"hot": cpu_profile, "cold": cpu_profile, "cold2": cpu_profile}
    config = sim_config_from_deployment(parse_deployment(data), profiles, _requests())
    assert [(p.hot_gpu, p.cold_gpu) for p in config.placement.pairs] == [(0, 1), (0, 2)]
    result = simulate(config, requests=_requests())
    hot = [r for r in result["requests"] if r["model"] == "hot"]
    assert all(r["e2e_s"] is not None for r in result["requests"])
    assert 0.5 <= sum(r["is_remote"] for r in hot) / len(hot) <= 0.8


def test_two_hots_share_their_colds_loan_pool_by_demand(cpu_profile):
    """`hot-a` busy, `hot-b` with one request: in the loan pool (no unified_kv) hot-a may
    hold the whole loan but one sequence of hot-b's, where a fixed, equal region stops it
    at half (as on CUDA, or with a hot model in two loan pools)."""
    deployment = load_deployment(DEPLOYMENTS / "two_hots" / "weaving_loan_pool.yaml")
    hot_a = [TraceRequest(0.05 * i, 200, 60, "hot-a", i) for i in range(40)]
    requests = sorted([*hot_a, TraceRequest(0.5, 200, 60, "hot-b", 100),
                       TraceRequest(1.0, 150, 40, "cold", 200)], key=lambda r: r.arrival_s)
    config = sim_config_from_deployment(deployment, {m: cpu_profile
                                                     for m in ("hot-a", "hot-b", "cold")},
                                        requests)
    # 96 SmolLM2 blocks lent; each hot model's bound keeps 16 (one 512-token sequence) for
    # the other.
    assert [(p.remote_blocks, p.loan_quota_blocks) for p in config.placement.pairs] == [
        (96, 80), (96, 80)]
    pairs = [p.model_copy(update={"offload_ratio": 1.0}) for p in config.placement.pairs]
    shared = config.model_copy(update={"placement": config.placement.model_copy(
        update={"pairs": pairs})})
    regions = config.model_copy(update={"placement": config.placement.model_copy(update={
        "pairs": [p.model_copy(update={"remote_blocks": 48, "loan_quota_blocks": None})
                  for p in pairs]})})
    peak = {label: simulate(cfg, requests=requests)["lent_kv"]["hot-a"][0]["peak_blocks"]
            for label, cfg in (("shared", shared), ("regions", regions))}
    print(f"hot-a peak remote blocks: {peak}")
    assert peak["regions"] <= 48 < peak["shared"] <= 80
