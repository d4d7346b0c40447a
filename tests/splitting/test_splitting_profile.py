"""The shared profile format (weaver/splitting/profile.py) and the timing helper."""

from __future__ import annotations

import copy
import json
import math

import pytest

from weaver.profiling.timer import TimingStats, measure
from weaver.splitting.profile import LM_HEAD_NAME, PER_LAYER_OP_NAMES, OpTiming, SplitProfile


def test_json_round_trip(tmp_path, profile_dict):
    profile = SplitProfile.model_validate(profile_dict)
    path = tmp_path / "profile.json"
    profile.save(path)
    assert SplitProfile.load(path) == profile
    assert json.loads(path.read_text()) == profile_dict


def test_op_times_repeat_layers_then_lm_head(profile_dict):
    profile = SplitProfile.model_validate(profile_dict)
    times = profile.op_times()
    assert len(times) == 5 * 30 + 1
    assert times[:5] == [21e-6, 60e-6, 15e-6, 90e-6, 45e-6]
    assert times[5:10] == times[:5]
    assert times[-1] == 1.2e-3
    assert profile.op_times("p50")[-1] == 1.1e-3


def test_operator_specs_carry_instances_and_dims(profile_dict):
    specs = SplitProfile.model_validate(profile_dict).operator_specs()
    assert [s.name for s in specs] == [*PER_LAYER_OP_NAMES, LM_HEAD_NAME]
    assert [s.num_instances for s in specs] == [30] * 5 + [1]
    gate_up = specs[3]
    assert (gate_up.time_s, gate_up.split_dim_size, gate_up.max_chunks) == (90e-6, 3072, 48)


def test_specs_and_flat_timeline_agree_on_w(profile_dict):
    from weaver.splitting.algorithm import plan_wait
    from weaver.splitting.queueing import expected_wait

    profile = SplitProfile.model_validate(profile_dict)
    config = profile.split_config()
    assert plan_wait(profile.operator_specs(), {}, config) == pytest.approx(
        expected_wait(profile.op_times())
    )


def test_split_config_threshold_and_overhead_precedence(profile_dict):
    profile = SplitProfile.model_validate(profile_dict)
    config = profile.split_config()
    assert config.threshold_s == pytest.approx(0.05 * 4e-3)
    assert config.slack_s == pytest.approx(50e-6)
    assert config.overhead_s == 3e-6  # from the profile
    assert profile.split_config(overhead_s=1e-6).overhead_s == 1e-6  # argument wins
    del profile_dict["split_overhead_s"]
    assert SplitProfile.model_validate(profile_dict).split_config().overhead_s == 0.0
    with pytest.raises(ValueError, match="threshold_frac"):
        profile.split_config(threshold_frac=5.0)


def _break(profile_dict, path: str, value):
    """Set a nested key (dotted path, list indices as ints); None deletes it."""
    data = copy.deepcopy(profile_dict)
    *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
    target = data
    for key in parents:
        target = target[key]
    if value is None:
        del target[last]
    else:
        target[last] = value
    return data


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        ("layer_ops.4", None, "exactly one entry for each of"),  # "down" missing
        ("layer_ops.4.name", "qkv", "exactly one entry for each of"),  # duplicate
        ("layer_ops.1.name", "attention", "exactly one entry for each of"),  # typo
        ("lm_head.name", "head", "must be named 'lm_head'"),
        ("layer_ops.0.mean_s", -1e-6, "positive, finite"),
        ("layer_ops.0.p50_s", math.nan, "positive, finite"),
        ("layer_ops.0.num_samples", 0, "num_samples"),
        ("layer_ops.0.split_dim_size", 0, "split_dim_size"),
        ("hot.step_s", 0.0, "positive, finite"),
        ("hot.local_attention_s", None, "local_attention_s"),
        ("num_layers", 0, "num_layers"),
        ("schema_version", 2, "schema_version"),
        ("split_overhead_s", -1.0, "split_overhead_s"),
        ("extra_field", 1, "extra_field"),
    ],
)
def test_validation_errors_name_the_problem(tmp_path, profile_dict, path, value, message):
    path_on_disk = tmp_path / "bad.json"
    path_on_disk.write_text(json.dumps(_break(profile_dict, path, value)))
    with pytest.raises(ValueError, match=message) as info:
        SplitProfile.load(path_on_disk)
    assert "bad.json" in str(info.value)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        SplitProfile.load(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        SplitProfile.load(bad)


def test_op_timing_from_measured_stats():
    stats = TimingStats(mean_s=2e-6, p50_s=1e-6, min_s=1e-6, max_s=5e-6, num_samples=9)
    op = OpTiming.from_stats("qkv", stats, split_dim_size=960)
    assert (op.mean_s, op.p50_s, op.num_samples, op.min_chunk_size) == (2e-6, 1e-6, 9, 1)


class _FakeDevice:
    """A clock that only moves when the 'kernel' runs, so the stats are exact."""

    def __init__(self, durations: list[float]) -> None:
        self.now = 0.0
        self.durations = iter(durations)
        self.num_calls = 0
        self.num_syncs = 0

    def run(self) -> None:
        self.num_calls += 1
        self.now += next(self.durations)

    def sync(self) -> None:
        self.num_syncs += 1


def test_measure_discards_warmup_and_takes_median():
    device = _FakeDevice([100.0, 100.0] + [1.0, 3.0, 2.0, 10.0, 4.0])
    stats = measure(
        device.run, num_warmup=2, num_iters=5, synchronize=device.sync, clock=lambda: device.now
    )
    assert device.num_calls == 7
    assert device.num_syncs == 6  # once after warm-up, once per timed run
    assert stats == TimingStats(mean_s=4.0, p50_s=3.0, min_s=1.0, max_s=10.0, num_samples=5)


def test_measure_real_clock_and_bad_arguments():
    stats = measure(lambda: sum(range(1000)), num_warmup=1, num_iters=5)
    assert stats.num_samples == 5
    assert 0 < stats.min_s <= stats.p50_s <= stats.max_s
    with pytest.raises(ValueError, match="num_iters"):
        measure(lambda: None, num_iters=0)
    with pytest.raises(ValueError, match="num_warmup"):
        measure(lambda: None, num_warmup=-1)
