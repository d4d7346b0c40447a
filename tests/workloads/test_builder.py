"""Workload assembly: seeding, multi-model rates, sampling, trace replay, scaling."""

from __future__ import annotations

import numpy as np
import pytest

from weaver.workloads.builder import (
    ArrivalKind,
    ModelLoad,
    WorkloadSpec,
    build_workload,
    describe_workload,
    model_rates,
)
from weaver.workloads.traces import TraceRow

ROWS = [TraceRow(float(i), 100 + i, 10 + (i % 7)) for i in range(500)]


def _spec(**kw):
    kw.setdefault("models", [ModelLoad("a")])
    kw.setdefault("rate", 5.0)
    return WorkloadSpec(**kw)


def test_same_seed_same_workload_other_seed_differs():
    spec = _spec(models=[ModelLoad("a"), ModelLoad("b")], num_requests=50)
    assert build_workload(spec, ROWS) == build_workload(spec, ROWS)
    other = build_workload(_spec(models=spec.models, num_requests=50, seed=1), ROWS)
    assert other != build_workload(spec, ROWS)


def test_requests_sorted_with_ids_and_sampled_without_replacement():
    requests = build_workload(_spec(num_requests=200), ROWS)
    assert [r.request_id for r in requests] == list(range(200))
    arrivals = [r.arrival_s for r in requests]
    assert arrivals == sorted(arrivals)
    assert len({r.input_tokens for r in requests}) == 200  # inputs are distinct per row
    assert {r.model for r in requests} == {"a"}


def test_per_model_rates_set_counts_and_offered_rates():
    models = [ModelLoad("hot", 6.0), ModelLoad("cold", 2.0)]
    requests = build_workload(_spec(models=models, rate=None, num_requests=4000), ROWS)
    stats = describe_workload(requests)
    assert stats["hot"]["num_requests"] == 3000
    assert stats["cold"]["num_requests"] == 1000
    hot_times = [r.arrival_s for r in requests if r.model == "hot"]
    assert len(hot_times) / hot_times[-1] == pytest.approx(6.0, rel=0.1)


def test_power_law_split_of_total_rate():
    models = [ModelLoad("m1"), ModelLoad("m2"), ModelLoad("m3")]
    rates = model_rates(_spec(models=models, rate=11.0, power_law_alpha=1.0))
    assert sum(rates) == pytest.approx(11.0)
    assert rates[0] / rates[2] == pytest.approx(3.0)


def test_rate_errors():
    with pytest.raises(ValueError, match="every model"):
        model_rates(_spec(models=[ModelLoad("a", 1.0), ModelLoad("b")], rate=None))
    with pytest.raises(ValueError, match="not both"):
        model_rates(_spec(models=[ModelLoad("a", 1.0)], rate=2.0))
    with pytest.raises(ValueError, match="--rate is required"):
        model_rates(_spec(rate=None))
    with pytest.raises(ValueError, match="repeat"):
        _spec(models=[ModelLoad("a"), ModelLoad("a")])
    with pytest.raises(ValueError, match="unknown arrival 'uniform'"):
        _spec(arrival="uniform")


def test_model_load_parse():
    assert ModelLoad.parse("llama=2.5") == ModelLoad("llama", 2.5)
    assert ModelLoad.parse("qwen") == ModelLoad("qwen")
    assert ModelLoad.parse("hot=0.5@60/90") == ModelLoad("hot", 0.5, (60.0, 90.0))
    for bad in ("=3", "a=x", "a=-1", "a=1@60", "a=1@60/0", "a=1@x/2"):
        with pytest.raises(ValueError, match="--model"):
            ModelLoad.parse(bad)


