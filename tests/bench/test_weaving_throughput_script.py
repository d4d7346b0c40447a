"""The pure parts of benchmarks/weaving_throughput.py: deployment files and the summary
over interleaved rounds (the benchmark itself runs engines for ~7 minutes a round)."""

from __future__ import annotations

import json

import pytest
import yaml
from bench_scripts import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("weaving_throughput")


def _run(label: str, round_index: int, tok_s: float, tpot_s: float) -> dict:
    return {"label": label, "round": round_index, "hot_throughput_tok_s": tok_s,
            "cold_tpot_mean_s": tpot_s}


def test_summary_per_round_and_over_medians(bench):
    runs = [_run("dedicated", 1, 50.0, 0.100), _run("weaving", 1, 90.0, 0.105),
            _run("upper-bound", 1, 100.0, 0.100),
            _run("dedicated", 2, 60.0, 0.110), _run("weaving", 2, 90.0, 0.110),
            _run("upper-bound", 2, 96.0, 0.100),
            _run("dedicated", 3, 55.0, 0.090), _run("weaving", 3, 100.0, 0.100),
            _run("upper-bound", 3, 110.0, 0.120)]
    summary = bench.summarize_rounds(runs)
    first = summary["rounds"][0]
    assert first["weaving_gain"] == pytest.approx(0.8)
    assert first["ratio_of_gains"] == pytest.approx(0.8)
    assert first["cold_tpot_ratio"] == pytest.approx(1.05)
    assert summary["median_hot_tok_s"] == {"dedicated": 55.0, "weaving": 90.0,
                                           "upper-bound": 100.0}
    assert summary["weaving_gain_over_upper_bound_gain"] == pytest.approx(
        (90 / 55 - 1) / (100 / 55 - 1))
    assert summary["cold_tpot_weaving_over_dedicated"] == pytest.approx(0.105 / 0.100)


def test_only_the_weaving_deployment_lends_and_splits(bench, tmp_path):
    docs = {label: yaml.safe_load(bench.deployment_yaml(label, tmp_path, 99, 189, 0.66,
                                                        {"lm_head": 16}))
            for label in bench.DEPLOYMENTS}
    cold = {label: doc["models"][1] for label, doc in docs.items()}
    assert cold["weaving"]["split"] == {"lm_head": 16} and cold["weaving"]["lend_kv_gib"] > 0
    assert "split" not in cold["dedicated"] and "split" not in cold["upper-bound"]
    hot_blocks = {label: doc["models"][0]["num_gpu_blocks_override"]
                  for label, doc in docs.items()}
    assert hot_blocks == {"dedicated": 100, "weaving": 100, "upper-bound": 289}
    assert docs["weaving"]["weaving"][0]["offload_ratio"] == 0.66


def test_pooled_estimators_use_every_unweaved_cold_run(bench):
    runs = [_run("dedicated", 1, 50.0, 0.100), _run("weaving", 1, 90.0, 0.110),
            _run("upper-bound", 1, 100.0, 0.080),
            _run("dedicated", 2, 60.0, 0.120), _run("weaving", 2, 66.0, 0.130),
            _run("upper-bound", 2, 63.0, 0.100)]
    summary = bench.summarize_rounds(runs)
    # Round 2's upper bound gained 5 %: its ratio of gains (2.0) dominates a per-round view.
    assert [r["ratio_of_gains"] for r in summary["rounds"]] == [
        pytest.approx(0.8), pytest.approx(2.0)]
    assert summary["median_of_round_ratios_of_gains"] == pytest.approx(1.4)
    assert summary["mean_hot_tok_s"] == {"dedicated": 55.0, "weaving": 78.0,
                                         "upper-bound": 81.5}
    assert summary["ratio_of_gains_of_means"] == pytest.approx((78 / 55 - 1) / (81.5 / 55 - 1))
    assert summary["median_of_round_cold_tpot_ratios"] == pytest.approx(
        (1.1 + 0.13 / 0.12) / 2)
    assert summary["cold_tpot_weaving_over_unweaved_mean"] == pytest.approx(0.12 / 0.1)


def test_hot_capacity_counts_requests_at_full_length(bench):
    args = bench.argparse.Namespace(hot_input=32, hot_output=256, local_blocks=144,
                                    remote_blocks=72)
    # 288 tokens = 9 blocks of 32: 16 local, 8 remote
    assert bench.hot_capacity(args) == {"dedicated": 16, "weaving": 24, "upper-bound": 24}
    args.hot_output = 257  # one token more needs a tenth block
    assert bench.hot_capacity(args) == {"dedicated": 14, "weaving": 21, "upper-bound": 21}


def test_the_pair_under_vllm_serve_gets_the_weaving_deployments_engines(bench, tmp_path):
    """weaving-vllm must measure the same engines as weaving, launched the other way."""
    pytest.importorskip("vllm")
    from weaver.config.deployment import parse_deployment
    from weaver.vllm_ext.engine.app import parse_engine_args
    from weaver.vllm_ext.engine.flags import parse_serve_args
    from weaver.weaving.plan import attention_shape_of, plugin_hot_plan

    deployment = parse_deployment(yaml.safe_load(bench.deployment_yaml(
        "weaving", tmp_path, 99, 189, 0.66, {"lm_head": 16})), "weaving")
    compared = ("max_model_len", "dtype", "max_num_seqs", "kv_cache_memory_bytes",
                "num_gpu_blocks_override", "block_size", "enforce_eager", "served_model_name")
    for side in ("hot", "cold"):
        flags = bench.vllm_serve_args(side, 99, 189, 0.66, {"lm_head": 16})
        plain = parse_serve_args(["--model", str(tmp_path), *flags])
        weaver = parse_engine_args(deployment.model(side), tmp_path)
        assert {k: getattr(plain, k) for k in compared} == \
            {k: getattr(weaver, k) for k in compared}
    hot_block = json.loads(bench.vllm_serve_args("hot", 99, 189, 0.66, None)[-1])["weaver"]
    shape = attention_shape_of({"num_attention_heads": 9, "num_key_value_heads": 3,
                                "hidden_size": 576, "num_hidden_layers": 30}, "float32", 32)
    plan = plugin_hot_plan("hot", "bench", shape, hot_block["remote_kv_gib"], 1024, 64,
                           {"offload_ratio": 0.66, "timeout_s": 3.0}, "shm")
    assert plan.num_remote_blocks == 189  # exactly the lent blocks, as under weaver serve
    cold_block = json.loads(bench.vllm_serve_args("cold", 99, 189, 0.66, {"lm_head": 16})[-1])
    assert cold_block["weaver"]["split"] == {"lm_head": 16}


def test_the_vllm_serve_pair_has_its_own_gains_and_is_not_an_unweaved_run(bench):
    runs = [_run("dedicated", 1, 50.0, 0.100), _run("weaving", 1, 90.0, 0.105),
            _run("upper-bound", 1, 100.0, 0.100), _run("weaving-vllm", 1, 85.0, 0.5)]
    summary = bench.summarize_rounds(runs)
    assert summary["vllm_serve_pair"]["weaving_gain"] == pytest.approx(0.7)
    assert summary["vllm_serve_pair"]["ratio_of_gains"] == pytest.approx(0.7)
    assert summary["weaving_gain_over_upper_bound_gain"] == pytest.approx(0.8)
    assert summary["cold_tpot_weaving_over_unweaved_mean"] == pytest.approx(1.05)
