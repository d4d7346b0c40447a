"""Performance profiles: one JSON format for measured and roofline-derived step times.

The format is documented in `weaver/sim/PROFILE_FORMAT.md`. A profile holds, for one model
shape on one device, measured points of prefill time over batch tokens, decode-step time
over (batch size, total context tokens), and decode attention time over context tokens.
The roofline generator fills the same format from published device specs so that the
simulator runs before any measured profile exists.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

PROFILE_FORMAT_VERSION = 1


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer, Llama-style (GQA attention, gated MLP)."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    intermediate_size: int
    vocab_size: int
    dtype_bytes: int = 2

    @property
    def num_params(self) -> int:
        h, d = self.hidden_size, self.head_size
        attn = h * (self.num_heads + 2 * self.num_kv_heads) * d + self.num_heads * d * h
        mlp = 3 * h * self.intermediate_size
        # Input embedding and LM head are separate matrices (untied), as in Llama-3-8B.
        return self.num_layers * (attn + mlp) + 2 * self.vocab_size * h

    @property
    def params_bytes(self) -> int:
        return self.num_params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_size * self.dtype_bytes

    def operator_weight_bytes(self) -> list[int]:
        """Weight bytes of each decode operator in execution order (one layer's qkv, o,
        gate/up, down, repeated, then the LM head). Decode is memory bound, so these are
        proportional to operator times; the poll-wait model uses them (Weaver §4)."""
        h, d = self.hidden_size, self.head_size
        per_layer = [
            h * (self.num_heads + 2 * self.num_kv_heads) * d,
            self.num_heads * d * h,
            2 * h * self.intermediate_size,
            h * self.intermediate_size,
        ]
        ops = per_layer * self.num_layers + [h * self.vocab_size]
        return [n * self.dtype_bytes for n in ops]


@dataclass(frozen=True)
class DeviceSpec:
    """Published peak numbers of one accelerator, with where they come from."""

    name: str
    memory_bytes: int
    memory_bandwidth_bps: float  # bytes per second
    peak_flops: float  # dense bf16 FLOP/s
    link_bandwidth_bps: float  # device-to-device link used for offload / KV transfer
    link_latency_s: float
    citation: str


GB = 1e9
GIB = 1 << 30

# Published specs (dense bf16, no sparsity). Sources are in `citation`.
KNOWN_DEVICES: dict[str, DeviceSpec] = {
    "A100-80GB": DeviceSpec(
        "A100-80GB", 80 * GIB, 2039 * GB, 312e12, 300 * GB, 5e-6,
        "NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB): 2039 GB/s HBM2e, "
        "312 TFLOP/s bf16 dense, NVLink 600 GB/s bidirectional",
    ),
    # The Weaver paper's hot/cold experiments ran on A100-40GB (its section 5).
    "A100-40GB": DeviceSpec(
        "A100-40GB", 40 * GIB, 1555 * GB, 312e12, 300 * GB, 5e-6,
        "NVIDIA A100 Tensor Core GPU datasheet (SXM4 40GB): 1555 GB/s HBM2, "
        "312 TFLOP/s bf16 dense, NVLink 600 GB/s bidirectional",
    ),
    "H100-80GB": DeviceSpec(
        "H100-80GB", 80 * GIB, 3350 * GB, 989e12, 450 * GB, 5e-6,
        "NVIDIA H100 Tensor Core GPU datasheet (SXM5): 3.35 TB/s HBM3, "
        "989 TFLOP/s bf16 dense, NVLink 900 GB/s bidirectional",
    ),
    "H200": DeviceSpec(
        "H200", 141 * GB, 4800 * GB, 989e12, 450 * GB, 5e-6,
        "NVIDIA H200 Tensor Core GPU datasheet (SXM): 141 GB HBM3e at 4.8 TB/s, "
        "989 TFLOP/s bf16 dense (as H100 SXM), NVLink 900 GB/s bidirectional",
    ),
    "L40S": DeviceSpec(
        "L40S", 48 * GIB, 864 * GB, 362e12, 32 * GB, 10e-6,
        "NVIDIA L40S datasheet: 864 GB/s GDDR6, 362 TFLOP/s bf16 dense, "
        "PCIe Gen4 x16 64 GB/s bidirectional",
    ),
}

# A CPU core of this machine: no roofline (no published peaks to cite); its profiles are
# measured with vLLM (`weaver profile --engine`) and its KV capacity is given in blocks.
CPU_DEVICE = "cpu"

KNOWN_SHAPES: dict[str, ModelShape] = {
    "llama-3-8b": ModelShape("llama-3-8b", 32, 4096, 32, 8, 128, 14336, 128256),
    "llama-2-7b": ModelShape("llama-2-7b", 32, 4096, 32, 32, 128, 11008, 32000),
    "llama-2-13b": ModelShape("llama-2-13b", 40, 5120, 40, 40, 128, 13824, 32000),
    "mistral-7b": ModelShape("mistral-7b", 32, 4096, 32, 8, 128, 14336, 32000),
    "qwen2.5-3b": ModelShape("qwen2.5-3b", 36, 2048, 16, 2, 128, 11008, 151936),
    # HuggingFaceTB/SmolLM2-135M(-Instruct) config.json, float32 as served on CPU here. Its
    # embedding and LM head are tied; `num_params` counts them twice (only KV-from-memory
    # capacity would use it, and CPU clusters give KV in blocks).
    "smollm2-135m": ModelShape("smollm2-135m", 30, 576, 9, 3, 64, 1536, 49152, dtype_bytes=4),
    # Small enough to time on a laptop CPU in seconds; used by `weaver profile`.
    "tiny": ModelShape("tiny", 2, 256, 4, 2, 64, 688, 1024, dtype_bytes=4),
    "small": ModelShape("small", 4, 512, 8, 4, 64, 1376, 4096, dtype_bytes=4),
}


@dataclass
class Profile:
    """Step times of one model shape on one device. Times in seconds."""

    device: str
    shape: ModelShape
    source: str  # "measured on ..." or "roofline from published specs: ..."
    memory_bytes: int
    prefill_tokens: list[int]
    prefill_s: list[float]
    decode_batch_sizes: list[int]
    decode_context_tokens: list[int]  # total context tokens of the whole batch
    decode_s: list[list[float]]  # [batch index][context index]
    attention_context_tokens: list[int]
    attention_s: list[float]  # decode attention over all layers for that many tokens
    link_bandwidth_bps: float = 64 * GB
    link_latency_s: float = 10e-6
    # What a woven step of this model pays beyond `OffloadCostModel`'s transfer, wait and
    # remote-attention terms (splitting the batch, submitting tasks, merging the outputs):
    # max(0, intercept + per_remote_seq x remote sequences), per step with remote
    # sequences. Zero unless measured (`weaver profile --calibrate-weaving`).
    woven_step_intercept_s: float = 0.0
    woven_step_per_remote_seq_s: float = 0.0
    version: int = PROFILE_FORMAT_VERSION
    notes: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        _check_axis("prefill_tokens", self.prefill_tokens, self.prefill_s)
        _check_axis("attention_context_tokens", self.attention_context_tokens,
                    self.attention_s)
        _check_axis("decode_batch_sizes", self.decode_batch_sizes, self.decode_s)
        for row in self.decode_s:
            _check_axis("decode_context_tokens", self.decode_context_tokens, row)
        for name in ("woven_step_intercept_s", "woven_step_per_remote_seq_s"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"profile field {name} must be a finite number of seconds")
        if self.version != PROFILE_FORMAT_VERSION:
            raise ValueError(
                f"profile format version {self.version} is not supported (expected "
                f"{PROFILE_FORMAT_VERSION}); regenerate it with `weaver profile`"
            )

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Profile:
        try:
            shape = ModelShape(**data["shape"])
            return cls(**{**data, "shape": shape})
        except (KeyError, TypeError) as exc:
            raise ValueError(
                f"not a Weaver profile ({exc}); see weaver/sim/PROFILE_FORMAT.md for the "
                "fields"
            ) from exc

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        return cls.from_dict(json.loads(Path(path).read_text()))


def _check_axis(name: str, axis: list, values: list) -> None:
    if len(axis) < 2:
        raise ValueError(f"profile axis {name} needs at least 2 points, got {len(axis)}")
    if any(b <= a for a, b in zip(axis, axis[1:], strict=False)):
        raise ValueError(f"profile axis {name} must be strictly increasing: {axis}")
    if len(values) != len(axis):
        raise ValueError(f"profile axis {name} has {len(axis)} points but {len(values)} values")


def get_shape(name: str) -> ModelShape:
    if name not in KNOWN_SHAPES:
        raise ValueError(f"unknown model shape {name!r}; choose one of {sorted(KNOWN_SHAPES)}")
    return KNOWN_SHAPES[name]


def get_device(name: str) -> DeviceSpec:
    if name not in KNOWN_DEVICES:
        raise ValueError(f"unknown device {name!r}; choose one of {sorted(KNOWN_DEVICES)}")
    return KNOWN_DEVICES[name]


@dataclass(frozen=True)
class RooflineEfficiency:
    """Fractions of peak reached in practice; the defaults are typical of vLLM on A100
    (decode reaches ~80 % of HBM bandwidth, prefill ~60 % of tensor-core peak)."""

    bandwidth: float = 0.8
    flops: float = 0.6
    step_overhead_s: float = 2e-3  # scheduler + launch overhead per iteration
    per_layer_attention_overhead_s: float = 5e-6


def roofline_profile(
    shape: ModelShape, device: DeviceSpec, eff: RooflineEfficiency | None = None
) -> Profile:
    """Step times as max(compute, memory) time from the device's published peaks."""
    eff = eff or RooflineEfficiency()
    bw = device.memory_bandwidth_bps * eff.bandwidth
    flops = device.peak_flops * eff.flops
    weights = shape.params_bytes

    def attention_s(num_context_tokens: int) -> float:
        return (num_context_tokens * shape.kv_bytes_per_token / bw
                + shape.num_layers * eff.per_layer_attention_overhead_s)

    def prefill_s(num_tokens: int) -> float:
        dense = 2 * shape.num_params * num_tokens
        # Causal self-attention: QK^T and PV over half the square, all heads and layers.
        attn = 2 * shape.num_layers * shape.num_heads * shape.head_size * num_tokens**2
        return max((dense + attn) / flops, weights / bw) + eff.step_overhead_s

    def decode_s(batch: int, context: int) -> float:
        dense = max(2 * shape.num_params * batch / flops, weights / bw)
        return dense + attention_s(context) + eff.step_overhead_s

    prefill_tokens = [2**i for i in range(0, 15)]
    batch_sizes = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
    contexts = [0] + [2**i for i in range(10, 21)]
    return Profile(
        device=device.name,
        shape=shape,
        source=f"roofline from published specs: {device.citation}; efficiency "
               f"{eff.bandwidth:.0%} of bandwidth, {eff.flops:.0%} of FLOP/s",
        memory_bytes=device.memory_bytes,
        prefill_tokens=prefill_tokens,
        prefill_s=[prefill_s(n) for n in prefill_tokens],
        decode_batch_sizes=batch_sizes,
        decode_context_tokens=contexts,
        decode_s=[[decode_s(b, c) for c in contexts] for b in batch_sizes],
        attention_context_tokens=contexts,
        attention_s=[attention_s(c) for c in contexts],
        link_bandwidth_bps=device.link_bandwidth_bps,
        link_latency_s=device.link_latency_s,
    )


