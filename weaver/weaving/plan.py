"""What each side of a weaving pair must agree on, computed once from the deployment.

A `PairPlan` per hot→cold pair is computed before the hot engine starts (by `weaver serve`
from the deployment, `plan_pairs`; under plain `vllm serve` by the hot engine from its own
model, `plugin_hot_plan`) and handed to it in vLLM's `additional_config`; the hot engine
publishes it to the cold one (weaver/weaving/pair_link.py), which names the region when it
accepts it. So the hot scheduler's remote block count, the hot worker's view of the region
and the cold worker's region are sized by one formula. Pure Python: reads the hot model's
`config.json`, imports no vLLM.
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from weaver.kv.pages import TenantShape, headwise_block_size
from weaver.kv.pool_plan import PoolPlan, PoolTenantPlan
from weaver.offload.layout import HotAttentionShape, RegionLayout
from weaver.offload.naming import gateway_prefix, region_name
from weaver.weaving.placement import AdaptiveTargets

if TYPE_CHECKING:
    # Annotations only: the weaving runtime (hot.py, cold.py) imports this module, and a
    # GPU machine running it without vLLM has no pydantic or yaml for the deployment file.
    from weaver.config.deployment import Deployment, ModelSpec

logger = logging.getLogger(__name__)

GiB = 1 << 30
CPU_DEFAULT_BLOCK_SIZE = 128  # vLLM's default on CPU (platforms/cpu.py)
CUDA_DEFAULT_BLOCK_SIZE = 16  # vLLM's default on CUDA (config/cache.py, platforms/cuda.py)
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
    offload_ratio: float | str  # a share in [0, 1], or "auto" (weaving/placement.py)
    timeout_s: float
    # The cold device's unified KV pool, when the remote blocks live there (the hot model
    # is its tenant of the same name); None: they live in the region.
    pool: PoolPlan | None = None
    # How the region is shared: "shm" (CPU engines: POSIX shared memory) or "cuda" (the
    # cold GPU's memory, exported once through CUDA IPC).
    transport: str = "shm"
    # offload_ratio "auto": the hot TPOT target (ms; None: relative to its local-only
    # steps) and how much the cold model's TPOT may grow (AdaptiveTargets).
    hot_tpot_ms: float | None = None
    cold_tpot_budget: float = 1.10

    def adaptive_targets(self) -> AdaptiveTargets:
        return AdaptiveTargets.of_pair(self.hot_tpot_ms, self.cold_tpot_budget)

    def layout(self) -> RegionLayout:
        return RegionLayout(
            shape=self.shape,
            num_remote_blocks=self.num_remote_blocks,
            max_seqs_per_task=self.max_seqs_per_task,
            max_blocks_per_seq=self.max_blocks_per_seq,
            kv_in_pool=self.pool is not None,
        )

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> PairPlan:
        pool = data.get("pool")
        return cls(**{**data, "shape": HotAttentionShape(**data["shape"]),
                      "pool": PoolPlan.from_dict(pool) if pool else None})


def block_size_of(spec: ModelSpec) -> int:
    default = CPU_DEFAULT_BLOCK_SIZE if spec.device == "cpu" else CUDA_DEFAULT_BLOCK_SIZE
    return spec.block_size or default


def kv_format_of(spec: ModelSpec) -> str:
    """How the hot engine's attention backend lays K and V out in a cache block
    (layout.KV_FORMATS): CPU_ATTN's pages on cpu, the GPU backends' token rows on cuda."""
    return "pages" if spec.device == "cpu" else "token"


def read_attention_shape(model_dir: Path, dtype: str, block_size: int,
                         kv_format: str = "pages") -> HotAttentionShape:
    """The attention shape of a Hugging Face Llama-family model directory."""
    config_file = model_dir / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read the hot model's {config_file}: {exc}") from None
    return attention_shape_of(config, dtype, block_size, kv_format)


def attention_shape_of(config: dict, dtype: str, block_size: int,
                       kv_format: str = "pages") -> HotAttentionShape:
    """The attention shape of a Llama-family model's Hugging Face config (as a dict)."""
    num_heads = config["num_attention_heads"]
    head_size = config.get("head_dim") or config["hidden_size"] // num_heads
    return HotAttentionShape(
        num_layers=config["num_hidden_layers"],
        num_q_heads=num_heads,
        num_kv_heads=config.get("num_key_value_heads", num_heads),
        head_size=head_size,
        block_size=block_size,
        dtype=dtype,
        kv_format=kv_format,
    )


