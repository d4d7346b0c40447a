"""What each side of a weaving pair must agree on, computed once from the deployment.

The gateway computes a `PairPlan` per hot→cold pair before any engine starts and hands
it to both engines (vLLM's `additional_config`), so the hot scheduler's remote block
count, the hot worker's view of the region and the cold worker's region are sized by
one formula. Pure Python: reads the hot model's `config.json`, imports no vLLM.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from weaver.config.deployment import Deployment, ModelSpec
from weaver.offload.layout import HotAttentionShape, RegionLayout
from weaver.offload.naming import region_name

GiB = 1 << 30
CPU_DEFAULT_BLOCK_SIZE = 128  # vLLM's default on CPU (platforms/cpu.py)
SHM_PREFIX_ENV = "WEAVER_SHM_PREFIX"


@dataclass(frozen=True)
class PairPlan:
    hot: str
    cold: str
    region_name: str
    shape: HotAttentionShape
    num_remote_blocks: int
    max_seqs_per_task: int
    max_blocks_per_seq: int
    offload_ratio: float
    timeout_s: float

    def layout(self) -> RegionLayout:
        return RegionLayout(
            shape=self.shape,
            num_remote_blocks=self.num_remote_blocks,
            max_seqs_per_task=self.max_seqs_per_task,
            max_blocks_per_seq=self.max_blocks_per_seq,
        )

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> PairPlan:
        return cls(**{**data, "shape": HotAttentionShape(**data["shape"])})


def block_size_of(spec: ModelSpec) -> int:
    return spec.block_size or CPU_DEFAULT_BLOCK_SIZE


def read_attention_shape(model_dir: Path, dtype: str, block_size: int) -> HotAttentionShape:
    """The attention shape of a Hugging Face Llama-family model directory."""
    config_file = model_dir / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read the hot model's {config_file}: {exc}") from None
    num_heads = config["num_attention_heads"]
    head_size = config.get("head_dim") or config["hidden_size"] // num_heads
    return HotAttentionShape(
        num_layers=config["num_hidden_layers"],
        num_q_heads=num_heads,
        num_kv_heads=config.get("num_key_value_heads", num_heads),
        head_size=head_size,
        block_size=block_size,
        dtype=dtype,
    )


def lend_kv_gib_for(num_blocks: int, block_bytes: int) -> str:
    """The `lend_kv_gib` value (as YAML text) that lends exactly `num_blocks` blocks of
    `block_bytes`: rounded up at nine decimals, since `plan_pairs` floors the lent bytes to
    whole blocks and a value rounded down would lend one block fewer."""
    return f"{math.ceil(num_blocks * block_bytes / GiB * 1e9) / 1e9:.9f}"


def default_shm_prefix() -> str:
    # One gateway process owns its pairs' regions; its pid keeps two servers on one
    # machine (tests, benchmarks) apart without a hard-coded name.
    return os.environ.get(SHM_PREFIX_ENV) or f"weaver{os.getpid()}"


def plan_pairs(
    deployment: Deployment, model_dirs: dict[str, Path], shm_prefix: str
) -> list[PairPlan]:
    plans = []
    for pair in deployment.weaving:
        hot = deployment.model(pair.hot)
        if len(pair.cold) != 1:
            raise ValueError(
                f"weaving {pair.hot!r}: one cold model per hot model is supported so far, "
                f"got {pair.cold}"
            )
        cold = deployment.model(pair.cold[0])
        shape = read_attention_shape(model_dirs[hot.name], hot.dtype, block_size_of(hot))
        probe = RegionLayout(shape=shape, num_remote_blocks=1, max_seqs_per_task=1,
                             max_blocks_per_seq=1)
        # kv_block_bytes is one layer's share of a block; a block spans every layer.
        block_bytes = probe.kv_block_bytes * shape.num_layers
        num_remote_blocks = int(cold.lend_kv_gib * GiB) // block_bytes
        max_blocks_per_seq = math.ceil(hot.max_model_len / shape.block_size)
        if num_remote_blocks < max_blocks_per_seq:
            raise ValueError(
                f"cold model {cold.name!r} lends {cold.lend_kv_gib} GiB = {num_remote_blocks} "
                f"blocks of {hot.name!r}, fewer than one {hot.max_model_len}-token sequence "
                f"needs ({max_blocks_per_seq}); raise lend_kv_gib"
            )
        plans.append(PairPlan(
            hot=hot.name,
            cold=cold.name,
            region_name=region_name(shm_prefix, hot.name, cold.name),
            shape=shape,
            num_remote_blocks=num_remote_blocks,
            max_seqs_per_task=hot.max_num_seqs,
            max_blocks_per_seq=max_blocks_per_seq,
            offload_ratio=pair.offload_ratio,
            timeout_s=pair.timeout_s,
        ))
    return plans
