"""Fixtures of the simulator tests: small configs over the linear profile (tests/conftest.py)."""

from __future__ import annotations

import pytest

from weaver.sim.config import SimConfig


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
