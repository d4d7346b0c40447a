"""The goodput search (weaver/bench/goodput_search.py): bracketing and bisection, the
overload check, interleaving, ratios and the results file with injected fake runs; then
the known capacity of a fake server in virtual time, and `weaver bench goodput` end to end
against real fake servers."""

from __future__ import annotations

import argparse
import json
import math

import pytest
from bench_fake_server import FakeBehavior

from weaver.bench.goodput_search import (
    Point,
    SearchConfig,
    goodput_grid,
    judge_run,
    neighbour_tpot_ratios,
    next_rate,
    regrade,
    search_goodput,
    write_report,
)
from weaver.cli import bench
from weaver.results.goodput import Slo
from weaver.results.records import RequestRecord, RequestStatus, RunResult, load_result

SLO = Slo(ttft_s=0.5)
NUM = 20  # requests per fake run: attainment comes in steps of 5 %


def _config(**kw) -> SearchConfig:
    kw.setdefault("slo", SLO)
    kw.setdefault("num_requests", NUM)
    kw.setdefault("warmup_requests", 0)
    kw.setdefault("salt_base", 0)
    return SearchConfig(**kw)


def _run(label: str, rate: float, ttfts: list[float | None],
         statuses: list[RequestStatus] | None = None) -> RunResult:
    """A run whose request i arrived at i / rate with TTFT ttfts[i] (None: an error)."""
    records = []
    for i, ttft in enumerate(ttfts):
        ok_or_error = RequestStatus.OK if ttft is not None else RequestStatus.ERROR
        status = statuses[i] if statuses else ok_or_error
        done = status is RequestStatus.OK
        records.append(RequestRecord(
            request_id=i, model="m", input_tokens=4, output_tokens=2, scheduled_at_s=i / rate,
            sent_at_s=i / rate, ttft_s=ttft, e2e_s=ttft + 0.01 if done else None,
            num_output_tokens=2 if done else 0, status=status,
        ))
    return RunResult(label=label, base_url="http://fake", rate=rate, started_at="", duration_s=1.0,
                     workload={}, loadgen={}, records=records, summary={})