def remote_block_offsets(plans: Sequence[PairPlan]) -> list[int]:
    """Where each of a hot engine's pairs' remote block ids start, past its local ones: the
    pairs' remote ranges one after another, in plan order (the hot scheduler hands them out
    and the hot worker reads them back by the same rule)."""
    offsets, total = [], 0
    for plan in plans:
        offsets.append(total)
        total += plan.num_remote_blocks
    return offsets


def num_lent_blocks(deployment: Deployment, cold: ModelSpec, block_bytes: int) -> int:
    """Whole hot-model blocks of `block_bytes` in one hot model's region of the memory the
    cold model lends: `lend_kv_gib` split evenly among the hot models weaving into it (its
    ColdLink refuses plans that together ask for more), floored to whole blocks. (Hot
    models that share a loan pool instead lease from all of it: `plan_loan_pools`.)"""
    return int(cold.lend_kv_gib * GiB) // max(1, len(hots_of(deployment, cold))) // block_bytes


def hots_of(deployment: Deployment, cold: ModelSpec) -> list[ModelSpec]:
    """The hot models weaving into `cold`, in the order of their weaving entries."""
    return [deployment.model(pair.hot) for pair in deployment.weaving
            if cold.name in pair.cold]


def lend_kv_gib_for(num_blocks: int, block_bytes: int) -> str:
    """The `lend_kv_gib` value (as YAML text) that lends exactly `num_blocks` blocks of
    `block_bytes`: rounded up at nine decimals, since `plan_pairs` floors the lent bytes to
    whole blocks and a value rounded down would lend one block fewer."""
    return f"{math.ceil(num_blocks * block_bytes / GiB * 1e9) / 1e9:.9f}"


def default_shm_prefix() -> str:
    # One gateway process owns its pairs' regions; its pid keeps two servers on one
    # machine (tests, benchmarks) apart without a hard-coded name.
    return os.environ.get(SHM_PREFIX_ENV) or gateway_prefix(os.getpid())


def plan_pairs(
    deployment: Deployment, model_dirs: dict[str, Path], shm_prefix: str
) -> list[PairPlan]:
    plans = []
    pools: dict[str, PoolPlan] = plan_loan_pools(deployment, model_dirs, shm_prefix)
    for pair in deployment.weaving:
        hot = deployment.model(pair.hot)
        shape = read_attention_shape(model_dirs[hot.name], hot.dtype, block_size_of(hot),
                                     kv_format_of(hot))
        for cold_name in pair.cold:
            cold = deployment.model(cold_name)
            if cold.unified_kv and len(pair.cold) > 1:
                raise ValueError(
                    f"weaving {pair.hot!r} into {pair.cold}: cold model {cold.name!r} keeps "
                    "its KV in a unified pool, which a hot model weaving into several colds "
                    "cannot lease from yet; set unified_kv: false on it or weave into it alone")
            num_remote_blocks = num_lent_blocks(deployment, cold, region_bytes_of(shape, 1))
            if cold.unified_kv and cold.name not in pools:
                pools[cold.name] = plan_pool(deployment, cold, model_dirs, shm_prefix)
            pool = pools.get(cold.name)
            if pool is not None:
                num_remote_blocks = pool.max_blocks(hot.name)  # the id space; quota bounds use
            plans.append(pair_plan(
                hot.name, cold.name, shape, num_remote_blocks, hot.max_model_len,
                hot.max_num_seqs,
                {"offload_ratio": pair.offload_ratio, "timeout_s": pair.timeout_s,
                 "hot_tpot_ms": pair.hot_tpot_ms, "cold_tpot_budget": pair.cold_tpot_budget},
                "shm" if hot.device == "cpu" else "cuda", pool,
                short_of=f"cold model {cold.name!r} lends {cold.lend_kv_gib} GiB; raise "
                         "lend_kv_gib"))
    return plans


def region_bytes_of(shape: HotAttentionShape, num_remote_blocks: int) -> int:
    """The KV bytes of `num_remote_blocks` blocks of the hot model (every layer)."""
    probe = RegionLayout(shape=shape, num_remote_blocks=1, max_seqs_per_task=1,
                         max_blocks_per_seq=1)
    # kv_block_bytes is one layer's share of a block; a block spans every layer.
    return probe.kv_block_bytes * shape.num_layers * num_remote_blocks