def allreduce_s(num_bytes: float, tp: int, link_bandwidth_bps: float,
                latency_s: float) -> float:
    """A ring all-reduce of `num_bytes` over `tp` devices: 2 (tp - 1) / tp of the bytes
    cross each link, in 2 (tp - 1) latency-bound hops."""
    if tp <= 1:
        return 0.0
    hops = 2 * (tp - 1)
    return hops / tp * num_bytes / link_bandwidth_bps + hops * latency_s


def tensor_parallel_profile(profile: Profile, tp: int, allreduce_latency_s: float) -> Profile:
    """`profile` sharded over `tp` devices (Megatron-style, as vLLM's tensor parallelism
    runs a model): each step's work split `tp` ways, plus two all-reduces of the step's
    hidden states per layer over the devices' link (its bandwidth from the profile); `tp`
    times the memory. The cost MuxServe pays to spread a model over a GPU mesh."""
    if tp == 1:
        return profile
    shape = profile.shape
    hidden_bytes = shape.hidden_size * shape.dtype_bytes

    def comm_s(num_tokens: int) -> float:
        return 2 * shape.num_layers * allreduce_s(
            num_tokens * hidden_bytes, tp, profile.link_bandwidth_bps, allreduce_latency_s)

    return replace(
        profile, source=f"{profile.source}; tensor parallel x{tp}",
        memory_bytes=profile.memory_bytes * tp,
        prefill_s=[t / tp + comm_s(n) for n, t in zip(profile.prefill_tokens,
                                                        profile.prefill_s, strict=True)],
        decode_s=[[t / tp + comm_s(b) for t in row]
                  for b, row in zip(profile.decode_batch_sizes, profile.decode_s, strict=True)],
        attention_s=[t / tp for t in profile.attention_s])


def blocks_for(num_tokens: int, block_size: int) -> int:
    return math.ceil(num_tokens / block_size)
