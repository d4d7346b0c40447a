"""Measure a cold model's split profile on real engines (docs/architecture.md, part 7).

Starts the deployment's cold engine (without a split plan), runs a batch of decode
requests through it with the worker's operator profiler on (weaver/vllm_ext/engine/op_profiler.py),
and keeps the calls of pure decode steps of the full batch: T_i per operator. Then the
cold worker times vLLM's paged-attention kernel at the hot model's shape for the hot
side's local sequences (K) and for one remote task (N), and the cost of one extra GEMM
chunk. Last, the hot engine runs its decode batch alone for the hot iteration time (the
threshold's base). Engines start one after another, each with the deployment's own
settings (cores, dtype, KV); nothing else is running on them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from weaver.config.deployment import Deployment, ModelSpec, Role
from weaver.splitting.profile import PER_LAYER_OP_NAMES, HotTiming, OpTiming, SplitProfile
from weaver.weaving.plan import block_size_of, read_attention_shape

logger = logging.getLogger(__name__)

RPC_TIMEOUT_S = 120.0
# Smallest chunk of output rows the planner may cut a GEMM into: below this a chunk is
# bound by its launch and poll, not by its work.
MIN_CHUNK_ROWS = 16
_FIRST_TOKEN_ID = 100  # prompt token ids: any ids inside every vocabulary


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


def _profiling_spec(spec: ModelSpec) -> ModelSpec:
    # Role cold gives the engine Weaver's worker extension (the profiler rpcs) and no
    # hot scheduler; no split and no weaving config: the unsplit model is measured.
    return spec.model_copy(update={"role": Role.COLD, "split": None, "split_profile": None,
                                   "lend_kv_gib": 0.0})


async def _rpc(handle: Any, method: str, *args: Any) -> Any:
    (result,) = await handle.client.collective_rpc(method, timeout=RPC_TIMEOUT_S, args=args)
    return result


async def _run_batch(handle: Any, num_seqs: int, settings: MeasureSettings, tag: str) -> None:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=settings.decode_tokens, temperature=0.0,
                            ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(_FIRST_TOKEN_ID,
                                             _FIRST_TOKEN_ID + settings.prompt_len))}

    async def one(i: int) -> None:
        async for _ in handle.client.generate(prompt, params, f"{tag}-{i}"):
            pass

    await asyncio.gather(*(one(i) for i in range(num_seqs)))


async def _profile_decode(spec: ModelSpec, model_dir: Path, num_seqs: int,
                          settings: MeasureSettings, extra: Any = None) -> dict[str, Any]:
    """Start ``spec``'s engine, profile ``num_seqs`` decoding sequences; ``extra`` (an
    async function of the handle and the raw profile) runs on the same engine before it
    stops."""
    from weaver.vllm_ext.engine.app import open_engine

    if num_seqs > spec.max_num_seqs:
        raise ValueError(f"model {spec.name!r}: a batch of {num_seqs} exceeds its "
                         f"max_num_seqs {spec.max_num_seqs}; lower the batch")
    async with contextlib.AsyncExitStack() as stack:
        handle = await open_engine(_profiling_spec(spec), model_dir, stack)
        await _run_batch(handle, 1, MeasureSettings(1, 1, 8, 4), f"warmup-{spec.name}")
        await _rpc(handle, "weaver_profile_start")
        await _run_batch(handle, num_seqs, settings, f"profile-{spec.name}")
        raw = await _rpc(handle, "weaver_profile_stop")
        raw["extra"] = await extra(handle, raw) if extra is not None else None
    return raw


def _decode_samples(raw: dict[str, Any], kind: str, num_seqs: int, name: str) -> list[float]:
    samples = raw["samples"].get(kind, {}).get(str(num_seqs), [])
    per_step = raw["num_layers"] if kind != "lm_head" else 1
    samples = samples[2 * per_step:]  # the first two decode steps warm caches up
    if not samples:
        seen = sorted(int(t) for t in raw["samples"].get(kind, {}))
        raise ValueError(
            f"model {name!r}: no decode step ran all {num_seqs} sequences together (token "
            f"counts seen: {seen}); lower the batch or give the engine more KV cache")
    return samples


def _timing(name: str, samples: list[float], dim: int, min_chunk: int) -> OpTiming:
    return OpTiming(name=name, mean_s=statistics.fmean(samples),
                    p50_s=statistics.median(samples), num_samples=len(samples),
                    split_dim_size=dim, min_chunk_size=min(min_chunk, dim))


def _op_timings(raw: dict[str, Any], batch: int, name: str) -> tuple[list[OpTiming], OpTiming]:
    layer_ops = []
    for kind in PER_LAYER_OP_NAMES:
        samples = _decode_samples(raw, kind, batch, name)
        if kind == "attn":
            # Attention splits into groups of whole sequences (attention/backend.py): at
            # most one chunk per sequence of the batch.
            layer_ops.append(_timing(kind, samples, batch, 1))
        else:
            layer_ops.append(_timing(kind, samples, raw["split_dims"][kind], MIN_CHUNK_ROWS))
    lm_head = _timing("lm_head", _decode_samples(raw, "lm_head", batch, name),
                      raw["split_dims"]["lm_head"], MIN_CHUNK_ROWS)
    return layer_ops, lm_head


def _step_s(raw: dict[str, Any], num_seqs: int, name: str) -> float:
    ends = raw["lm_head_ends"].get(str(num_seqs), [])[2:]
    gaps = [b - a for a, b in zip(ends, ends[1:], strict=False)]
    if not gaps:
        raise ValueError(f"model {name!r}: too few decode steps of the full batch to time an "
                         "iteration; raise decode_tokens")
    return statistics.median(gaps)


async def measure_split_profile(deployment: Deployment, cold_name: str,
                                model_dirs: dict[str, Path],
                                settings: MeasureSettings) -> SplitProfile:
    cold, hot, ratio = pair_of(deployment, cold_name)
    shape = read_attention_shape(model_dirs[hot.name], hot.dtype, block_size_of(hot))
    num_remote = max(1, round(settings.hot_batch * ratio))
    num_local = max(1, settings.hot_batch - num_remote)

    async def cold_extra(handle: Any, raw: dict[str, Any]) -> dict[str, Any]:
        # On the cold engine's cores: N runs there; K runs on the hot side's cores, which
        # are of the same kind on one machine.
        shape_data = asdict(shape)
        local = await _rpc(handle, "weaver_time_attention", shape_data, num_local,
                           settings.context_len)
        remote = await _rpc(handle, "weaver_time_attention", shape_data, num_remote,
                            settings.context_len)
        # One extra chunk of the gate_up GEMM (in: hidden = down's output features).
        dims = raw["split_dims"]
        overhead = await _rpc(handle, "weaver_time_split_overhead", dims["down"],
                              dims["gate_up"], settings.batch)
        return {"local": local, "remote": remote, "overhead_s": overhead}

    logger.info("profiling cold model %s: batch %d, prompt %d, %d decode tokens", cold.name,
                settings.batch, settings.prompt_len, settings.decode_tokens)
    raw = await _profile_decode(cold, model_dirs[cold.name], settings.batch, settings,
                                cold_extra)
    layer_ops, lm_head = _op_timings(raw, settings.batch, cold.name)
    logger.info("profiling hot model %s: batch %d", hot.name, settings.hot_batch)
    hot_raw = await _profile_decode(hot, model_dirs[hot.name], settings.hot_batch, settings)
    attention = raw["extra"]
    return SplitProfile(
        model=cold.name,
        device=cold.device,
        num_layers=raw["num_layers"],
        layer_ops=layer_ops,
        lm_head=lm_head,
        hot=HotTiming(local_attention_s=attention["local"]["mean_s"],
                      remote_attention_s=attention["remote"]["mean_s"],
                      step_s=_step_s(hot_raw, settings.hot_batch, hot.name)),
        split_overhead_s=attention["overhead_s"],
        notes=(f"measured on the engines: cold batch {settings.batch}, prompt "
               f"{settings.prompt_len}, {settings.decode_tokens} decode tokens; hot "
               f"{hot.name} batch {settings.hot_batch} ({num_local} local, {num_remote} "
               f"remote, context {settings.context_len}); attention splits by sequence"),
    )

