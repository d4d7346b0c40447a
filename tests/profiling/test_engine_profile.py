"""The pure parts of `weaver profile --engine`: grid, fitting and the profile it writes."""

from __future__ import annotations

from dataclasses import replace

import pytest

from weaver.profiling.engine_profile import (
    DecodePoint,
    EngineGrid,
    EngineTimings,
    attention_batch,
    attention_grid,
    build_profile,
    decode_grid,
    fit_line,
    shape_from_hf_config,
    with_attention,
)
from weaver.sim.profile import KNOWN_SHAPES, Profile

SMOLLM2_CONFIG = {  # HuggingFaceTB/SmolLM2-135M-Instruct config.json, the fields read
    "num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9,
    "num_key_value_heads": 3, "intermediate_size": 1536, "vocab_size": 49152,
}


def test_decode_points_fit_the_engine_and_the_measured_range():
    grid = EngineGrid()
    points = grid.decode_points()
    assert all(c + grid.num_decode_steps + 2 <= grid.max_seq_len for _, c in points)
    assert all(b * c <= grid.max_measured_context for b, c in points)
    for b in grid.batch_sizes:  # every row gets the two points its line needs
        assert sum(p[0] == b for p in points) >= 2
    assert (1, 2048 - 2) not in points  # one 2046-token sequence exceeds max_seq_len
    # The prefills dominate profiling time on one core: keep them near 11k tokens.
    assert grid.num_prefill_tokens() < 12_000


def test_grid_rejects_bad_axes():
    with pytest.raises(ValueError, match="strictly increasing"):
        EngineGrid(batch_sizes=(4, 4))


def test_fit_line_is_least_squares_with_a_non_negative_slope():
    assert fit_line([0, 1, 2], [1.0, 3.0, 5.0]) == pytest.approx((1.0, 2.0))
    intercept, slope = fit_line([0, 10], [2.0, 1.0])  # noise: longer context, faster step
    assert slope == 0.0 and intercept == pytest.approx(1.5)
    with pytest.raises(ValueError):
        fit_line([3, 3], [1.0, 2.0])


def test_decode_grid_extends_each_row_along_its_line():
    grid = EngineGrid(batch_sizes=(1, 4), context_tokens=(100, 1000, 8000))
    points = [DecodePoint(1, 100, 0.05), DecodePoint(1, 1000, 0.06),
              DecodePoint(4, 100, 0.08), DecodePoint(4, 1000, 0.08)]
    rows = decode_grid(grid, points)
    assert rows[0] == pytest.approx([0.05, 0.06, 0.06 + 7000 * 0.01 / 900])
    assert rows[1] == pytest.approx([0.08, 0.08, 0.08])
    with pytest.raises(ValueError, match="batch 4"):
        decode_grid(grid, points[:3])


def test_build_profile_writes_the_documented_format(tmp_path):
    shape = shape_from_hf_config(SMOLLM2_CONFIG, "smollm2-135m", dtype_bytes=4)
    assert shape == KNOWN_SHAPES["smollm2-135m"]
    _engine_profile().save(tmp_path / "p.json")
    profile = Profile.load(tmp_path / "p.json")
    assert profile.source.startswith("measured on") and profile.device == "cpu"
    assert profile.decode_s[1] == pytest.approx([0.2, 0.25])
    assert "decode_points" in profile.notes and "grid" in profile.notes


def test_attention_batch_splits_into_sequences_of_about_the_given_length():
    assert attention_batch(1000, 256) == [250, 250, 250, 250]
    assert attention_batch(100, 256) == [100]
    assert sum(attention_batch(8193, 256)) == 8193


def _engine_profile(attention_tokens=(256, 8192), attention_seq_tokens=128, block_size=16):
    grid = EngineGrid(prefill_tokens=(16, 512), batch_sizes=(1, 64),
                      context_tokens=(128, 2048), attention_context_tokens=attention_tokens,
                      attention_seq_tokens=attention_seq_tokens, block_size=block_size)
    timings = EngineTimings(
        prefill_s=[0.03, 0.9],
        decode=[DecodePoint(1, 128, 0.05), DecodePoint(1, 512, 0.051),
                DecodePoint(64, 128, 0.2), DecodePoint(64, 2048, 0.25)],
        attention_s=[1e-4, 3e-3], link_bandwidth_bps=8e9,
        source="measured on test CPU", notes={"attention": "old way"})
    return build_profile(grid, KNOWN_SHAPES["smollm2-135m"], timings, "cpu", 1 << 34)


def test_retimed_attention_replaces_only_the_attention_table():
    profile = _engine_profile()
    grid = attention_grid(profile)
    assert (grid.attention_context_tokens, grid.attention_seq_tokens, grid.block_size) \
        == ((256, 8192), 128, 16)  # the grid the profile was measured on
    shape = replace(KNOWN_SHAPES["smollm2-135m"], name="/models/smollm2")  # a directory
    new = with_attention(profile, shape, [5e-4, 9e-3], "tasks through a region", "today")
    assert new.attention_s == [5e-4, 9e-3]
    assert (new.prefill_s, new.decode_s, new.link_bandwidth_bps) \
        == (profile.prefill_s, profile.decode_s, profile.link_bandwidth_bps)
    assert new.source == "measured on test CPU; attention re-timed today: tasks through a region"
    assert new.notes["attention"] == "tasks through a region"
    assert new.notes["attention_retimed"] == "today"
    assert new.notes["decode_points"] == profile.notes["decode_points"]
    assert profile.attention_s == [1e-4, 3e-3]  # the input is left alone


def test_retimed_attention_refuses_another_shape_or_length_or_a_non_engine_profile():
    profile = _engine_profile()
    other = replace(KNOWN_SHAPES["smollm2-135m"], num_kv_heads=1)
    with pytest.raises(ValueError, match="not the profile's"):
        with_attention(profile, other, [1e-3, 2e-3], "x", "y")
    with pytest.raises(ValueError, match="3 attention times for 2"):
        with_attention(profile, KNOWN_SHAPES["smollm2-135m"], [1e-3, 2e-3, 3e-3], "x", "y")
    roofline = replace(profile, notes={})
    with pytest.raises(ValueError, match="weaver profile --engine"):
        attention_grid(roofline)
