"""The pure half of profiling the real engine (`weaver profile --engine`): which points to
time, and how timed points become a `Profile` (PROFILE_FORMAT.md).

The timing itself (vLLM's engine and CPU attention kernel) is in
`weaver.vllm_ext.engine.timing`; this module imports neither vLLM nor torch.

Decode steps are timed at (batch b, per-sequence prompt c) points whose prompts the engine
can hold; the total context of a timed step is measured, not assumed (it grows by b per
step). The profile's decode grid is then filled per batch row by a least-squares line of
step time over total context: a decode step is dense work fixed for a given b plus
attention linear in the context, so the line is the physical shape, and it extends the
row past the largest context worth prefilling within the time budget.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace

from weaver.sim.profile import ModelShape, Profile


@dataclass(frozen=True)
class EngineGrid:
    """What to time. Defaults fit SmolLM2-135M on one core in about two minutes, covering
    the benchmark deployments (<= 64 sequences, <= 192 blocks of 32 tokens each side)."""

    prefill_tokens: tuple[int, ...] = (16, 64, 128, 256, 512)
    batch_sizes: tuple[int, ...] = (1, 4, 16, 64)
    context_tokens: tuple[int, ...] = (128, 512, 2048, 8192)  # the profile's axis
    max_measured_context: int = 2048  # cells above come from each row's line
    max_seq_len: int = 1024  # the profiling engine's max_model_len
    num_decode_steps: int = 4  # timed decode steps per point (median)
    num_repeats: int = 2  # prefill repeats (min), after one warm-up
    attention_context_tokens: tuple[int, ...] = (256, 1024, 4096, 8192)
    attention_seq_tokens: int = 256  # attention timed over sequences of this length
    block_size: int = 32

    def __post_init__(self) -> None:
        for name in ("prefill_tokens", "batch_sizes", "context_tokens",
                     "attention_context_tokens"):
            axis = getattr(self, name)
            if len(axis) < 2 or any(b <= a for a, b in zip(axis, axis[1:], strict=False)):
                raise ValueError(f"{name} needs >= 2 strictly increasing values, got {axis}")
        if max(self.prefill_tokens) > self.max_seq_len:
            raise ValueError("prefill_tokens must fit max_seq_len")

    def decode_points(self) -> list[tuple[int, int]]:
        """(batch size, prompt tokens per sequence) to time: each total context up to
        `max_measured_context`, centred on the timed steps, that fits `max_seq_len`."""
        points = []
        for b in self.batch_sizes:
            for total in self.context_tokens:
                if total > self.max_measured_context:
                    continue
                per_seq = max(1, total // b - self.num_decode_steps // 2)
                if per_seq + self.num_decode_steps + 2 <= self.max_seq_len:
                    points.append((b, per_seq))
        return sorted(set(points))

    def num_prefill_tokens(self) -> int:
        """Tokens prefilled in all (the bulk of the profiling time on a CPU)."""
        prefill = sum(self.prefill_tokens) * (self.num_repeats + 1)
        return prefill + sum(b * c for b, c in self.decode_points())


@dataclass
class DecodePoint:
    batch_size: int
    mean_context_tokens: float  # total over the batch, averaged over the timed steps
    step_s: float


@dataclass
class EngineTimings:
    """What the timing run measured, before any fitting."""

    prefill_s: list[float]
    decode: list[DecodePoint]
    attention_s: list[float]  # all layers, at EngineGrid.attention_context_tokens
    link_bandwidth_bps: float
    source: str
    notes: dict[str, str] = field(default_factory=dict)


def least_squares(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Ordinary least-squares (intercept, slope); ValueError without two distinct x."""
    if len(xs) != len(ys) or len(set(xs)) < 2:
        raise ValueError("a line needs points at >= 2 distinct x values")
    slope, intercept = statistics.linear_regression(xs, ys)
    return intercept, slope


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope) with the slope clamped at >= 0: a longer context
    never makes a step faster, so a negative slope is timing noise (the flat line through
    the mean is then the best fit)."""
    intercept, slope = least_squares(xs, ys)
    if slope < 0:
        return statistics.fmean(ys), 0.0
    return intercept, slope


def decode_grid(grid: EngineGrid, points: Sequence[DecodePoint]) -> list[list[float]]:
    """decode_s[i][j] at (batch_sizes[i], context_tokens[j]) from each row's line."""
    rows = []
    for b in grid.batch_sizes:
        mine = [p for p in points if p.batch_size == b]
        if len(mine) < 2:
            raise ValueError(f"batch {b}: {len(mine)} timed point(s); the grid needs 2 per "
                             "batch size (raise max_seq_len or add context_tokens)")
        intercept, slope = fit_line([p.mean_context_tokens for p in mine],
                                    [p.step_s for p in mine])
        rows.append([max(intercept + slope * t, 0.0) for t in grid.context_tokens])
    return rows