def pair_plan(hot: str, cold: str, shape: HotAttentionShape, num_remote_blocks: int,
              max_model_len: int, max_num_seqs: int, policy: dict, transport: str,
              pool: PoolPlan | None = None, *, short_of: str) -> PairPlan:
    """A pair's plan, the region unnamed (the cold engine names it when it accepts the
    plan). `policy`: offload_ratio, timeout_s, hot_tpot_ms and cold_tpot_budget;
    `short_of`: what to say (and change) when the remote blocks hold no whole sequence."""
    max_blocks_per_seq = math.ceil(max_model_len / shape.block_size)
    if num_remote_blocks < max_blocks_per_seq:
        raise ValueError(
            f"{num_remote_blocks} remote blocks of {hot!r} are fewer than one "
            f"{max_model_len}-token sequence needs ({max_blocks_per_seq}): {short_of}")
    return PairPlan(hot=hot, cold=cold, region_name="", shape=shape,
                    num_remote_blocks=num_remote_blocks, max_seqs_per_task=max_num_seqs,
                    max_blocks_per_seq=max_blocks_per_seq, pool=pool, transport=transport,
                    **policy)


def plugin_hot_plan(hot: str, pair: str, shape: HotAttentionShape, remote_kv_gib: float,
                    max_model_len: int, max_num_seqs: int, policy: dict,
                    transport: str) -> PairPlan:
    """A hot engine's plan under plain `vllm serve` (weaver/weaving/rendezvous.py): sized
    by the hot engine alone, from its own model and the KV it places remotely."""
    num_remote_blocks = int(remote_kv_gib * GiB) // region_bytes_of(shape, 1)
    return pair_plan(hot, pair, shape, num_remote_blocks, max_model_len, max_num_seqs, policy,
                     transport, short_of=f"weaver remote_kv_gib is {remote_kv_gib}; raise it "
                     "(and the cold engine's lend_kv_gib with it)")


def tenant_shape(model_dir: Path, spec: ModelSpec) -> TenantShape:
    shape = read_attention_shape(model_dir, spec.dtype, block_size_of(spec))
    return TenantShape(shape.num_layers, shape.num_kv_heads, shape.head_size,
                       shape.block_size, shape.itemsize)


def check_fills_pages(pool: str, page_model: str, page_shape: TenantShape, model: str,
                      shape: TenantShape) -> None:
    """ValueError saying the block_size to use unless `model`'s head-blocks (at `shape`)
    fill the pages of `pool`, which are one head-block of `page_model` (at `page_shape`)."""
    page_bytes = page_shape.head_block_bytes
    if shape.head_block_bytes != page_bytes:
        wanted = headwise_block_size(page_bytes, shape.head_size, shape.dtype_bytes)
        raise ValueError(
            f"{pool} of {page_bytes}-byte pages (one head-block of {page_model!r} at "
            f"block_size {page_shape.block_size}); {model!r} needs block_size: {wanted} to "
            f"fill them (it has {shape.block_size})")


def loan_pool_refusal(deployment: Deployment, cold: ModelSpec,
                      pooled: dict[str, str]) -> str | None:
    """Why the hot models weaving into `cold` keep fixed, equal regions of its loan instead
    of sharing it as a loan pool; None when they share it (`plan_loan_pools`). `pooled`:
    hot model -> the cold model whose loan pool it already leases from."""
    hots = hots_of(deployment, cold)
    if len(hots) < 2:
        return "it hosts one hot model"
    if cold.unified_kv:
        return "it keeps a unified KV pool, whose quotas share the loan"
    if any(hot.device != "cpu" for hot in hots):
        return "a pool of pages is shared memory on the CPU only so far"
    leasing = [hot.name for hot in hots if hot.name in pooled]
    if leasing:
        # A hot engine leases from one pool at most (weaver/vllm_ext/scheduler.py).
        return (f"{leasing[0]!r} already shares cold model {pooled[leasing[0]]!r}'s loan "
                "pool, and a hot model leases from one pool")
    if len({hot.dtype for hot in hots}) > 1:
        return "its hot models use different dtypes"
    return None


def loan_pool_hosts(deployment: Deployment) -> dict[str, list[ModelSpec]]:
    """Cold model -> the hot models that share its loan in a loan pool (`plan_loan_pools`;
    the simulator models the same sharing), in the deployment's order of models. The
    other cold models with several hot models lend them fixed, equal regions; why is
    logged."""
    hosts: dict[str, list[ModelSpec]] = {}
    pooled: dict[str, str] = {}  # hot model -> the cold whose loan pool it shares
    for cold in deployment.models:
        hots = hots_of(deployment, cold)
        if not hots:
            continue
        refusal = loan_pool_refusal(deployment, cold, pooled)
        if refusal is not None:
            if len(hots) > 1:
                logger.info("cold model %r lends %s fixed, equal regions: %s", cold.name,
                            [hot.name for hot in hots], refusal)
            continue
        pooled.update((hot.name, cold.name) for hot in hots)
        hosts[cold.name] = hots
    return hosts


