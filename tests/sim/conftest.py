"""Fixtures of the simulator tests: a linear profile on disk and configs that use it."""

from __future__ import annotations

import pytest
from sim_helpers import linear_profile

from weaver.sim.config import SimConfig


@pytest.fixture
def profile_path(tmp_path):
    path = tmp_path / "linear.json"
    linear_profile().save(path)
    return str(path)


@pytest.fixture
def make_config(profile_path):
    """SimConfig factory: models given as (name, rate) using the linear profile."""

    def make(models, num_gpus=2, placement=None, **overrides) -> SimConfig:
        data = {
            "name": "test", "duration_s": 10.0, "cluster": {"device": "A100-80GB",
                                                            "num_gpus": num_gpus},
            "models": [{"name": n, "rate": r, "profile": profile_path,
                        "input": {"mean": 64, "sigma": 0.5}, "output": {"mean": 16,
                                                                         "sigma": 0.5}}
                       for n, r in models],
            "placement": placement,
        }
        data.update(overrides)
        return SimConfig.model_validate(data)

    return make
