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


# (device, HBM GB/s, bf16 dense TFLOP/s, memory GB) from the vendors' datasheets.
# (40, 80 and 48 "GB" are GiB.)
DATASHEETS = [("A100-40GB", 1555, 312, 42.95), ("A100-80GB", 2039, 312, 85.90),
              ("H100-80GB", 3350, 989, 85.90), ("H200", 4800, 989, 141.0),
              ("L40S", 864, 362, 51.54)]


@pytest.mark.parametrize(("name", "gbps", "tflops", "memory_gb"), DATASHEETS)
def test_each_devices_roofline_follows_its_datasheet(name, gbps, tflops, memory_gb):
    device = get_device(name)
    assert device.memory_bytes / 1e9 == pytest.approx(memory_gb, rel=1e-3)
    shape = get_shape("llama-3-8b")
    profile = roofline_profile(shape, device)
    # A batch-1 decode with no context reads the weights once at 80 % of the bandwidth,
    # plus the step overhead (2 ms) and each layer's attention overhead (5 us).
    weights_s = shape.params_bytes / (0.8 * gbps * 1e9)
    overheads_s = 2e-3 + shape.num_layers * 5e-6
    assert profile.decode_s[0][0] == pytest.approx(weights_s + overheads_s, rel=1e-6)
    # A long prefill is compute-bound at 60 % of peak.
    n = profile.prefill_tokens[-1]
    flops = 2 * shape.num_params * n + 2 * shape.num_layers * shape.num_heads \
        * shape.head_size * n**2
    assert profile.prefill_s[-1] == pytest.approx(flops / (0.6 * tflops * 1e12) + 2e-3,
                                                  rel=1e-6)


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


def test_tensor_parallelism_splits_the_work_and_pays_two_all_reduces_a_layer():
    from weaver.sim.profile import allreduce_s, tensor_parallel_profile

    base = roofline_profile(get_shape("llama-3-8b"), get_device("A100-80GB"))
    tp2 = tensor_parallel_profile(base, 2, allreduce_latency_s=20e-6)
    assert tp2.memory_bytes == 2 * base.memory_bytes
    shape = base.shape
    # A batch of 64 decodes: half the single-GPU step, plus 2 x 32 ring all-reduces of
    # 64 x 4096 bf16 values over NVLink (300 GB/s): each 2 hops of 20 us + 1/2 the bytes.
    b = base.decode_batch_sizes.index(64)
    one = allreduce_s(64 * shape.hidden_size * 2, 2, base.link_bandwidth_bps, 20e-6)
    assert one == pytest.approx(2 * 20e-6 + 64 * 4096 * 2 / 300e9)
    assert tp2.decode_s[b][0] == pytest.approx(base.decode_s[b][0] / 2 + 64 * one)
    assert tp2.attention_s[3] == pytest.approx(base.attention_s[3] / 2)
    assert tensor_parallel_profile(base, 1, 20e-6) is base
