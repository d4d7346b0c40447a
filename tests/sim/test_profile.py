import json

import pytest

from weaver.profiling.torch_layers import MeasureSettings, measure_cpu_profile
from weaver.sim.profile import (
    KNOWN_DEVICES,
    Profile,
    get_device,
    get_shape,
    roofline_profile,
)


@pytest.mark.parametrize("device", sorted(KNOWN_DEVICES))
def test_roofline_profile_round_trips_through_json(tmp_path, device):
    profile = roofline_profile(get_shape("llama-3-8b"), get_device(device))
    assert profile.source.startswith("roofline from published specs")
    path = tmp_path / "p.json"
    profile.save(path)
    loaded = Profile.load(path)
    assert loaded == profile
    assert json.loads(path.read_text())["shape"]["num_kv_heads"] == 8


def test_llama3_8b_shape_numbers():
    shape = get_shape("llama-3-8b")
    assert 8.0e9 < shape.num_params < 8.1e9
    assert shape.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2


def test_bad_profiles_are_rejected_with_a_hint(tmp_path):
    data = roofline_profile(get_shape("tiny"), get_device("L40S")).to_dict()
    data["prefill_tokens"] = list(reversed(data["prefill_tokens"]))
    with pytest.raises(ValueError, match="strictly increasing"):
        Profile.from_dict(data)
    with pytest.raises(ValueError, match="PROFILE_FORMAT"):
        Profile.from_dict({"device": "x"})
    with pytest.raises(ValueError, match="unknown model shape"):
        get_shape("gpt-9")


def test_cpu_measurement_writes_the_same_format(tmp_path):
    settings = MeasureSettings(prefill_tokens=(8, 32), batch_sizes=(1, 2),
                               context_tokens=(16, 64), num_repeats=1)
    profile = measure_cpu_profile(get_shape("tiny"), settings, progress=False)
    assert profile.source.startswith("measured on")
    assert len(profile.decode_s) == 2 and len(profile.decode_s[0]) == 2
    assert all(t > 0 for t in profile.prefill_s + profile.attention_s)
    path = tmp_path / "cpu.json"
    profile.save(path)
    assert Profile.load(path) == profile
