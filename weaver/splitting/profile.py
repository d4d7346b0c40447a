"""The operator profile that CPU and GPU profilers write and the splitter reads.

One JSON file per (cold model, device, workload point)::

    {
      "schema_version": 1,
      "model": "HuggingFaceTB/SmolLM2-135M-Instruct",
      "device": "cpu",
      "num_layers": 30,
      "layer_ops": [
        {"name": "qkv", "mean_s": 2.1e-05, "p50_s": 2.0e-05, "num_samples": 50,
         "split_dim_size": 960},
        ... one entry each for "qkv", "attn", "o", "gate_up", "down"
      ],
      "lm_head": {"name": "lm_head", "mean_s": 4.0e-04, "p50_s": 3.9e-04,
                  "num_samples": 50, "split_dim_size": 49152},
      "hot": {"local_attention_s": 3.0e-04, "remote_attention_s": 1.0e-04,
              "step_s": 2.0e-02},
      "split_overhead_s": 5.0e-06,
      "notes": "cold batch 8, context 512"
    }

Times are seconds. ``split_dim_size`` is the dimension a chunk is cut along: output
features for the linear layers and the LM head (vocabulary), sequences for attention
(docs/architecture.md, part 7). ``hot`` holds the hot side's per-layer local attention ``K``,
one remote attention task ``N`` and one hot decode iteration (for the threshold).
``split_overhead_s`` is the measured cost of one extra chunk, if the profiler measured it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from weaver.splitting.algorithm import DEFAULT_THRESHOLD_FRAC, OperatorSpec, SplitConfig

PROFILE_SCHEMA_VERSION = 1
# The per-layer operators of a Llama-style decoder layer, in execution order
# (vLLM model_executor/models/llama.py: qkv_proj, attn, o_proj, gate_up_proj, down_proj).
PER_LAYER_OP_NAMES = ("qkv", "attn", "o", "gate_up", "down")
LM_HEAD_NAME = "lm_head"

Statistic = Literal["mean", "p50"]


class TimingSummary(Protocol):
    """What a timer reports of one operator (weaver.profiling.timer.TimingStats has it)."""

    mean_s: float
    p50_s: float
    num_samples: int


def _check_seconds(value: float, label: str) -> float:
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{label} must be a positive, finite number of seconds, got {value!r}")
    return value


class OpTiming(BaseModel):
    """Measured time of one operator (one instance, unsplit)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1)
    mean_s: float
    p50_s: float
    num_samples: int = Field(ge=1)
    split_dim_size: int = Field(ge=1)
    min_chunk_size: int = Field(default=1, ge=1)

    @field_validator("mean_s", "p50_s")
    @classmethod
    def _positive_time(cls, value: float) -> float:
        return _check_seconds(value, "an operator time")

    @classmethod
    def from_stats(
        cls, name: str, stats: TimingSummary, split_dim_size: int, min_chunk_size: int = 1
    ) -> OpTiming:
        """Build an entry from a timer's result (weaver.profiling.timer.measure)."""
        return cls(
            name=name,
            mean_s=stats.mean_s,
            p50_s=stats.p50_s,
            num_samples=stats.num_samples,
            split_dim_size=split_dim_size,
            min_chunk_size=min_chunk_size,
        )

    def time_s(self, statistic: Statistic) -> float:
        return self.mean_s if statistic == "mean" else self.p50_s


class HotTiming(BaseModel):
    """The hot side's times that decide when a waiting task blocks it (paper §4.2)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    local_attention_s: float  # K, per layer
    remote_attention_s: float  # N, one offloaded task on the cold device
    step_s: float  # one hot decode iteration

    @field_validator("local_attention_s", "remote_attention_s", "step_s")
    @classmethod
    def _positive_time(cls, value: float) -> float:
        return _check_seconds(value, "a hot-side time")


class SplitProfile(BaseModel):
    """Everything Algorithm 1 needs, measured on one cold model and its hot partner."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: Literal[1] = PROFILE_SCHEMA_VERSION
    model: str = Field(min_length=1)
    device: str = Field(min_length=1)
    num_layers: int = Field(ge=1)
    layer_ops: list[OpTiming]
    lm_head: OpTiming
    hot: HotTiming
    split_overhead_s: float | None = Field(default=None, ge=0)
    notes: str = ""

    @field_validator("layer_ops")
    @classmethod
    def _canonical_layer_ops(cls, ops: list[OpTiming]) -> list[OpTiming]:
        names = [op.name for op in ops]
        if sorted(names) != sorted(PER_LAYER_OP_NAMES):
            raise ValueError(
                f"layer_ops must hold exactly one entry for each of {list(PER_LAYER_OP_NAMES)} "
                f"(the names the cold worker splits by), got {names}"
            )
        return ops

    @field_validator("lm_head")
    @classmethod
    def _lm_head_name(cls, op: OpTiming) -> OpTiming:
        if op.name != LM_HEAD_NAME:
            raise ValueError(f"lm_head entry must be named {LM_HEAD_NAME!r}, got {op.name!r}")
        return op

    def operator_specs(self, statistic: Statistic = "mean") -> list[OperatorSpec]:
        """The operators of one cold decode step: each per-layer operator runs
        ``num_layers`` times, the LM head once."""
        layer_specs = [_spec(op, statistic, self.num_layers) for op in self.layer_ops]
        return [*layer_specs, _spec(self.lm_head, statistic, 1)]

    def op_times(self, statistic: Statistic = "mean") -> list[float]:
        """The unsplit cold timeline of one decode step, layer by layer, then the LM head."""
        per_layer = [op.time_s(statistic) for op in self.layer_ops]
        return per_layer * self.num_layers + [self.lm_head.time_s(statistic)]

    def split_config(
        self,
        threshold_frac: float = DEFAULT_THRESHOLD_FRAC,
        overhead_s: float | None = None,
        arrival_rate: float = 0.0,
    ) -> SplitConfig:
        """Algorithm 1's settings: threshold as a fraction of the hot iteration, K and N
        from ``hot``, the split overhead from the argument, else the profile, else 0."""
        if not 0 < threshold_frac < 1:
            raise ValueError(
                f"threshold_frac={threshold_frac!r} must be in (0, 1); 0.05 means W under 5 % "
                "of the hot iteration time"
            )
        if overhead_s is None:
            overhead_s = self.split_overhead_s or 0.0
        return SplitConfig(
            threshold_s=threshold_frac * self.hot.step_s,
            local_attention_s=self.hot.local_attention_s,
            remote_attention_s=self.hot.remote_attention_s,
            overhead_s=overhead_s,
            arrival_rate=arrival_rate,
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.model_dump_json(indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> SplitProfile:
        """Read and validate a profile; every problem is a ValueError naming the file."""
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError as exc:
            raise ValueError(
                f"profile {path} does not exist: write one with the cold-side profiler"
            ) from exc
        except json.JSONDecodeError as exc:
            raise ValueError(f"profile {path} is not valid JSON: {exc}") from exc
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise ValueError(f"profile {path} is not a valid split profile:\n{exc}") from exc


def _spec(op: OpTiming, statistic: Statistic, num_instances: int) -> OperatorSpec:
    return OperatorSpec(
        name=op.name,
        time_s=op.time_s(statistic),
        split_dim_size=op.split_dim_size,
        num_instances=num_instances,
        min_chunk_size=op.min_chunk_size,
    )
