"""benchmarks/cold_budget.py: the cold model's mean TPOT weaving over dedicated, per seed,
against the weaving deployment's budget; a seed whose runs had errors is not judged."""

from __future__ import annotations

import json

import pytest
from bench_scripts import load_benchmark

from weaver.results.metrics import summarize
from weaver.results.records import (
    RequestRecord,
    RequestStatus,
    RunResult,
    new_result,
    save_result,
)

WEAVING = """
models:
  - {name: hot-a, role: hot, model: smollm2-135m-instruct}
  - {name: hot-b, role: hot, model: smollm2-135m-instruct}
  - {name: hot-c, role: hot, model: smollm2-135m-instruct}
  - {name: cold, role: cold, model: smollm2-135m-instruct, lend_kv_gib: 0.1}
  - {name: other, role: cold, model: smollm2-135m-instruct, lend_kv_gib: 0.1}
weaving:
  - {hot: hot-a, cold: [cold], offload_ratio: auto, cold_tpot_budget: 1.20}
  - {hot: hot-b, cold: [cold], offload_ratio: auto, cold_tpot_budget: 1.10}
  - {hot: hot-c, cold: [other], offload_ratio: auto, cold_tpot_budget: 1.01}
"""


@pytest.fixture(scope="module")
def script():
    return load_benchmark("cold_budget")


def _run(label: str, seed: int, cold_tpot_s: float, errors: int = 0) -> RunResult:
    records = [RequestRecord(
        request_id=i, model="cold" if i % 2 else "hot-a", input_tokens=4, output_tokens=11,
        scheduled_at_s=float(i), sent_at_s=float(i), ttft_s=0.1,
        e2e_s=0.1 + 10 * (cold_tpot_s if i % 2 else 0.2), num_output_tokens=11,
        status=RequestStatus.ERROR if i < errors else RequestStatus.OK,
        error="engine dead" if i < errors else None) for i in range(20)]
    scraped = {'weaver_remote_kv_blocks_used{cold="cold",hot="hot-a"}': [(1.0, 3.0), (2.0, 9.0)],
               # the cold side's reading; 1.30 after the cold's last request is left out
               'weaver_weaving_cold_tpot_factor{cold="cold",hot="hot-a"}': [
                   (2.0, 1.05), (4.0, 1.12), (6.0, 1.07), (8.0, 1.08), (99.0, 1.30)]}
    return RunResult(label=label, base_url="http://x", rate=1.0, started_at="", duration_s=30,
                     workload={"seed": seed}, loadgen={}, records=records,
                     summary=summarize(records, 30.0),
                     scraped=scraped if label == "weaving" else {})


def _seed(tmp_path, seed: int, factor: float, errors: int = 0) -> str:
    (tmp_path / "weaving.yaml").write_text(WEAVING)
    result = new_result(["weaver", "bench", "compare", "dedicated.yaml",
                         str(tmp_path / "weaving.yaml")])
    result.runs = [_run("dedicated", seed, 0.080, errors), _run("weaving", seed, 0.080 * factor)]
    return str(save_result(result, tmp_path / f"seed{seed}.json"))


