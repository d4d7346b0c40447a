"""Calibrate an in-process engine profile against the real serving path (pure half).

`weaver profile --engine` times `LLMEngine.step()` in-process. A served request pays more
per step: the EngineCore <-> frontend IPC, detokenisation, SSE streaming through the
gateway, and the frontend and client processes sharing the cores with the engines. That
work matters most at small batches (where it is a large share of a step) and caps
throughput at saturation. This module fits it from points measured by a client through
`weaver serve` (`weaver.profiling.serving_probe` measures them) and adds it to the profile:

- decode: overhead per step as a least-squares line over the batch size,
  overhead(b) = max(0, a + k b), measured as served TPOT - in-process decode step time at
  the point's batch size and total context; added to every `decode_s[i][j]` at
  `decode_batch_sizes[i]`. Bilinear interpolation of the grid then adds exactly a + k b at
  any batch size (linear interpolation of a line is the line), once per step;
- prefill: a fixed overhead P, the median of (TTFT of a lone request - in-process prefill
  time of its prompt), added to every `prefill_s`.

Mixed steps are not double-counted. The simulator (`weaver.sim.instance.ModelServer
.step_time`) prices a step of b decodes plus an n-token prefill chunk as
decode(b, ctx) + prefill(n + b) - prefill(b): with both tables shifted, that is
decode(b, ctx) + D(b) + (prefill(n + b) + P) - (prefill(b) + P), so P cancels and the step
pays the decode overhead once, as a served step pays its per-step costs once. A
prefill-only step pays P. P also holds per-request costs (HTTP, tokenisation, the first
SSE chunk); a prefill step of several prompts pays it once, which understates those.

`attention_s` is left alone: it is the cold worker's offloaded attention kernel, which
runs inside an engine step and never crosses the serving path.

No vLLM or torch import here.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

from weaver.profiling.engine_profile import least_squares
from weaver.sim.perf_model import PerfModel
from weaver.sim.profile import Profile, blocks_for

NOTES_KEY = "serving_calibration"


@dataclass(frozen=True)
class ServingDecodePoint:
    """b concurrent streaming requests decoding together, seen by the client."""

    batch_size: int
    mean_context_tokens: float  # total context of the batch, averaged over its steps
    tpot_s: float  # median TPOT of the requests that decoded with the whole batch

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"decode point: batch size must be >= 1, got {self.batch_size}")
        _check_positive("decode point TPOT", self.tpot_s)
        if not (math.isfinite(self.mean_context_tokens) and self.mean_context_tokens >= 0):
            raise ValueError("decode point: mean context must be a finite number >= 0, got "
                             f"{self.mean_context_tokens}")


@dataclass(frozen=True)
class ServingPrefillPoint:
    """One request alone on an idle server: its prompt length and TTFT."""

    prompt_tokens: int
    ttft_s: float

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1:
            raise ValueError(f"prefill point: prompt must be >= 1 token, got "
                             f"{self.prompt_tokens}")
        _check_positive("prefill point TTFT", self.ttft_s)


@dataclass(frozen=True)
class DecodeComparison:
    point: ServingDecodePoint
    in_process_s: float  # the profile's decode step at the point's batch and context

    @property
    def overhead_s(self) -> float:
        return self.point.tpot_s - self.in_process_s


@dataclass(frozen=True)
class PrefillComparison:
    point: ServingPrefillPoint
    in_process_s: float  # the profile's prefill step of the point's prompt

    @property
    def overhead_s(self) -> float:
        return self.point.ttft_s - self.in_process_s


@dataclass(frozen=True)
class ServingFit:
    """The serving overhead the in-process profile lacks, with the points it came from."""

    intercept_s: float  # a: per decode step
    per_seq_s: float  # k: per sequence of a decode step
    prefill_overhead_s: float  # P: per prefill step (clamped >= 0)
    decode: tuple[DecodeComparison, ...]
    prefill: tuple[PrefillComparison, ...]

    def decode_overhead_s(self, batch_size: float) -> float:
        # Clamped at 0: a served step runs the in-process engine step plus more work, so it
        # cannot be faster. A negative value means the profile's own time at that batch
        # size came out slower (timing noise, or a busier machine while profiling); fixing
        # the engine's time is not this calibration's job, and a negative line would grow
        # without bound when extrapolated to the profile's larger batch sizes.
        return max(0.0, self.intercept_s + self.per_seq_s * batch_size)


def fit_serving_overhead(profile: Profile, decode: Sequence[ServingDecodePoint],
                         prefill: Sequence[ServingPrefillPoint]) -> ServingFit:
    """Overhead of the serving path over `profile`, from client-side points."""
    require_in_process(profile)
    batch_sizes = sorted({p.batch_size for p in decode})
    if len(batch_sizes) < 2:
        raise ValueError("the decode overhead is a line over the batch size: it needs points "
                         f"at >= 2 batch sizes, got {batch_sizes}")
    if not prefill:
        raise ValueError("the prefill overhead needs at least one prefill (TTFT) point")
    perf = PerfModel(profile)
    decode_cmp = tuple(DecodeComparison(p, perf.decode_time(p.batch_size,
                                                            round(p.mean_context_tokens)))
                       for p in decode)
    prefill_cmp = tuple(PrefillComparison(p, perf.prefill_time(p.prompt_tokens))
                        for p in prefill)
    # Unclamped coefficients: the clamp applies to the line's values
    # (ServingFit.decode_overhead_s), so a line falling with the batch size is kept where
    # it stays >= 0.
    intercept, slope = least_squares([c.point.batch_size for c in decode_cmp],
                                     [c.overhead_s for c in decode_cmp])
    # Clamped at 0 for the same reason as the decode overhead (see decode_overhead_s).
    prefill_overhead = max(0.0, statistics.median(c.overhead_s for c in prefill_cmp))
    return ServingFit(intercept, slope, prefill_overhead, decode_cmp, prefill_cmp)


def require_in_process(profile: Profile) -> None:
    """Refuse a profile that already carries a serving calibration: its times would be
    compared as if in-process, and its notes could hold one calibration only."""
    if NOTES_KEY in profile.notes:
        raise ValueError("this profile is already serving-calibrated (notes."
                         f"{NOTES_KEY}); calibrate the in-process profile it came from")


def apply_serving_overhead(profile: Profile, fit: ServingFit, *, measured_at: str,
                           command: str, conditions: str) -> Profile:
    """`profile` with the fitted overhead added to `decode_s` and `prefill_s`; the same
    format, with `source` and `notes` saying what was added and from which points."""
    added = {b: fit.decode_overhead_s(b) for b in profile.decode_batch_sizes}
    decode_s = [[t + added[b] for t in row]
                for b, row in zip(profile.decode_batch_sizes, profile.decode_s, strict=True)]
    prefill_s = [t + fit.prefill_overhead_s for t in profile.prefill_s]
    record = {
        "measured_at": measured_at,
        "command": command,
        "conditions": conditions,
        "decode_overhead": {"intercept_s": fit.intercept_s, "per_seq_s": fit.per_seq_s,
                            "added_s_by_batch_size": {str(b): s for b, s in added.items()}},
        "prefill_overhead_s": fit.prefill_overhead_s,
        "decode_points": [{**asdict(c.point), "in_process_s": c.in_process_s}
                          for c in fit.decode],
        "prefill_points": [{**asdict(c.point), "in_process_s": c.in_process_s}
                           for c in fit.prefill],
        "in_process_source": profile.source,
    }
    summary = (f"serving-calibrated {measured_at}: decode_s[i][j] += max(0, "
               f"{fit.intercept_s * 1e3:.2f} ms + {fit.per_seq_s * 1e3:.3f} ms x b_i), "
               f"prefill_s += {fit.prefill_overhead_s * 1e3:.2f} ms, attention_s unchanged "
               f"(measured through weaver serve; notes.{NOTES_KEY})")
    notes = {**profile.notes, NOTES_KEY: json.dumps(record), "serving_overhead": summary}
    return replace(profile, source=f"{profile.source}; {summary}", decode_s=decode_s,
                   prefill_s=prefill_s, notes=notes)


@dataclass(frozen=True)
class ServingPlan:
    """What the serving probe sends. Defaults keep SmolLM2-135M on one core at about two
    minutes of requests (the in-process profile's steps: ~80 ms at batch 1, ~220 ms at 32)
    and fit a `dedicated.yaml`-like engine (blocks of 32 tokens, 512-token sequences)."""

    batch_sizes: tuple[int, ...] = (1, 4, 16, 32)
    prompt_tokens: int = 32  # per request of a decode point: short, so prefill is cheap
    output_tokens: int = 64  # long enough that one early or late step barely moves TPOT
    decode_repeats: int = 2  # each repeat is a point of its own in the fit
    prefill_prompt_tokens: tuple[int, ...] = (64, 256)
    prefill_repeats: int = 3
    # A few tokens, not 1: the client's TTFT is its first chunk with text, and the stream
    # must carry some text even when the first token decodes to none.
    prefill_output_tokens: int = 4
    block_size: int = 32
    max_model_len: int = 512

    def __post_init__(self) -> None:
        if len(set(self.batch_sizes)) < 2 or min(self.batch_sizes) < 1:
            raise ValueError("batch sizes: the overhead line needs >= 2 distinct sizes >= 1, "
                             f"got {self.batch_sizes}")
        if self.output_tokens < 3:
            raise ValueError(f"output tokens must be >= 3 for a TPOT, got {self.output_tokens}")
        if not self.prefill_prompt_tokens or min(self.prefill_prompt_tokens) < 1:
            raise ValueError("prefill prompt lengths must be >= 1 token, got "
                             f"{self.prefill_prompt_tokens}")
        if min(self.prompt_tokens, self.decode_repeats, self.prefill_repeats,
               self.prefill_output_tokens, self.block_size) < 1:
            raise ValueError("prompt and output tokens, repeats and block size must be >= 1")
        # Slack of 8: synthetic prompts come out a few tokens off the requested length.
        longest = max(self.prompt_tokens + self.output_tokens,
                      max(self.prefill_prompt_tokens) + self.prefill_output_tokens) + 8
        if longest > self.max_model_len:
            raise ValueError(f"a request of up to {longest} tokens does not fit max_model_len "
                             f"{self.max_model_len}")

    def blocks_per_request(self) -> int:
        """KV blocks one decode point's request holds (a whole number of blocks; slack of
        8 tokens, as synthetic prompts come out a few tokens off)."""
        return blocks_for(self.prompt_tokens + self.output_tokens + 8, self.block_size)

    def kv_blocks(self) -> int:
        """KV blocks the largest decode point holds (one sequence is a whole number of
        blocks of at most max_model_len tokens)."""
        return max(self.batch_sizes) * self.blocks_per_request()

    def estimate_s(self, profile: Profile) -> float:
        """Seconds of requests by the in-process profile: a lower bound (serving adds)."""
        perf = PerfModel(profile)
        decode = 0.0
        for b in self.batch_sizes:
            context = b * (self.prompt_tokens + self.output_tokens // 2)
            decode += (perf.prefill_time(b * self.prompt_tokens)
                       + (self.output_tokens - 1) * perf.decode_time(b, context))
        prefill = sum(perf.prefill_time(n)
                      + (self.prefill_output_tokens - 1) * perf.decode_time(1, n)
                      for n in self.prefill_prompt_tokens)
        return self.decode_repeats * decode + self.prefill_repeats * prefill


def _check_positive(what: str, value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{what} must be a finite time > 0 s, got {value}")
