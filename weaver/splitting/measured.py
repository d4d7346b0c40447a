"""A cold model's split profile from what its engines measured (the vLLM-free half of
weaver/vllm_ext/engine/split_profiler.py, which runs the engines): the measurement's
settings, the pair it is for, and the raw operator profile (weaver/vllm_ext/engine/
op_profiler.py) turned into the planner's timings (weaver/splitting/profile.py)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from weaver.config.deployment import Deployment, ModelSpec, Role
from weaver.splitting.profile import PER_LAYER_OP_NAMES, OpTiming

# Smallest chunk of output rows the planner may cut a GEMM into: below this a chunk is
# bound by its launch and poll, not by its work.
MIN_CHUNK_ROWS = 16


@dataclass(frozen=True)
class MeasureSettings:
    batch: int = 8  # cold decode batch
    hot_batch: int = 16  # hot decode batch (local + remote sequences)
    prompt_len: int = 128
    decode_tokens: int = 32

    def __post_init__(self) -> None:
        for name in ("batch", "hot_batch", "prompt_len", "decode_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.decode_tokens < 4:
            raise ValueError("decode_tokens must be >= 4: the first decode steps are dropped "
                             "as warm-up")

    @property
    def context_len(self) -> int:
        """Mean context of a decode step."""
        return self.prompt_len + self.decode_tokens // 2


def pair_of(deployment: Deployment, cold_name: str) -> tuple[ModelSpec, ModelSpec, float]:
    """The cold model, the hot model weaving into it, and its offload ratio."""
    cold = deployment.model(cold_name)
    if cold.role is not Role.COLD:
        raise ValueError(f"model {cold_name!r} has role {cold.role.value!r}; only a cold model "
                         "is profiled for splitting")
    for pair in deployment.weaving:
        if cold_name in pair.cold:
            if isinstance(pair.offload_ratio, str):
                raise ValueError(
                    f"weaving {pair.hot!r} -> {cold_name!r} has offload_ratio "
                    f"{pair.offload_ratio!r}: the split profile sizes the hot task by a fixed "
                    "share of remote sequences; give the pair one for profiling (e.g. "
                    "offload_ratio: 0.5)")
            return cold, deployment.model(pair.hot), pair.offload_ratio
    raise ValueError(f"cold model {cold_name!r} is in no weaving entry: the profile needs the "
                     "hot model weaving into it (its attention sets K and N)")


def decode_samples(raw: dict[str, Any], kind: str, num_seqs: int, name: str) -> list[float]:
    samples = raw["samples"].get(kind, {}).get(str(num_seqs), [])
    per_step = raw["num_layers"] if kind != "lm_head" else 1
    samples = samples[2 * per_step:]  # the first two decode steps warm caches up
    if not samples:
        seen = sorted(int(t) for t in raw["samples"].get(kind, {}))
        raise ValueError(
            f"model {name!r}: no decode step ran all {num_seqs} sequences together (token "
            f"counts seen: {seen}); lower the batch or give the engine more KV cache")
    return samples


def op_timing(name: str, samples: list[float], dim: int, min_chunk: int) -> OpTiming:
    return OpTiming(name=name, mean_s=statistics.fmean(samples),
                    p50_s=statistics.median(samples), num_samples=len(samples),
                    split_dim_size=dim, min_chunk_size=min(min_chunk, dim))


def op_timings(raw: dict[str, Any], batch: int, name: str) -> tuple[list[OpTiming], OpTiming]:
    layer_ops = []
    for kind in PER_LAYER_OP_NAMES:
        samples = decode_samples(raw, kind, batch, name)
        if kind == "attn":
            # Attention splits into groups of whole sequences (attention/backend.py): at
            # most one chunk per sequence of the batch.
            layer_ops.append(op_timing(kind, samples, batch, 1))
        else:
            layer_ops.append(op_timing(kind, samples, raw["split_dims"][kind], MIN_CHUNK_ROWS))
    lm_head = op_timing("lm_head", decode_samples(raw, "lm_head", batch, name),
                      raw["split_dims"]["lm_head"], MIN_CHUNK_ROWS)
    return layer_ops, lm_head


def step_s(raw: dict[str, Any], num_seqs: int, name: str) -> float:
    ends = raw["lm_head_ends"].get(str(num_seqs), [])[2:]
    gaps = [b - a for a, b in zip(ends, ends[1:], strict=False)]
    if not gaps:
        raise ValueError(f"model {name!r}: too few decode steps of the full batch to time an "
                         "iteration; raise decode_tokens")
    return statistics.median(gaps)