def test_phased_model_sends_only_while_on():
    # hot at 2 req/s in 10-s bursts with 30 s off; cold steady at 0.5 req/s. Both span the
    # same time: hot's rate over a cycle is 0.5 req/s too, so they get the same count.
    rows = [TraceRow(float(i), 50, 5) for i in range(500)]
    models = [ModelLoad("hot", 2.0, (10.0, 30.0)), ModelLoad("cold", 0.5)]
    requests = build_workload(_spec(models=models, rate=None, num_requests=400), rows)
    hot = [r.arrival_s for r in requests if r.model == "hot"]
    cold = [r.arrival_s for r in requests if r.model == "cold"]
    assert len(hot) == len(cold) == 200
    assert all(t % 40.0 < 10.0 for t in hot)  # never inside an off phase
    assert any(t % 40.0 >= 10.0 for t in cold)
    on_time = 10.0 * (max(hot) // 40.0) + max(hot) % 40.0
    assert len(hot) / on_time == pytest.approx(2.0, rel=0.2)  # the rate while on
    with pytest.raises(ValueError, match="poisson or gamma"):
        _spec(models=models, rate=None, arrival="trace")


@pytest.mark.parametrize("arrival", ["poisson", "trace"])
def test_a_copy_is_sent_its_models_requests_and_draws_nothing(arrival):
    # plain and lending served side by side must see one stream, not two draws of it; the
    # other models' requests are those of the same seed without the copy.
    rows = [TraceRow(float(i), 50 + i % 40, 5 + i % 9) for i in range(600)]
    models = [ModelLoad("hot", 1.0, None if arrival == "trace" else (20.0, 20.0)),
              ModelLoad("plain", 1.0), ModelLoad("lending", same_as="plain")]
    spec = _spec(models=models, rate=None, arrival=arrival, num_requests=300)
    requests = build_workload(spec, rows)

    def stream(name):
        return [(r.arrival_s, r.input_tokens, r.output_tokens) for r in requests
                if r.model == name]

    assert stream("lending") == stream("plain") and stream("plain")
    assert len(requests) == 300 + len(stream("plain"))  # the copy is on top of --num-requests
    without = build_workload(_spec(models=models[:2], rate=None, arrival=arrival,
                                   num_requests=300), rows)
    assert ([(r.arrival_s, r.model, r.input_tokens) for r in requests if r.model != "lending"]
            == [(r.arrival_s, r.model, r.input_tokens) for r in without])
    assert model_rates(spec) == [1.0, 1.0, 1.0]


def test_a_copy_takes_its_models_phases_and_must_name_another_drawn_model():
    spec = _spec(models=[ModelLoad("hot", 2.0, (10.0, 30.0)), ModelLoad("twin", same_as="hot")],
                 rate=None)
    assert spec.models[1].phases == (10.0, 30.0)
    assert spec.models[1].mean_rate(2.0) == pytest.approx(0.5)
    assert ModelLoad.parse("lending=same:plain") == ModelLoad("lending", same_as="plain")
    with pytest.raises(ValueError, match="name the model"):
        ModelLoad.parse("lending=same:")
    with pytest.raises(ValueError, match="must be another of the models"):
        _spec(models=[ModelLoad("a"), ModelLoad("b", same_as="c")])
    with pytest.raises(ValueError, match="must be another of the models"):
        _spec(models=[ModelLoad("a", same_as="a")])
    with pytest.raises(ValueError, match="copies 'b' itself; name 'b' instead"):
        _spec(models=[ModelLoad("b"), ModelLoad("c", same_as="b"), ModelLoad("d", same_as="c")])
    # A copy built in code with a rate or phases of its own: refused, not ignored.
    with pytest.raises(ValueError, match="give 'twin' no rate or phases of its own"):
        _spec(models=[ModelLoad("hot", 2.0), ModelLoad("twin", 1.0, same_as="hot")], rate=None)
    with pytest.raises(ValueError, match="set them on 'hot'"):
        _spec(models=[ModelLoad("hot", 2.0, (10.0, 30.0)),
                      ModelLoad("twin", phases=(5.0, 5.0), same_as="hot")], rate=None)
    again = _spec(models=spec.models, rate=None)  # its copied phases are its model's
    assert again.models[1].phases == (10.0, 30.0)


def test_trace_replay_stretched_to_rate():
    rows = [TraceRow(t, 50, 5) for t in (0.0, 1.0, 1.5, 4.0, 10.0)]
    spec = _spec(arrival=ArrivalKind.TRACE, rate=1.0, num_requests=5)
    requests = build_workload(spec, rows)
    # The trace's own rate is 4 gaps / 10 s = 0.4 req/s; at 1 req/s it lasts 4 s.
    assert [r.arrival_s for r in requests] == pytest.approx([0.0, 0.4, 0.6, 1.6, 4.0])
    at_own_speed = build_workload(_spec(arrival="trace", rate=None, num_requests=3), rows)
    assert [r.arrival_s for r in at_own_speed] == [0.0, 1.0, 1.5]
    scaled = build_workload(_spec(arrival="trace", rate=None, time_scale=2.0, num_requests=3), rows)
    assert [r.arrival_s for r in scaled] == [0.0, 2.0, 3.0]


def test_trace_replay_assigns_models_by_rate():
    rows = [TraceRow(float(i), 50, 5) for i in range(3000)]
    models = [ModelLoad("hot", 3.0), ModelLoad("cold", 1.0)]
    spec = _spec(models=models, rate=None, arrival="trace", num_requests=3000)
    requests = build_workload(spec, rows)
    share = np.mean([r.model == "hot" for r in requests])
    assert share == pytest.approx(0.75, abs=0.03)


def test_length_scaling_fits_max_model_len():
    rows = [TraceRow(0.0, 1900, 99), TraceRow(1.0, 300, 1500)]
    spec = _spec(num_requests=2, length_scale=0.25, max_model_len=256)
    requests = build_workload(spec, rows)
    assert all(r.input_tokens + r.output_tokens <= 256 for r in requests)
    # 475+25 and 75+375 tokens after scaling, each shrunk in proportion to fit 256.
    assert {(r.input_tokens, r.output_tokens) for r in requests} == {(243, 13), (42, 214)}


def test_gamma_workload_uses_burstiness():
    calm = build_workload(_spec(arrival="gamma", burstiness=4.0, num_requests=3000), ROWS * 6)
    bursty = build_workload(_spec(arrival="gamma", burstiness=0.25, num_requests=3000), ROWS * 6)

    def cv(reqs):
        gaps = np.diff([r.arrival_s for r in reqs])
        return np.std(gaps) / np.mean(gaps)

    assert cv(bursty) > 2 * cv(calm)


def test_builds_from_real_azure_trace():
    spec = _spec(trace="azure-conv", num_requests=100, length_scale=0.1, max_model_len=256)
    requests = build_workload(spec)
    assert len(requests) == 100
    assert all(r.input_tokens + r.output_tokens <= 256 for r in requests)
