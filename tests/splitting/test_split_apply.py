"""Split plans from the deployment (weaver/splitting/deploy.py) and the chunked GEMM the
cold engine runs (weaver/vllm_ext/layers.py), without an engine."""

from __future__ import annotations

import json

import pytest

from weaver.config.deployment import ModelSpec
from weaver.splitting.deploy import split_chunks_for, validate_split_chunks
from weaver.splitting.profile import SplitProfile
from weaver.vllm_ext.additional_config import make_additional_config, split_section


def test_explicit_chunks_reach_additional_config():
    spec = ModelSpec(name="c", model="m", role="cold", split={"gate_up": 4, "qkv": 1})
    chunks = split_chunks_for(spec)
    assert chunks == {"gate_up": 4}
    config = make_additional_config(split_chunks=chunks)

    class VllmConfig:
        additional_config = config

    assert split_section(VllmConfig) == {"chunks": {"gate_up": 4}}
    assert make_additional_config(split_chunks={"qkv": 1}) == {}


def test_split_only_on_cold_models():
    with pytest.raises(ValueError, match="only a cold model splits"):
        ModelSpec(name="h", model="m", role="hot", split="auto")
    with pytest.raises(ValueError, match="only read with split: auto"):
        ModelSpec(name="c", model="m", role="cold", split={"o": 2}, split_profile="p.json")


@pytest.mark.parametrize(("chunks", "match"), [
    ({"mlp": 2}, "unknown operator"),
    ({"o": 0}, "int >= 1"),
])
def test_bad_chunks_say_how_to_fix(chunks, match):
    with pytest.raises(ValueError, match=match):
        validate_split_chunks(chunks)


def test_auto_needs_a_profile(tmp_path):
    spec = ModelSpec(name="c", model="m", role="cold", split="auto",
                     split_profile=str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="plan-split dep.yaml --measure --cold c"):
        split_chunks_for(spec, "dep.yaml")


def test_auto_plans_from_the_profile(tmp_path, profile_dict):
    profile_dict["hot"]["step_s"] = 1e-3  # threshold 50 us, under the unsplit W
    path = tmp_path / "p.json"
    path.write_text(json.dumps(profile_dict))
    SplitProfile.load(path)
    spec = ModelSpec(name="c", model="m", role="cold", split="auto", split_profile=str(path))
    chunks = split_chunks_for(spec)
    assert chunks and all(n > 1 for n in chunks.values())


def test_chunked_gemm_equals_the_packed_whole_and_polls_between_chunks():
    torch = pytest.importorskip("torch")
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    from weaver.splitting.algorithm import chunk_bounds
    from weaver.vllm_ext.layers import ChunkedLinear

    assert chunk_bounds(10, 3) == [(0, 4), (4, 7), (7, 10)]
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(200, 64, generator=gen), torch.randn(200, generator=gen)
    x = torch.randn(5, 64, generator=gen)
    whole = torch.nn.Module()
    whole.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
    dispatch_cpu_unquantized_gemm(whole, remove_weight=True)
    polls = []
    chunked = ChunkedLinear(weight, bias, 7, "gate_up")
    chunked.poll = lambda: polls.append(1)
    assert torch.equal(chunked(x, use_bias=True), whole.cpu_linear(x, whole.weight, bias))
    assert torch.equal(chunked(x, use_bias=False), whole.cpu_linear(x, whole.weight, None))
    assert len(polls) == 2 * 6
    assert chunked.stats() == {"chunks": 7, "calls": 2, "chunk_calls": 14, "polls": 12}
