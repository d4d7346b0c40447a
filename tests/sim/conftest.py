"""Fixtures of the simulator tests: small configs over the linear profile (tests/conftest.py)."""

from __future__ import annotations

import pytest

from weaver.sim.config import SimConfig
from weaver.sim.profile import KNOWN_SHAPES, Profile


@pytest.fixture
def make_config(profile_path):
    """SimConfig factory: models given as (name, rate) using the linear profile."""

    def make(models, num_gpus=2, placement=None, **overrides) -> SimConfig:
        data = {
            "name": "test", "duration_s": 10.0, "cluster": {"device": "A100-80GB",
                                                            "num_gpus": num_gpus},
            # Azure-conv lengths scaled to ~75 / 23 tokens: short, seconds-long runs.
            "workload": {"trace": "azure-conv", "length_scale": 0.1},
            "models": [{"name": n, "rate": r, "profile": profile_path} for n, r in models],
            "placement": placement,
        }
        data.update(overrides)
        return SimConfig.model_validate(data)

    return make


@pytest.fixture
def smollm2_profile() -> Profile:
    """Made-up but plausible one-core numbers: 40 ms + 4 ms per sequence per decode step,
    2 ms per prefill token, attention 1 us per context token (all layers)."""
    batches, contexts = [1, 64], [0, 8192]
    return Profile(
        device="cpu", shape=KNOWN_SHAPES["smollm2-135m"], source="hand-made test profile",
        memory_bytes=1 << 30, prefill_tokens=[1, 2048], prefill_s=[0.04, 0.04 + 2e-3 * 2047],
        decode_batch_sizes=batches, decode_context_tokens=contexts,
        decode_s=[[0.04 + 4e-3 * b + 1e-6 * c for c in contexts] for b in batches],
        attention_context_tokens=contexts, attention_s=[1e-4, 1e-4 + 1e-6 * 8192],
        link_bandwidth_bps=5e9, link_latency_s=1e-6)


@pytest.fixture
def cpu_profile(tmp_path, smollm2_profile) -> str:
    path = tmp_path / "smollm2_cpu.json"
    smollm2_profile.save(path)
    return str(path)
