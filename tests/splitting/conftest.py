"""A complete, valid operator profile shared by the splitting tests."""

from __future__ import annotations

from typing import Any

import pytest

# SmolLM2-135M-like shapes (hidden 576, 9 heads / 3 KV heads of 64, intermediate 1536,
# vocabulary 49152); the times are made up but in a plausible CPU range.
_LAYER_OPS = [
    ("qkv", 21e-6, 20e-6, 960, 1),
    ("attn", 60e-6, 55e-6, 8, 1),
    ("o", 15e-6, 14e-6, 576, 1),
    ("gate_up", 90e-6, 85e-6, 3072, 64),
    ("down", 45e-6, 44e-6, 576, 64),
]


def _op(name: str, mean_s: float, p50_s: float, dim: int, min_chunk: int) -> dict[str, Any]:
    return {
        "name": name,
        "mean_s": mean_s,
        "p50_s": p50_s,
        "num_samples": 50,
        "split_dim_size": dim,
        "min_chunk_size": min_chunk,
    }


@pytest.fixture
def profile_dict() -> dict[str, Any]:
    return {
        "schema_version": 1,
        "model": "SmolLM2-135M",
        "device": "cpu",
        "num_layers": 30,
        "layer_ops": [_op(*spec) for spec in _LAYER_OPS],
        "lm_head": _op("lm_head", 1.2e-3, 1.1e-3, 49152, 64),
        "hot": {"local_attention_s": 150e-6, "remote_attention_s": 100e-6, "step_s": 4e-3},
        "split_overhead_s": 3e-6,
        "notes": "synthetic test profile",
    }