def plan_loan_pools(deployment: Deployment, model_dirs: dict[str, Path],
                    shm_prefix: str) -> dict[str, PoolPlan]:
    """Cold model -> the pool of pages its hot models share its loan in, for every cold
    model without unified_kv that hosts several hot models, on the CPU, where none of them
    leases from another loan pool already (`loan_pool_hosts`).

    The pool holds exactly `lend_kv_gib`; the cold model's own KV stays in vLLM's cache.
    The hot models are its tenants (no owner: the gateway hosts it, weaver/server/
    weaving.py), starting from equal quotas; ADBS (weaver/kv/adbs.py) moves quota to the
    one short of blocks, never below one max_model_len sequence, so the lent memory
    follows demand, each hot model bounded by its quota. Elsewhere each hot model gets a
    fixed, equal region (`num_lent_blocks`); why is logged."""
    pools: dict[str, PoolPlan] = {}
    for cold_name, hots in loan_pool_hosts(deployment).items():
        cold = deployment.model(cold_name)
        shapes = {hot.name: tenant_shape(model_dirs[hot.name], hot) for hot in hots}
        first = hots[0]
        page_bytes = shapes[first.name].head_block_bytes
        tenants = []
        for hot in hots:
            shape = shapes[hot.name]
            check_fills_pages(f"cold model {cold.name!r} lends one pool to {len(hots)} hot "
                              "models", first.name, shapes[first.name], hot.name, shape)
            pages_per_block = shape.pages_per_block(page_bytes)
            sequence_pages = math.ceil(hot.max_model_len / shape.block_size) * pages_per_block
            tenants.append((hot.name, shape, sequence_pages))
        num_pages = int(cold.lend_kv_gib * GiB) // page_bytes
        quota = num_pages // len(tenants)
        short = [name for name, _, sequence_pages in tenants if sequence_pages > quota]
        if short:
            raise ValueError(
                f"cold model {cold.name!r} lends {cold.lend_kv_gib} GiB to {len(tenants)} hot "
                f"models; an equal share is less than one max_model_len sequence of "
                f"{short[0]!r}: raise lend_kv_gib")
        name = region_name(shm_prefix, cold.name, "loanpool")
        pools[cold.name] = PoolPlan(
            pool_name=name, table_name=f"{name}.table", page_bytes=page_bytes,
            num_pages=num_pages,
            tenants=tuple(PoolTenantPlan(tenant, shape, quota, first_block_id=0,
                                         min_quota_pages=sequence_pages)
                          for tenant, shape, sequence_pages in tenants),
            service_address=f"\0{name}.alloc", authkey_hex=secrets.token_hex(16))
    return pools


def plan_pool(deployment: Deployment, cold: ModelSpec, model_dirs: dict[str, Path],
              shm_prefix: str) -> PoolPlan:
    """The unified KV pool of a cold model with `unified_kv` (weaver/kv/pool_plan.py): its
    own KV budget plus what it lends, in pages of one of its head-blocks; the cold model's
    quota starts at its own budget, the hot models share the lent part evenly (the allocator
    moves quota between them from there)."""
    cold_shape = tenant_shape(model_dirs[cold.name], cold)
    page_bytes = cold_shape.head_block_bytes
    num_pages = int((cold.kv_cache_gib + cold.lend_kv_gib) * GiB) // page_bytes
    hots = hots_of(deployment, cold)
    tenants = [PoolTenantPlan(cold.name, cold_shape, int(cold.kv_cache_gib * GiB) // page_bytes,
                              is_owner=True)]
    hot_quota = (num_pages - tenants[0].quota_pages) // max(1, len(hots))
    for hot in hots:
        if hot.dtype != cold.dtype:
            # Pages change tenants without being cleared (zeroing each lent page would cost
            # a write of the whole page). Stale bytes of one dtype read as another can
            # decode as NaN, and the attention kernel multiplies masked positions by a
            # weight of 0, which keeps NaN: one dtype per pool keeps stale values finite.
            raise ValueError(
                f"cold model {cold.name!r} ({cold.dtype}) keeps a unified KV pool; its hot "
                f"model {hot.name!r} must use the same dtype, not {hot.dtype}")
        shape = tenant_shape(model_dirs[hot.name], hot)
        check_fills_pages(f"cold model {cold.name!r} keeps a unified KV pool", cold.name,
                          cold_shape, hot.name, shape)
        tenants.append(PoolTenantPlan(hot.name, shape, hot_quota, first_block_id=0))
    name = region_name(shm_prefix, cold.name, "kvpool")
    return PoolPlan(pool_name=name, table_name=f"{name}.table", page_bytes=page_bytes,
                    num_pages=num_pages, tenants=tuple(tenants),
                    service_address=f"\0{name}.alloc", authkey_hex=secrets.token_hex(16))
