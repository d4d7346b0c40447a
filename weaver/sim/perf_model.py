"""Step-time model built from a `Profile`, plus the costs of weaving and phase splitting.

Interpolation (documented choice):
- prefill time: piecewise-linear in batch tokens, linear extrapolation past either end;
- decode-step time: bilinear over (batch size, total context tokens) on the profile's
  grid, linear extrapolation past the grid (a step is dense GEMMs that grow with batch
  size plus attention that grows with context, so each axis is close to linear);
- decode attention alone: piecewise-linear in context tokens (what a remote device
  spends on offloaded attention).
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable
from dataclasses import dataclass

from weaver.sim.profile import ModelShape, Profile
from weaver.splitting.profile import LM_HEAD_NAME, PER_LAYER_OP_NAMES


class PiecewiseLinear:
    """y(x) through sorted points; extrapolates linearly from the two end segments."""

    def __init__(self, xs: list[float], ys: list[float]) -> None:
        if len(xs) < 2 or len(xs) != len(ys):
            raise ValueError("piecewise-linear needs >= 2 points and as many xs as ys")
        self.xs = [float(x) for x in xs]
        self.ys = [float(y) for y in ys]

    def segment(self, x: float) -> tuple[int, float]:
        """Index i of the segment [xs[i], xs[i+1]] used for x and the weight of xs[i+1]."""
        i = bisect.bisect_right(self.xs, x) - 1
        i = min(max(i, 0), len(self.xs) - 2)
        x0, x1 = self.xs[i], self.xs[i + 1]
        return i, (x - x0) / (x1 - x0)

    def __call__(self, x: float) -> float:
        i, w = self.segment(x)
        return self.ys[i] + w * (self.ys[i + 1] - self.ys[i])


class Bilinear:
    """z(x, y) on a grid; bilinear inside, linear extrapolation outside."""

    def __init__(self, xs: list[float], ys: list[float], zs: list[list[float]]) -> None:
        self.x_axis = PiecewiseLinear(xs, [0.0] * len(xs))
        self.y_axis = PiecewiseLinear(ys, [0.0] * len(ys))
        self.zs = zs

    def __call__(self, x: float, y: float) -> float:
        i, wx = self.x_axis.segment(x)
        j, wy = self.y_axis.segment(y)
        z = self.zs
        low = z[i][j] + wy * (z[i][j + 1] - z[i][j])
        high = z[i + 1][j] + wy * (z[i + 1][j + 1] - z[i + 1][j])
        return low + wx * (high - low)


class PerfModel:
    """Step times of one model on one device, interpolated from its profile."""

    def __init__(self, profile: Profile) -> None:
        self.profile = profile
        self.shape: ModelShape = profile.shape
        self._prefill = PiecewiseLinear(profile.prefill_tokens, profile.prefill_s)
        self._decode = Bilinear(
            profile.decode_batch_sizes, profile.decode_context_tokens, profile.decode_s
        )
        self._attention = PiecewiseLinear(profile.attention_context_tokens,
                                          profile.attention_s)

    def prefill_time(self, num_tokens: int) -> float:
        return max(self._prefill(num_tokens), 0.0)

    def decode_time(self, num_seqs: int, num_context_tokens: int) -> float:
        return max(self._decode(num_seqs, num_context_tokens), 0.0)

    def attention_time(self, num_context_tokens: int) -> float:
        """Decode attention over all layers for a batch holding that many tokens."""
        if num_context_tokens <= 0:
            return 0.0
        return max(self._attention(num_context_tokens), 0.0)

    def kv_bytes(self, num_tokens: int) -> int:
        return num_tokens * self.shape.kv_bytes_per_token

    def woven_step_overhead(self, num_remote_seqs: int) -> float:
        """The hot side's own cost of a step with remote sequences, beyond what
        `OffloadCostModel` prices (the profile's `woven_step_*` fields; 0 unless measured).
        Clamped at 0, as a woven step cannot cost less than its modelled parts."""
        if num_remote_seqs <= 0:
            return 0.0
        return max(0.0, self.profile.woven_step_intercept_s
                   + self.profile.woven_step_per_remote_seq_s * num_remote_seqs)


# The period of the cold side's idle poller that the model assumes (a GPU poller checking
# the task counter): a task that finds the cold side idle waits half of it on average. One
# value for the simulator's deployments and the weaving calibration.
IDLE_POLL_INTERVAL_S = 50e-6


@dataclass(frozen=True)
class PollContext:
    """What the cold side looks like to an arriving offloaded attention task.

    The cold model's operator times in its current step are `step_s` times
    `operator_fractions` (kept apart so the fractions, fixed per model, are built once)."""

    step_s: float
    operator_fractions: tuple[float, ...]  # sum to 1, in execution order
    busy_fraction: float  # share of time the cold device is running its own steps
    idle_poll_interval_s: float  # period of the idle poller when the cold is idle

    @property
    def operator_s(self) -> list[float]:
        return [self.step_s * f for f in self.operator_fractions]


PollWaitFn = Callable[[PollContext], float]


def mg1_poll_wait(ctx: PollContext) -> float:
    """Expected wait of a task for the next poll point (M/G/1 residual-service formula).

    A task arrives at a random instant. With probability `busy_fraction` the cold device
    is inside one of its operators, chosen with probability proportional to its length,
    and the task waits the residual of that operator: E[R] = E[T^2] / (2 E[T]) (the
    length-biased residual of renewal theory, as in the M/G/1 Pollaczek-Khinchine mean).
    Otherwise the idle poller sees it after half a polling period on average. A long
    operator contributes quadratically, as in Weaver's polling-system model; another model
    (e.g. weaver.splitting.queueing's) replaces this default through the `PollWaitFn` hook.
    """
    residual = ctx.step_s * _residual_fraction(ctx.operator_fractions)
    rho = min(max(ctx.busy_fraction, 0.0), 1.0)
    return rho * residual + (1.0 - rho) * ctx.idle_poll_interval_s / 2


@functools.lru_cache(maxsize=64)
def _residual_fraction(fractions: tuple[float, ...]) -> float:
    """E[T^2] / (2 E[T]) for operator times given as fractions of one step."""
    total = sum(fractions)
    return sum(f * f for f in fractions) / (2 * total) if total > 0 else 0.0


@dataclass(frozen=True)
class LinkModel:
    """A device-to-device link: time = latency + bytes / bandwidth."""

    bandwidth_bps: float
    latency_s: float

    def transfer_time(self, num_bytes: float) -> float:
        if num_bytes <= 0:
            return 0.0
        return self.latency_s + num_bytes / self.bandwidth_bps


class OffloadCostModel:
    """Extra hot-step time of weaving, per decode step (Weaver §3).

    Every layer the hot side sends q and the new k/v of its remote sequences, runs its
    local attention meanwhile, then waits for the remote outputs. Per layer the step grows
    by max(0, send + poll wait + remote attention + receive - local attention); per step
    by the hot profile's measured woven-step overhead (`PerfModel.woven_step_overhead`)."""

    def __init__(self, hot: PerfModel, remote: PerfModel, link: LinkModel,
                 poll_wait_fn: PollWaitFn = mg1_poll_wait) -> None:
        self.hot = hot
        self.remote = remote
        self.link = link
        self.poll_wait_fn = poll_wait_fn

    def step_overhead(self, num_remote_seqs: int, num_remote_context: int,
                      num_local_context: int, poll: PollContext) -> float:
        if num_remote_seqs == 0:
            return 0.0
        shape = self.hot.shape
        layers = shape.num_layers
        q_bytes = num_remote_seqs * shape.num_heads * shape.head_size * shape.dtype_bytes
        kv_bytes = 2 * num_remote_seqs * shape.num_kv_heads * shape.head_size \
            * shape.dtype_bytes
        send = self.link.transfer_time(q_bytes + kv_bytes)
        receive = self.link.transfer_time(q_bytes)  # outputs have q's shape
        remote = self.remote.attention_time(num_remote_context) / layers
        # The hot's local attention is priced from the same table: it too reads its K/V
        # from memory. An `--engine` profile times that table as offloaded tasks, so local
        # attention also pays the channel's share (0.11-0.13 ms per task on the benchmark
        # CPU, benchmarks/README.md).
        local = self.hot.attention_time(num_local_context) / layers
        wait = self.poll_wait_fn(poll)
        return (layers * max(0.0, send + wait + remote + receive - local)
                + self.hot.woven_step_overhead(num_remote_seqs))

    def remote_busy_time(self, num_remote_context: int) -> float:
        """Time the cold device spends per hot step running offloaded attention."""
        return self.remote.attention_time(num_remote_context)


def kv_transfer_time(perf: PerfModel, link: LinkModel, num_tokens: int) -> float:
    """Splitwise KV transfer of a prompt's cache from the prompt to the token machine."""
    return link.transfer_time(perf.kv_bytes(num_tokens))


@functools.lru_cache(maxsize=64)
def operator_fractions(shape: ModelShape) -> tuple[float, ...]:
    """A decode step's operator times as fractions of the step, proportional to their
    weight bytes (decode is memory bound)."""
    weights = shape.operator_weight_bytes()
    total = sum(weights)
    return tuple(w / total for w in weights)


# The operator kinds of `ModelShape.operator_weight_bytes`, per layer in its order, then
# the LM head, named as a split plan names them (weaver/splitting/profile.py); attention
# holds no weights, so the weight-bytes model has no entry for it.
PER_LAYER_KINDS = tuple(name for name in PER_LAYER_OP_NAMES if name != "attn")
LM_HEAD_KIND = LM_HEAD_NAME


def _kind_sizes(shape: ModelShape) -> dict[str, int]:
    """The dimension each kind is cut along: its output features (the vocabulary for the
    LM head), as the split layers cut it (weaver/vllm_ext/layers.py)."""
    h, d = shape.hidden_size, shape.head_size
    return {"qkv": (shape.num_heads + 2 * shape.num_kv_heads) * d, "o": h,
            "gate_up": 2 * shape.intermediate_size, "down": h, LM_HEAD_KIND: shape.vocab_size}


def split_operator_fractions(shape: ModelShape, chunks: tuple[tuple[str, int], ...]
                             ) -> tuple[float, ...]:
    """`operator_fractions` with each operator of a split kind cut into its chunks (equal
    parts: the split layers cut the output features evenly)."""
    by_kind = dict(chunks)
    kinds = [*PER_LAYER_KINDS * shape.num_layers, LM_HEAD_KIND]
    out: list[float] = []
    for kind, fraction in zip(kinds, operator_fractions(shape), strict=True):
        n = by_kind.get(kind, 1)
        out += [fraction / n] * n
    return tuple(out)


def plan_cold_split(cold: PerfModel, hot: PerfModel, chunk_overhead_s: float,
                    threshold_share: float = 0.05) -> dict[str, int]:
    """Algorithm 1 (weaver/splitting/algorithm.py) over the cold model's modelled decode
    operators at batch 1: chunks per kind until the expected wait of a task is at most
    `threshold_share` of the hot model's decode step (the Weaver paper's 5 %), each chunk
    costing `chunk_overhead_s`."""
    from weaver.splitting.algorithm import OperatorSpec, SplitConfig, plan_split

    shape = cold.shape
    step_s = cold.decode_time(1, 0)
    fractions = operator_fractions(shape)
    sizes = _kind_sizes(shape)
    per_layer = len(PER_LAYER_KINDS)
    ops = [OperatorSpec(kind, step_s * fractions[i], sizes[kind], shape.num_layers)
           for i, kind in enumerate(PER_LAYER_KINDS)]
    ops.append(OperatorSpec(LM_HEAD_KIND, step_s * fractions[per_layer * shape.num_layers],
                            sizes[LM_HEAD_KIND]))
    hot_attention_s = hot.attention_time(1024) / hot.shape.num_layers
    config = SplitConfig(threshold_s=threshold_share * hot.decode_time(1, 0),
                         local_attention_s=hot_attention_s,
                         remote_attention_s=hot_attention_s, overhead_s=chunk_overhead_s)
    return {kind: n for kind, n in plan_split(ops, config).chunks.items() if n > 1}