def build_profile(grid: EngineGrid, shape: ModelShape, timings: EngineTimings,
                  device: str, memory_bytes: int) -> Profile:
    notes = {
        **timings.notes,
        "grid": json.dumps(asdict(grid)),
        "decode_points": json.dumps([asdict(p) for p in timings.decode]),
        "decode_fit": "per batch size, least-squares line of step time over total context "
                      "(slope >= 0) through the timed points; cells past "
                      f"{grid.max_measured_context} tokens are extrapolated on it",
    }
    return Profile(
        device=device, shape=shape, source=timings.source, memory_bytes=memory_bytes,
        prefill_tokens=list(grid.prefill_tokens), prefill_s=list(timings.prefill_s),
        decode_batch_sizes=list(grid.batch_sizes),
        decode_context_tokens=list(grid.context_tokens),
        decode_s=decode_grid(grid, timings.decode),
        attention_context_tokens=list(grid.attention_context_tokens),
        attention_s=list(timings.attention_s),
        link_bandwidth_bps=timings.link_bandwidth_bps, link_latency_s=1e-6, notes=notes)


def shape_from_hf_config(config: dict, name: str, dtype_bytes: int) -> ModelShape:
    """A Llama-family `config.json` as a `ModelShape` (same reading as
    weaver/weaving/plan.py `read_attention_shape`)."""
    num_heads = config["num_attention_heads"]
    return ModelShape(
        name=name, num_layers=config["num_hidden_layers"], hidden_size=config["hidden_size"],
        num_heads=num_heads, num_kv_heads=config.get("num_key_value_heads", num_heads),
        head_size=config.get("head_dim") or config["hidden_size"] // num_heads,
        intermediate_size=config["intermediate_size"], vocab_size=config["vocab_size"],
        dtype_bytes=dtype_bytes)


def attention_batch(total_tokens: int, seq_tokens: int) -> list[int]:
    """Sequence lengths of an attention timing point: `total_tokens` split into sequences
    of about `seq_tokens` (per-sequence kernel overhead is part of the cost)."""
    num_seqs = max(1, math.ceil(total_tokens / seq_tokens))
    base, extra = divmod(total_tokens, num_seqs)
    return [base + (i < extra) for i in range(num_seqs)]


def attention_grid(profile: Profile) -> EngineGrid:
    """The grid to re-time `profile`'s attention table on: its own context axis, and the
    block size and sequence length of the grid it was measured on (notes.grid)."""
    try:
        measured = json.loads(profile.notes["grid"])
    except (KeyError, json.JSONDecodeError) as exc:
        raise ValueError("this profile has no engine grid in its notes (notes.grid): only "
                         "profiles of `weaver profile --engine` can have their attention "
                         "re-timed") from exc
    return EngineGrid(attention_context_tokens=tuple(profile.attention_context_tokens),
                      attention_seq_tokens=measured["attention_seq_tokens"],
                      block_size=measured["block_size"])


def with_attention(profile: Profile, shape: ModelShape, attention_s: Sequence[float],
                   how: str, when: str) -> Profile:
    """`profile` with its attention table replaced by `attention_s` (timed at its own
    `attention_context_tokens` for `shape`), everything else kept; source and notes say
    how and when the table was re-timed."""
    require_same_shape(profile, shape)
    if len(attention_s) != len(profile.attention_context_tokens):
        raise ValueError(f"{len(attention_s)} attention times for "
                         f"{len(profile.attention_context_tokens)} context points")
    notes = {**profile.notes, "attention": how, "attention_retimed": when}
    return replace(profile, attention_s=list(attention_s),
                   source=f"{profile.source}; attention re-timed {when}: {how}", notes=notes)


def require_same_shape(profile: Profile, shape: ModelShape) -> None:
    """ValueError unless `shape` is the profile's (names aside: a model directory's name
    may differ from the registry's)."""
    if replace(shape, name=profile.shape.name) != profile.shape:
        raise ValueError(f"the model's shape {shape} is not the profile's {profile.shape}")
