"""LlamaShape validation, names, and the vLLM CPU head-size table (no torch needed)."""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
from pathlib import Path

import pytest

from weaver.models.registry import PRESETS
from weaver.models.shapes import VLLM_CPU_HEAD_SIZES, LlamaShape, check_model_name

BASE = dict(
    num_layers=2,
    num_q_heads=4,
    num_kv_heads=2,
    head_size=32,
    hidden_size=128,
    intermediate_size=384,
)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"num_kv_heads": 3}, "multiple of num_kv_heads"),
        ({"num_layers": 0}, "num_layers must be a positive integer"),
        ({"head_size": -32}, "head_size must be a positive integer"),
        ({"hidden_size": True}, "hidden_size must be a positive integer"),
        ({"intermediate_size": 3.5}, "intermediate_size must be a positive integer"),
        ({"head_size": 33}, "even"),
        ({"vocab_size": 1000}, "vocab_size must be at least 49152"),
        ({"init_std": 0.0}, "init_std must be positive"),
        ({"seed": -1}, "seed must be non-negative"),
    ],
)
def test_bad_shapes_are_rejected_with_a_reason(override: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LlamaShape(**{**BASE, **override})


def test_default_name_spells_out_the_shape() -> None:
    shape = LlamaShape(**BASE, seed=7)
    assert shape.default_name() == "random-llama-l2-q4-kv2-d32-h128-i384-s7"
    check_model_name(shape.default_name())


@pytest.mark.parametrize("name", ["", "Upper", "a/b", "../x", "-x", "a b", "x" * 101])
def test_unsafe_model_names_are_rejected(name: str) -> None:
    with pytest.raises(ValueError, match="not allowed"):
        check_model_name(name)


def test_vllm_cpu_compatibility_follows_head_size() -> None:
    assert LlamaShape(**BASE).is_vllm_cpu_compatible
    assert not LlamaShape(**{**BASE, "head_size": 48}).is_vllm_cpu_compatible


def test_presets_differ_in_every_dimension_the_kv_pool_cares_about() -> None:
    shapes = [preset.shape for preset in PRESETS if preset.shape is not None]
    assert len(shapes) >= 2
    for field in ("num_layers", "num_kv_heads", "head_size", "hidden_size"):
        values = [getattr(shape, field) for shape in shapes]
        assert len(set(values)) == len(values), f"presets share {field}: {values}"
    assert any(s.num_q_heads // s.num_kv_heads > 1 for s in shapes), "no GQA preset"
    assert all(s.is_vllm_cpu_compatible for s in shapes)
    assert all(s.max_position_embeddings == 4096 for s in shapes)


def test_preset_names_are_unique_and_valid() -> None:
    names = [preset.name for preset in PRESETS]
    assert len(set(names)) == len(names)
    for name in names:
        check_model_name(name)


def test_shape_round_trips_through_its_dict() -> None:
    shape = LlamaShape(**BASE, seed=3)
    assert LlamaShape(**shape.to_dict()) == shape
    assert set(shape.to_dict()) == {f.name for f in dataclasses.fields(LlamaShape)}


def _vllm_cpu_head_sizes_from_source() -> list[int]:
    """Read the literal list vLLM's CPU backend returns, without importing vLLM (slow)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vLLM is not installed")
    source_path = (
        Path(next(iter(spec.submodule_search_locations)))
        / "v1"
        / "attention"
        / "backends"
        / "cpu_attn.py"
    )
    tree = ast.parse(source_path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == "get_supported_head_sizes":
            returns = [n for n in ast.walk(node) if isinstance(n, ast.Return)]
            assert len(returns) == 1, "get_supported_head_sizes changed shape: re-check it"
            return ast.literal_eval(returns[0].value)
    raise AssertionError(f"{source_path} no longer defines get_supported_head_sizes")


def test_head_size_table_matches_installed_vllm() -> None:
    # Drift test: VLLM_CPU_HEAD_SIZES copies vLLM's list so that shapes import without vLLM.
    assert tuple(_vllm_cpu_head_sizes_from_source()) == VLLM_CPU_HEAD_SIZES