def test_each_seed_within_the_smallest_budget_into_the_cold_passes(script, tmp_path, capsys):
    paths = [_seed(tmp_path, 0, 1.05), _seed(tmp_path, 1, 1.08)]
    out = tmp_path / "report.json"
    assert script.main([*paths, "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert next(iter(report)) == "verdict" and report["budget"] == 1.10  # hot-b's, not 1.20
    assert report["verdict"].startswith("pass: ") and "2 of 2 seeds (x1.050-x1.080" in \
        report["verdict"]
    assert report["seeds"][1]["peak_remote_blocks"] == {
        'weaver_remote_kv_blocks_used{cold="cold",hot="hot-a"}': 9.0}
    assert out.with_suffix(".png").is_file()
    reading = report["seeds"][0]["cold_reading"][
        'weaver_weaving_cold_tpot_factor{cold="cold",hot="hot-a"}']
    assert reading["mean"] == pytest.approx(1.08) and reading["share_over_budget"] == 0.25
    assert "own reading (what `auto` holds to the budget): mean x1.080-x1.080, over the " \
        "budget in 25%-25% of the samples" in report["verdict"]
    assert "seed 1: 80.0 -> 86.4 ms, x1.080" in capsys.readouterr().out


def test_one_seed_over_fails_and_a_disturbed_one_is_left_out(script, tmp_path):
    paths = [_seed(tmp_path, 0, 1.05), _seed(tmp_path, 1, 1.15),
             _seed(tmp_path, 2, 0.70, errors=3)]
    out = tmp_path / "report.json"
    script.main([*paths, "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["verdict"].startswith("fail: ") and "1 of 2 seeds" in report["verdict"]
    assert "1 seed(s) disturbed, not judged" in report["verdict"]
    assert report["seeds"][2]["errors"] == {"dedicated": 3, "weaving": 0}
    assert report["seeds"][2]["disturbed"] == "errors"


def test_a_dedicated_baseline_that_drifted_more_than_the_budget_is_not_judged(script, tmp_path):
    """A dedicated run after the weaving one: the factor is over their mean, and a seed
    whose two drifted apart by more than the budget's growth says nothing of it."""
    (tmp_path / "weaving.yaml").write_text(WEAVING)
    result = new_result(["weaver", "bench", "compare", "dedicated.yaml",
                         str(tmp_path / "weaving.yaml")])
    result.runs = [_run("dedicated", 0, 0.080), _run("weaving", 0, 0.090),
                   _run("dedicated_after", 0, 0.100)]
    path = str(save_result(result, tmp_path / "aba.json"))
    out = tmp_path / "report.json"
    script.main([path, "--out", str(out)])
    row = json.loads(out.read_text())["seeds"][0]
    assert row["factor"] == pytest.approx(1.0) and row["dedicated_drift"] == pytest.approx(1.25)
    assert row["disturbed"] == "drift" and not row["judged"]


def test_a_deployment_without_a_pair_into_the_cold_is_refused(script, tmp_path):
    path = _seed(tmp_path, 0, 1.0)
    with pytest.raises(SystemExit, match="no weaving pair into 'nobody'"):
        script.main([path, "--cold", "nobody", "--out", str(tmp_path / "r.json")])


CYCLE_S, ON_S = 20.0, 10.0  # the hots send for 10 s of every 20


def _phased_run(label: str, interference: float, weaving_cost: float,
                quiet_cycles: int = 4) -> RunResult:
    """A phased run: the hots busy for the first 10 s of each 20-s cycle, the cold steady.
    A cold token's gap is 0.1 s, times `interference` while the hots are busy, times
    `weaving_cost` too while they hold lent KV (from 2 s into their phase: the gaps before
    are neither loaded nor quiet), times a slow drift of the machine over the run. After
    `quiet_cycles` cycles the hots of the weaving run hold lent KV through their off phases
    too (their queue no longer drains)."""
    weaving = label == "weaving"

    def gap_at(t: float) -> float:
        into = t % CYCLE_S
        scale = interference if into < ON_S else 1.0
        if weaving and 2.0 <= into < ON_S:
            scale *= weaving_cost
        return 0.1 * scale * (1 + t / 2000)  # drifts 3 % a minute, steadily

    records = []
    for i in range(80):  # one cold request a second, 10 output tokens each
        sent, gaps = float(i), []
        t = sent + 0.05
        for _ in range(9):
            gaps.append(gap_at(t))
            t += gaps[-1]
        records.append(RequestRecord(
            request_id=i, model="cold", input_tokens=4, output_tokens=10, scheduled_at_s=sent,
            sent_at_s=sent, ttft_s=0.05, e2e_s=t - sent, itl_s=gaps, num_output_tokens=10,
            status=RequestStatus.OK))
    records += [RequestRecord(
        request_id=100 + k, model="hot-a", input_tokens=4, output_tokens=10,
        scheduled_at_s=k * CYCLE_S, sent_at_s=k * CYCLE_S, ttft_s=0.1, e2e_s=ON_S,
        num_output_tokens=10, status=RequestStatus.OK) for k in range(4)]
    lent = [(t / 2, 5.0 if 2.0 <= (t / 2) % CYCLE_S < ON_S or t / 2 >= quiet_cycles * CYCLE_S
             else 0.0) for t in range(170)]
    return RunResult(label=label, base_url="http://x", rate=1.0, started_at="", duration_s=85,
                     workload={"seed": 0, "model_phases": {"hot-a": [ON_S, CYCLE_S - ON_S]}},
                     loadgen={}, records=records, summary=summarize(records, 85.0),
                     scraped={'weaver_remote_kv_blocks_used{cold="cold",hot="hot-a"}': lent}
                     if weaving else {})


def test_a_phased_seed_is_judged_within_each_run(script, tmp_path, capsys):
    """Weaving's cost is the weaving run's loaded/quiet over the dedicated run's (what the
    hots' load costs the cold without weaving), each compared within its own cycles, so
    the machine's drift over the run does not enter (nor a steady one within a cycle: the
    loaded gaps are held against the quiet ones before and after them)."""
    (tmp_path / "weaving.yaml").write_text(WEAVING)
    result = new_result(["weaver", "bench", "compare", "dedicated.yaml",
                         str(tmp_path / "weaving.yaml")])
    result.runs = [_phased_run("dedicated", 1.03, 1.0), _phased_run("weaving", 1.03, 1.06)]
    path = str(save_result(result, tmp_path / "phased.json"))
    out = tmp_path / "report.json"
    script.main([path, "--out", str(out)])
    report = json.loads(out.read_text())
    row = report["seeds"][0]
    assert row["cycle_s"] == CYCLE_S and row["judged"]
    assert row["dedicated_within_run"][0]["loaded_over_quiet"] == pytest.approx(1.03, abs=0.01)
    assert row["weaving_within_run"]["loaded_over_quiet"] == pytest.approx(1.03 * 1.06, abs=0.01)
    assert row["factor"] == pytest.approx(1.06, abs=0.01)
    assert len(row["weaving_within_run"]["per_cycle"]) == 4
    low, high = row["factor_90pct"]  # the four cycles drawn again
    assert low <= row["factor"] <= high and high - low < 0.03
    assert report["verdict"].startswith("pass: the cold's time per token with the hots' load")
    assert "weaving's cost x1.06" in capsys.readouterr().out

    result.runs = [_phased_run("dedicated", 1.03, 1.0), _phased_run("weaving", 1.03, 1.15)]
    script.main([str(save_result(result, tmp_path / "over.json")), "--out", str(out)])
    assert json.loads(out.read_text())["verdict"].startswith("fail: ")

    sequential = _seed(tmp_path, 1, 1.05)
    with pytest.raises(SystemExit, match="phased seeds .* or sequential ones, not both"):
        script.main([path, sequential, "--out", str(out)])


def test_a_phased_seed_whose_hots_never_go_quiet_is_not_judged(script, tmp_path):
    """Weaving slowed the hots so much that their queue no longer drained between phases:
    the weaving run holds loaded gaps against quiet ones in one cycle or two only, which is
    no baseline of its own; the seed is reported, not judged."""
    (tmp_path / "weaving.yaml").write_text(WEAVING)
    result = new_result(["weaver", "bench", "compare", "dedicated.yaml",
                         str(tmp_path / "weaving.yaml")])
    result.runs = [_phased_run("dedicated", 1.03, 1.0),
                   _phased_run("weaving", 1.03, 0.8, quiet_cycles=1)]
    out = tmp_path / "report.json"
    script.main([str(save_result(result, tmp_path / "never_quiet.json")), "--out", str(out)])
    report = json.loads(out.read_text())
    (row,) = report["seeds"]
    assert not row["judged"] and len(row["weaving_within_run"]["per_cycle"]) == 2
    assert "hots were hardly ever quiet" in row["disturbed"] and "weaving: 2 cycle(s)" in \
        row["disturbed"]
    assert report["verdict"].startswith("no verdict")


def _cycle(loaded_gap: float, quiet_gap: float, num: int = 10):
    """One cycle's gap sums at one cold concurrency: `num` loaded and `num` quiet gaps."""
    return {(1, "loaded"): (num * loaded_gap, num), (1, "quiet"): (num * quiet_gap, num)}


def test_phased_seeds_are_judged_by_their_cycles_pooled(script):
    """The rule fixed before the runs: pass when 95 % of the pooled resamples are within
    the budget, fail when the pooled cost is over it, "not shown" in between."""
    dedicated = [[_cycle(1.03, 1.0)] * 4]
    steady = ([_cycle(1.03 * 1.05, 1.0)] * 5, dedicated)
    pooled = script.pooled_factor([steady, steady])
    assert pooled["factor"] == pytest.approx(1.05) and pooled["num_seeds"] == 2
    assert pooled["num_weaving_cycles"] == 10
    assert pooled["factor_90pct"] == pytest.approx([1.05, 1.05])  # no spread to draw
    assert script.pooled_word(pooled, 1.10) == "pass"
    # Cycles that swing x0.98-x1.16: the pooled point x1.07 is within x1.10, but resamples
    # reach over it: not shown; more seeds like them narrow the interval under it.
    swinging = ([_cycle(1.03 * 0.98, 1.0), _cycle(1.03 * 1.16, 1.0)] * 2
                + [_cycle(1.03 * 1.07, 1.0)], dedicated)
    pooled = script.pooled_factor([swinging, swinging])
    assert pooled["factor"] == pytest.approx(1.07)
    low, high = pooled["factor_90pct"]
    assert low < 1.07 < 1.10 < high and script.pooled_word(pooled, 1.10) == "not shown"
    many = script.pooled_factor([swinging] * 40)
    assert many["factor_90pct"][1] < 1.10 and script.pooled_word(many, 1.10) == "pass"
    over = script.pooled_factor([([_cycle(1.03 * 1.12, 1.0)] * 5, dedicated)])
    assert script.pooled_word(over, 1.10) == "fail"
    assert script.pooled_factor([([{(1, "loaded"): (1.0, 10)}], dedicated)]) is None
