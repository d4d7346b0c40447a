"""Settings of the offload-channel probe (channel_probe.py). Pure Python, so the CLI can build
its flags from these fields without importing torch."""

from __future__ import annotations

from dataclasses import dataclass

from weaver.offload.layout import HotAttentionShape, RegionLayout
from weaver.offload.naming import DEFAULT_SHM_DIR

EXECUTORS = ("reference", "vllm", "noop")


@dataclass(frozen=True)
class ProbeConfig:
    num_layers: int = 4
    num_q_heads: int = 32
    num_kv_heads: int = 8
    head_size: int = 128
    block_size: int = 128
    dtype: str = "float32"
    num_seqs: int = 8  # remote sequences per task
    seq_len: int = 512  # tokens per remote sequence
    num_tasks: int = 200
    num_warmup_tasks: int = 10
    executor: str = "noop"  # noop isolates the channel; vllm/reference add the kernel
    num_idle_polls: int = 100_000
    shm_prefix: str = "weaver-probe"
    shm_dir: str = DEFAULT_SHM_DIR
    seed: int = 0

    def __post_init__(self) -> None:
        if self.executor not in EXECUTORS:
            raise ValueError(f"executor must be one of {EXECUTORS}, got {self.executor!r}")
        for name in ("num_seqs", "seq_len", "num_tasks", "num_idle_polls"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if self.num_warmup_tasks < 0:
            raise ValueError("num_warmup_tasks must be >= 0")

    @property
    def shape(self) -> HotAttentionShape:
        return HotAttentionShape(
            self.num_layers,
            self.num_q_heads,
            self.num_kv_heads,
            self.head_size,
            self.block_size,
            self.dtype,
        )

    @property
    def layout(self) -> RegionLayout:
        num_blocks_per_seq = -(-self.seq_len // self.block_size)
        return RegionLayout(
            self.shape,
            num_remote_blocks=self.num_seqs * num_blocks_per_seq,
            max_seqs_per_task=self.num_seqs,
            max_blocks_per_seq=num_blocks_per_seq,
        )
