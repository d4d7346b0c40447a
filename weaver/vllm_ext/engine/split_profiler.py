"""Measure a cold model's split profile on real engines (docs/architecture.md, part 7).

Starts the deployment's cold engine (without a split plan), runs a batch of decode
requests through it with the worker's operator profiler on (weaver/vllm_ext/engine/op_profiler.py),
and keeps the calls of pure decode steps of the full batch: T_i per operator. Then the
cold worker times vLLM's paged-attention kernel at the hot model's shape for the hot
side's local sequences (K) and for one remote task (N), and the cost of one extra GEMM
chunk. Last, the hot engine runs its decode batch alone for the hot iteration time (the
threshold's base). Engines start one after another, each with the deployment's own
settings (cores, dtype, KV); nothing else is running on them. Turning the raw profile
into the planner's timings is weaver/splitting/measured.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any

from weaver.config.deployment import Deployment, ModelSpec, Role
from weaver.splitting.measured import MeasureSettings, op_timings, pair_of, step_s
from weaver.splitting.profile import HotTiming, SplitProfile
from weaver.weaving.plan import block_size_of, read_attention_shape

logger = logging.getLogger(__name__)

RPC_TIMEOUT_S = 120.0
_FIRST_TOKEN_ID = 100  # prompt token ids: any ids inside every vocabulary


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
    layer_ops, lm_head = op_timings(raw, settings.batch, cold.name)
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
                      step_s=step_s(hot_raw, settings.hot_batch, hot.name)),
        split_overhead_s=attention["overhead_s"],
        notes=(f"measured on the engines: cold batch {settings.batch}, prompt "
               f"{settings.prompt_len}, {settings.decode_tokens} decode tokens; hot "
               f"{hot.name} batch {settings.hot_batch} ({num_local} local, {num_remote} "
               f"remote, context {settings.context_len}); attention splits by sequence"),
    )