def _attaining(label: str, rate: float, share: float) -> RunResult:
    """A steady run (flat TTFT) in which `share` of the requests met the SLO, the misses
    spread evenly (errors)."""
    misses = round((1 - share) * NUM)
    missed = {i * NUM // misses for i in range(misses)} if misses else set()
    return _run(label, rate, [None if i in missed else 0.01 for i in range(NUM)])


class StepRunner:
    """Deployment `label` passes at rates <= capacity[label] (per seed: capacity may be a
    {seed: capacity} dict) and gets half its requests through above; records the calls."""

    def __init__(self, capacity: dict) -> None:
        self.capacity = capacity
        self.calls: list[tuple[str, float, int, int]] = []

    def __call__(self, label: str, rate: float, seed: int, salt: int,
                 num_requests: int = NUM) -> RunResult:
        self.calls.append((label, rate, seed, salt))
        cap = self.capacity[label]
        cap = cap[seed] if isinstance(cap, dict) else cap
        return _attaining(label, rate, 1.0 if rate <= cap else 0.5)


def _search(runner, labels, **kw):
    return search_goodput(labels, runner, _config(**kw), show_progress=False)


@pytest.mark.parametrize("capacity", [3.3, 0.3, 17.0])
def test_bracketing_and_bisection_converge_on_a_step(capacity):
    outcome = _search(StepRunner({"a": capacity}), ["a"], seeds=(0,), start_rate=1.0,
                      min_rate=0.125, max_rate=64.0, rel_tolerance=0.05, max_points=20)
    goodput = outcome.goodput("a")
    assert capacity * 0.95 <= goodput <= capacity
    rates = [p.rate for p in outcome.points]
    if capacity > 1:  # doubled up to the first failure, then bisected inside the bracket
        assert rates[:3] == [1.0, 2.0, 4.0]
    else:  # halved down to the first pass
        assert rates[:3] == [1.0, 0.5, 0.25]
    low = max(p.rate for p in outcome.points if p.passed)
    high = min(p.rate for p in outcome.points if not p.passed)
    assert (high - low) / high <= 0.05 and low == goodput
    assert len(set(rates)) == len(rates)  # no rate tested twice
    assert outcome.complete and not outcome.verdict().startswith("search incomplete")


def test_search_stops_at_the_rate_bounds_and_at_max_points():
    capped = _search(StepRunner({"a": 1000.0}), ["a"], seeds=(0,), max_rate=8.0)
    assert [p.rate for p in capped.points] == [1.0, 2.0, 4.0, 8.0]
    assert capped.goodput("a") == 8.0 and capped.capped("a")
    assert ">= 8 req/s" in capped.verdict()
    floor = _search(StepRunner({"a": 0.01}), ["a"], seeds=(0,), min_rate=0.25)
    assert [p.rate for p in floor.points] == [1.0, 0.5, 0.25]
    assert floor.goodput("a") == 0.0 and "0 req/s (fails at 0.25" in floor.verdict()
    bounded = _search(StepRunner({"a": 3.3}), ["a"], seeds=(0,), max_points=4)
    assert len(bounded.points) == 4


def test_next_rate_bisects_between_highest_pass_and_lowest_fail():
    config = _config(seeds=(0,), rel_tolerance=0.05)

    def point(rate: float, share: float) -> Point:
        return Point("a", rate, [judge_run(_attaining("a", rate, share), 0, config)], [0])

    assert next_rate([], config) == config.start_rate
    assert next_rate([point(1, 1.0), point(2, 1.0), point(4, 0.5)], config) == 3.0
    # A pass above the lowest failure (noise) does not move the bracket's bottom above it.
    assert next_rate([point(1, 1.0), point(2, 0.5), point(3, 1.0)], config) == 1.5
    assert next_rate([point(2, 1.0), point(2.05, 0.5)], config) is None  # within 5 %


def test_runs_interleave_seed_major_with_shared_salts():
    runner = StepRunner({"a": 100.0, "b": 1.5})
    outcome = _search(runner, ["a", "b"], seeds=(0, 1, 2), max_rate=4.0)
    first_round = [(label, rate, seed) for label, rate, seed, _ in runner.calls[:6]]
    assert first_round == [("a", 1.0, 0), ("b", 1.0, 0), ("a", 1.0, 1), ("b", 1.0, 1),
                           ("a", 1.0, 2), ("b", 1.0, 2)]
    salts: dict[tuple[float, int], set[int]] = {}
    for _, rate, seed, salt in runner.calls:
        salts.setdefault((rate, seed), set()).add(salt)
    # The same (rate, seed) gets the same prompts on every deployment, and no run repeats
    # another's prompts on the same deployment.
    assert all(len(s) == 1 for s in salts.values())
    assert len({next(iter(s)) for s in salts.values()}) == len(salts)
    # a's search ends before b's: later rounds run b alone, still seed-major.
    a_calls = [i for i, call in enumerate(runner.calls) if call[0] == "a"]
    rest = runner.calls[a_calls[-1] + 1 :]
    assert rest[0][0::2] == ("b", 2)  # the end of a's last round
    tail = rest[1:]
    assert tail and {c[0] for c in tail} == {"b"}
    assert [c[2] for c in tail] == [0, 1, 2] * (len(tail) // 3)
    assert len(outcome.runs) == len(runner.calls)


def test_overloaded_run_fails_even_at_full_attainment():
    config = _config(seeds=(0,))
    growing = _run("a", 10.0, [0.01 + 0.02 * i for i in range(NUM)])  # 10 ms .. 390 ms
    verdict = judge_run(growing, 0, config)
    assert verdict.attainment == 1.0 and verdict.overloaded
    assert "median TTFT grew" in verdict.overload
    point = Point("a", 10.0, [verdict], [0])
    assert not point.passed and "not steady" in point.describe()

    # 10 % cut at the deadline: 90 % attainment would pass, but the run measured a drain.
    statuses = [RequestStatus.OK] * 18 + [RequestStatus.UNFINISHED, RequestStatus.NOT_SENT]
    cut = judge_run(_run("a", 10.0, [0.01] * 18 + [None, None], statuses), 0, config)
    assert cut.attainment == pytest.approx(0.9) and cut.overloaded
    assert "outstanding at the deadline" in cut.overload

    # Doubling on a millisecond TTFT is jitter, not a queue: below the absolute margin.
    jitter = judge_run(_run("a", 10.0, [0.01] * 10 + [0.04] * 10), 0, config)
    assert not jitter.overloaded and jitter.ttft_last_s == pytest.approx(0.04)

    # A queue rises through the run; long requests near its end raise the last third alone.
    # Thirds of 1.3, 0.9, 5.7 s and of 3.1, 0.9, 5.7 s (a compute-bound run's two
    # deployments at one rate) are both steady, whichever first third each drew.
    for first in (1.3, 3.1):
        end_burst = judge_run(_run("a", 1.0, [first] * 7 + [0.9] * 6 + [5.7] * 7), 0, config)
        assert not end_burst.overloaded, end_burst.overload
        assert end_burst.ttft_middle_s == pytest.approx(0.9)
    # The middle a quarter of the way up is a queue building.
    rising = judge_run(_run("a", 1.0, [0.2] * 7 + [0.7] * 6 + [1.8] * 7), 0, config)
    assert rising.overloaded and "through 700 ms" in rising.overload

    # The warm-up requests are left out of both the attainment and the thirds.
    warm = _config(seeds=(0,), warmup_requests=5)
    slow_start = judge_run(_run("a", 10.0, [None] * 5 + [0.01] * 15), 0, warm)
    assert slow_start.attainment == 1.0 and slow_start.num_measured == 15


def test_a_run_held_at_once_is_a_burst_not_a_steady_state():
    config = _config(seeds=(0,))
    # 20 arrivals over 1.9 s whose requests live 1 s each: all in flight nearly at once.
    held = _run("a", 10.0, [0.01] * NUM)
    for record in held.records:
        record.e2e_s = 1.0
    verdict = judge_run(held, 0, config)
    assert verdict.attainment == 1.0 and verdict.overloaded
    assert "a burst" in verdict.overload and "--min-span-s" in verdict.overload
    # The same requests living 0.5 s: their arrivals span 3.8 lifetimes, a steady state.
    for record in held.records:
        record.e2e_s = 0.5
    assert not judge_run(held, 0, config).overloaded


def test_a_point_failed_by_bursts_alone_is_run_again_longer():
    # Requests live 8 s at 1 req/s: 20 arrivals span 19 s (a burst, under 3 x 8 s), 40 span
    # 39 s (steady). Deployment "short" passes once its runs are long enough; "long" lives
    # 30 s and stays a burst at 80 requests, the last doubling allowed: it fails there.
    lifetimes = {"short": 8.0, "long": 30.0}
    calls = []

    def runner(label, rate, seed, salt, num_requests):
        calls.append((label, rate, num_requests, salt))
        run = _run(label, rate, [0.01] * num_requests)
        for record in run.records:
            record.e2e_s = lifetimes[label]
        return run

    config = _config(seeds=(0,), start_rate=1.0, max_rate=1.0, max_points=1,
                     max_span_doublings=2)
    outcome = search_goodput(["short", "long"], runner, config, show_progress=False)
    assert [(label, n) for label, _, n, _ in calls] == [
        ("short", 20), ("long", 20), ("short", 40), ("long", 40), ("long", 80)]
    assert outcome.goodput("short") == 1.0 and outcome.capped("short")
    assert outcome.goodput("long") == 0.0
    # Only the longest runs count; the shorter points are kept aside.
    assert [(p.label, len(p.verdicts)) for p in outcome.points] == [("short", 1), ("long", 1)]
    assert [p.label for p in outcome.remeasured] == ["short", "long", "long"]
    assert all(p.failed_by_bursts_alone for p in outcome.remeasured)
    # A longer run gets prompts of its own: the deployment served the shorter run's.
    salts = {n: salt for label, _, n, salt in calls if label == "long"}
    assert len(set(salts.values())) == 3
    report = outcome.to_json(["weaver"])
    assert len(report["remeasured_points"]) == 3
    # A drain is not a burst: a point whose TTFT grows is not run again.
    growing = Point("a", 1.0, [judge_run(_run("a", 1.0, [0.2] * 7 + [0.7] * 6 + [1.8] * 7),
                                         0, _config(seeds=(0,)))], [0])
    assert not growing.passed and not growing.failed_by_bursts_alone


def test_min_span_scales_a_fast_rates_requests():
    config = _config(num_requests=30, min_span_s=60.0)
    assert config.num_requests_at(0.2) == 30  # 12 arrivals in 60 s: --num-requests rules
    assert config.num_requests_at(1.6) == 96
    assert config.num_requests_at(1.61) == 97  # rounded up, never short of the span
    assert _config(num_requests=30).num_requests_at(4.0) == 30  # no span asked for
    assert config.num_requests_at(1.6, span_doublings=2) == 384  # a burst's longer runs
    with pytest.raises(ValueError, match="--min-span-s"):
        _config(min_span_s=-1.0)


def test_overloaded_search_points_fail_in_the_goodput():
    def runner(label, rate, seed, salt, num_requests):
        # Full attainment everywhere, but above 2 req/s the TTFT keeps growing.
        step = 0.02 if rate > 2 else 0.0
        return _run(label, rate, [0.01 + step * i for i in range(NUM)])

    outcome = _search(runner, ["a"], seeds=(0,), max_rate=8.0)
    assert all(p.mean == 1.0 for p in outcome.points)
    assert outcome.goodput("a") == 2.0


def test_ratios_seed_spread_and_results_file(tmp_path):
    # a: passes up to 2 req/s. b: up to 4 req/s, but seed 1 only reaches 85 % there.
    def runner(label, rate, seed, salt, num_requests):
        if label == "a":
            share = 1.0 if rate <= 2 else 0.5
        else:
            share = 0.5 if rate > 4 else (0.85 if seed == 1 and rate > 2 else 1.0)
        return _attaining(label, rate, share)

    saved = []
    path = tmp_path / "goodput.json"

    def on_point(outcome):
        saved.append(len(outcome.points))
        write_report(outcome.to_json(["weaver", "bench", "goodput"]), path)

    outcome = search_goodput(["a", "b"], runner, _config(seeds=(0, 1), rel_tolerance=0.5),
                             on_point=on_point, show_progress=False)
    assert [p.rate for p in outcome.points_of("a")] == [1.0, 2.0, 4.0]
    assert [p.rate for p in outcome.points_of("b")] == [1.0, 2.0, 4.0, 8.0]
    assert saved == list(range(1, 8))  # written after every point
    assert outcome.goodput("a") == 2.0 and outcome.goodput("b") == 4.0
    assert outcome.seed_goodputs("b") == {0: 4.0, 1: 2.0}
    ratio = outcome.ratios()["b"]
    assert ratio["pooled"] == 2.0 and ratio["per_seed"] == {"0": 2.0, "1": 1.0}
    assert (ratio["min"], ratio["max"]) == (1.0, 2.0)
    assert outcome.verdict().startswith("b: goodput 4 req/s = 2.00x a (seed range 1.00-2.00x)")

    write_report(outcome.to_json(["weaver", "bench", "goodput"]), path)
    report = json.loads(path.read_text())
    assert list(report)[:9] == ["verdict", "goodput", "ratios", "slo", "search", "points",
                                "remeasured_points", "command", "machine"]
    assert list(report)[-1] == "runs" and len(report["runs"]) == len(outcome.runs)
    assert path.read_text().startswith('{\n "verdict": "b: goodput 4 req/s')
    assert report["goodput"]["b"] == {"rate": 4.0, "per_seed": {"0": 4.0, "1": 2.0},
                                      "min": 2.0, "max": 4.0, "lower_bound": False,
                                      "num_points": 4}
    b_at_4 = next(p for p in report["points"] if p["label"] == "b" and p["rate"] == 4.0)
    assert b_at_4["attainment"] == [1.0, 0.85] and b_at_4["pass"]
    assert b_at_4["overloaded"] == [False, False]
    assert report["search"]["seeds"] == [0, 1] and report["slo"]["ttft_ms"] == 500
    # Every point's numbers come back from the runs it names.
    run = RunResult.model_validate(report["runs"][b_at_4["runs"][1]])
    assert judge_run(run, 1, outcome.config).attainment == 0.85
    # The file is also a bench results file (summary/plot read its runs).
    assert len(load_result(path).runs) == len(outcome.runs)


def test_a_search_judged_again_under_other_slos():
    """Each request's TTFT is rate / 10 s (flat within a run): TTFT <= 0.5 s holds up to
    5 req/s, <= 1 s up to 10; deployment b is half as fast. 200 requests a run, so that a
    run at 16 req/s spans more than 3 of its requests' 0.8 s lifetimes (a steady state)."""
    def runner(label: str, rate: float, seed: int, salt: int, num_requests: int) -> RunResult:
        return _run(label, rate, [rate / (10 if label == "a" else 20)] * 10 * NUM)

    outcome = search_goodput(["b", "a"], runner, _config(seeds=(0, 1), max_rate=16.0,
                                                          rel_tolerance=0.1),
                             show_progress=False)
    report = json.loads(json.dumps(outcome.to_json(["weaver", "bench", "goodput"])))
    same = regrade(report, SLO)
    assert [same.goodput(label) for label in ("a", "b")] == [outcome.goodput("a"),
                                                           outcome.goodput("b")]
    # Only the rates the search tested are there: at TTFT <= 0.7 s a passes up to 7 req/s
    # and b up to 14, so their goodputs are the highest tested rates below: 6 and 12.
    looser = regrade(report, Slo(ttft_s=0.7))
    assert (looser.goodput("a"), looser.goodput("b")) == (6.0, 12.0)
    assert not looser.capped("a") and not looser.capped("b")
    # At TTFT <= 1 s both pass at every rate tested: lower bounds.
    loosest = regrade(report, Slo(ttft_s=1.0))
    assert loosest.capped("a") and loosest.capped("b")
    grid = goodput_grid(report, [500, 1000], [1000])
    assert [cell["slo"] for cell in grid["grid"]] == [{"ttft_ms": 500, "tpot_ms": 1000},
                                                     {"ttft_ms": 1000, "tpot_ms": 1000}]
    assert grid["verdict"].startswith("over 2 SLOs") and "a: 0." in grid["verdict"]
    assert grid["table"][0].split()[-2:] == ["b", "a"]


def test_a_neighbours_tpot_is_compared_per_rate_pooled_over_seeds():
    """The cold model beside a judged hot one: its median TPOT under each deployment over
    the baseline's at the same rate, its requests pooled over the seeds."""
    def runner(label: str, rate: float, seed: int, salt: int, num_requests: int) -> RunResult:
        run = _run(label, rate, [0.01] * NUM)
        gap = {"base": 0.010, "woven": 0.011}[label] * (1 + seed)  # s per token
        cold = [RequestRecord(request_id=100 + i, model="cold", input_tokens=4,
                              output_tokens=5, scheduled_at_s=i / rate, sent_at_s=i / rate,
                              ttft_s=0.01, e2e_s=0.01 + 4 * gap, num_output_tokens=5,
                              status=RequestStatus.OK) for i in range(3)]
        return run.model_copy(update={"records": run.records + cold})

    outcome = search_goodput(["base", "woven"], runner,
                             _config(seeds=(0, 1), max_rate=2.0, judged_model="m"),
                             show_progress=False)
    report = json.loads(json.dumps(outcome.to_json(["weaver"])))
    ratios = neighbour_tpot_ratios(report, "cold")
    assert set(ratios) == {"woven"} and set(ratios["woven"]) == {"1.0", "2.0"}
    found = ratios["woven"]["1.0"]
    # Seeds 0 and 1 pooled: medians 0.0165 (of 0.011, 0.022) over 0.015 (0.010, 0.020).
    assert found["ratio"] == pytest.approx(1.1) and found["num_requests"] == 6
    assert found["seeds"] == [0, 1]


def test_a_cut_search_keeps_its_points(tmp_path):
    path = tmp_path / "cut.json"
    step = StepRunner({"a": 100.0})

    def runner(label, rate, seed, salt, num_requests):
        if rate > 2:
            raise KeyboardInterrupt  # the user stops the search
        return step(label, rate, seed, salt)

    with pytest.raises(KeyboardInterrupt):
        search_goodput(["a"], runner, _config(seeds=(0,)), show_progress=False,
                       on_point=lambda o: write_report(o.to_json([]), path))
    report = json.loads(path.read_text())
    assert report["verdict"].startswith("search incomplete (2 points)")
    assert [p["rate"] for p in report["points"]] == [1.0, 2.0]


@pytest.mark.parametrize(("kw", "message"), [
    ({"seeds": ()}, "at least one seed"),
    ({"seeds": (1, 1)}, "repeat"),
    ({"warmup_requests": NUM}, "--warmup-requests"),
    ({"start_rate": 0.01, "min_rate": 0.1}, "--min-rate <= --start-rate"),
    ({"rel_tolerance": 0.0}, "--rel-tolerance"),
    ({"max_points": 0}, "--max-points"),
    ({"drain_s": 0.0}, "--drain-s"),
])
def test_config_errors_say_the_fix(kw, message):
    with pytest.raises(ValueError, match=message):
        _config(**kw)


def test_config_defaults():
    config = SearchConfig(slo=SLO, num_requests=200)
    assert config.seeds == (0, 1, 2) and config.warmup_requests == 20
    assert config.salt_base and config.salt_base != SearchConfig(slo=SLO).salt_base


# Against a fake server of known capacity ------------------------------------------------


def _capacity(behavior: FakeBehavior, output_tokens: int) -> float:
    """Requests per second the slotted fake server completes."""
    assert behavior.num_slots is not None
    return behavior.num_slots / (behavior.ttft_s + (output_tokens - 1) * behavior.itl_s)


class VirtualTimeFakeServer:
    """A fake server of fixed service rate, in virtual time: `num_slots` requests served at
    once, first come first served, each taking `ttft_s` to its first token and `itl_s` to
    each next one. Its runs are computed, not timed: no socket and no sleep, so a loaded
    machine cannot move its capacity (the same search through the real load generator and
    an HTTP fake failed CI three times, its sleeps waking late). Like the load generator, a
    request not done by the last arrival + `drain_s` is cut at that deadline."""

    def __init__(self, behavior: FakeBehavior, output_tokens: int, drain_s: float) -> None:
        assert behavior.num_slots is not None
        self.behavior, self.output_tokens, self.drain_s = behavior, output_tokens, drain_s
        self.service_s = behavior.ttft_s + (output_tokens - 1) * behavior.itl_s

    def __call__(self, label: str, rate: float, seed: int, salt: int,
                 num_requests: int) -> RunResult:
        # Evenly spaced arrivals: the realised rate of a short Poisson run varies by ~10 %
        # from seed to seed, the workload's noise rather than the search's error.
        arrivals = [(i + 1) / rate for i in range(num_requests)]
        deadline = arrivals[-1] + self.drain_s
        free_at = [0.0] * self.behavior.num_slots  # when each slot is next free
        records = []
        for i, arrival in enumerate(arrivals):
            slot = min(range(len(free_at)), key=free_at.__getitem__)
            start = max(arrival, free_at[slot])
            free_at[slot] = start + self.service_s
            done = free_at[slot] <= deadline
            ttft = start - arrival + self.behavior.ttft_s
            records.append(RequestRecord(
                request_id=i, model="m", input_tokens=4, output_tokens=self.output_tokens,
                scheduled_at_s=arrival, sent_at_s=arrival,
                ttft_s=ttft if arrival + ttft <= deadline else None,
                e2e_s=free_at[slot] - arrival if done else None,
                num_output_tokens=self.output_tokens if done else 0,
                status=RequestStatus.OK if done else RequestStatus.UNFINISHED,
            ))
        return RunResult(label=label, base_url="virtual://fake", rate=rate, started_at="",
                         duration_s=deadline, workload={}, loadgen={}, records=records,
                         summary={})


@pytest.mark.parametrize(("slots", "start_factor"), [(8, 0.75), (2, 0.3), (16, 2.5)])
def test_search_finds_the_capacity_of_a_fake_server(slots, start_factor):
    behavior = FakeBehavior(ttft_s=0.12, itl_s=0.04, num_slots=slots)
    tokens = 3
    capacity = _capacity(behavior, tokens)  # slots / 0.2 s
    # Runs of >= 10 s of arrivals: 5 % above capacity, the queue grows by 0.5 s of work in
    # a run, past the TTFT target's 0.28 s of slack (a run of 120 requests at 1.17x the
    # capacity of 16 slots, 1.3 s, kept its queue under it and passed).
    config = SearchConfig(slo=Slo(ttft_s=0.4), seeds=(0, 1, 2), num_requests=120,
                          min_span_s=10.0, start_rate=start_factor * capacity,
                          min_rate=0.05 * capacity, max_rate=8 * capacity,
                          rel_tolerance=0.05, drain_s=1.0, salt_base=0)
    server = VirtualTimeFakeServer(behavior, tokens, config.drain_s)
    outcome = search_goodput(["fake"], server, config, show_progress=False)
    described = [p.describe() for p in outcome.points]
    assert 0.9 * capacity <= outcome.goodput("fake") <= 1.1 * capacity, (capacity, described)
    assert outcome.complete, described
    # Above capacity the queue showed: TTFT grew, or requests were cut at the deadline.
    failed = [p for p in outcome.points if not p.passed]
    assert failed and all(p.rate > capacity and p.overloaded for p in failed), described


def test_the_virtual_fake_queues_above_its_capacity():
    """The fake itself: no wait below capacity, a wait that grows with arrivals above it."""
    behavior = FakeBehavior(ttft_s=0.12, itl_s=0.04, num_slots=4)
    server = VirtualTimeFakeServer(behavior, 3, drain_s=100.0)
    below = server("fake", 19.0, 0, 0, 60).records  # capacity 20 req/s
    assert {round(r.ttft_s, 9) for r in below} == {0.12}
    above = server("fake", 25.0, 0, 0, 60).records
    waits = [round(r.ttft_s - 0.12, 9) for r in above]
    assert waits[0] == 0 and waits[-1] > 0.5 and waits == sorted(waits)


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="weaver")
    bench.register(parser.add_subparsers())
    args = parser.parse_args(argv)
    return args.handler(args)


def test_cli_goodput_of_two_fake_servers(fake_server, tmp_path, capsys, monkeypatch):
    # Service ~ the TTFT (tokens take 1 ms), so the capacity ratio is the slot ratio.
    small = FakeBehavior(ttft_s=0.05, itl_s=0.001, num_slots=2)
    large = FakeBehavior(ttft_s=0.05, itl_s=0.001, num_slots=4)
    ratio = _capacity(large, 4) / _capacity(small, 4)
    a, b = fake_server(small), fake_server(large)
    out = tmp_path / "goodput.json"
    argv = ["bench", "goodput", "--target", f"small={a.url}", "--target", f"large={b.url}",
            "--model", "m", "--length-scale", "0.01", "--max-model-len", "12",
            # Near-even gaps (gamma of shape 1000): see the capacity test.
            "--arrival", "gamma", "--burstiness", "1000", "--num-requests", "40",
            "--seeds", "0", "--start-rate", "35", "--max-rate", "200", "--rel-tolerance", "0.2",
            "--max-points", "5", "--drain-s", "0.5", "--ttft-slo-ms", "300",
            "--min-span-s", "0.5", "--no-progress", "--out", str(out)]
    monkeypatch.setattr("sys.argv", ["weaver", *argv])
    assert _main(argv) == 0
    printed = capsys.readouterr().out
    assert "large: goodput" in printed and "x small" in printed
    assert "small @ 35 req/s: attainment" in printed  # one line per point
    report = json.loads(out.read_text())
    assert next(iter(report)) == "verdict" and report["command"] == ["weaver", *argv]
    assert report["ratios"]["large"]["pooled"] == pytest.approx(ratio, rel=0.3)
    assert out.with_suffix(".png").stat().st_size > 0
    # Both deployments received the same prompts at the same (rate, seed).
    common = {s["prompt"] for s in small.streams} & {s["prompt"] for s in large.streams}
    assert len(common) >= 40
    assert all(run["workload"]["warmup_requests"] == 4 for run in report["runs"])
    # --min-span-s: a run at R req/s sent max(40, R x 0.5) requests.
    for run in report["runs"]:
        wanted = max(40, math.ceil(run["rate"] * 0.5))
        assert run["workload"]["num_requests"] == len(run["records"]) == wanted
    assert any(len(run["records"]) > 40 for run in report["runs"])  # above 80 req/s


@pytest.mark.parametrize(("extra", "message"), [
    (["--ttft-slo-ms", "100", "--rate", "5"], "--start-rate"),
    ([], "give --ttft-slo-ms and/or --tpot-slo-ms"),
    (["--ttft-slo-ms", "100", "--seed", "3"], "--seeds, not --seed"),
    (["--ttft-slo-ms", "100", "--duration-s", "9"], "--drain-s"),
    (["--ttft-slo-ms", "100", "--model", "x=2"], "without =RATE"),
    (["--ttft-slo-ms", "100", "--slo-scale", "10,5"], "not both"),
    (["--slo-scale", "10"], "TTFT_X,TPOT_X"),
    (["--slo-scale", "10,5"], "--judged-model"),
    (["--slo-scale", "10,5", "--judged-model", "m", "--isolated", "x=20,5"],
     "no isolated latency of 'm'"),
])
def test_cli_goodput_user_errors(extra, message, capsys):
    argv = ["bench", "goodput", "--target", "a=http://127.0.0.1:9", "--model", "m", *extra]
    assert _main(argv) == 2
    assert message in capsys.readouterr().err


def test_a_judged_model_is_judged_alone():
    """--judged-model: a hot model's misses decide, whatever the other model's requests."""
    run = _run("a", 10.0, [0.01] * NUM)
    for record in run.records[::2]:  # every other request is the cold model's, all missing
        record.model, record.status, record.ttft_s, record.e2e_s = (
            "cold", RequestStatus.ERROR, None, None)
    assert judge_run(run, 0, _config(seeds=(0,))).attainment == pytest.approx(0.5)
    judged = judge_run(run, 0, _config(seeds=(0,), judged_model="m"))
    assert judged.attainment == 1.0 and judged.num_measured == NUM // 2
    with pytest.raises(ValueError, match="--judged-model"):
        judge_run(run, 0, _config(seeds=(0,), judged_model="nobody"))


def test_an_slo_scaled_from_isolated_latencies():
    """--slo-scale: 10x the isolated TTFT at the mean prompt, 5x the isolated TPOT."""
    parser = argparse.ArgumentParser(prog="weaver")
    bench.register(parser.add_subparsers())
    args = parser.parse_args([
        "bench", "goodput", "--target", "a=http://127.0.0.1:9", "--model", "m",
        "--trace", "uniform:100-100:8-8", "--slo-scale", "10,5", "--judged-model", "m",
        "--isolated", "m=20,5"])
    slo = bench._goodput_slo(args, bench._WorkloadBuilder(args))
    assert slo.ttft_s == pytest.approx(0.2) and slo.tpot_s == pytest.approx(0.025)
