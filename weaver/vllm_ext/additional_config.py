"""How Weaver's per-engine settings reach vLLM's processes.

The gateway puts them under `additional_config["weaver"]` (an engine argument vLLM
carries, as part of VllmConfig, into EngineCore, where the scheduler lives, and into the
worker, where attention runs), so no environment variable has to differ per engine.
"""

from __future__ import annotations

from typing import Any

from weaver.kv.pool_plan import PoolPlan
from weaver.splitting.deploy import validate_split_chunks
from weaver.weaving.plan import PairPlan

KEY = "weaver"
# Weaver's vLLM hooks (`--scheduler-cls`, `--worker-extension-cls`), as both launchers set
# them: `weaver serve` (engine/app.py) and the plugin under plain `vllm serve`
# (plugin_pairs.py).
SCHEDULER = "weaver.vllm_ext.scheduler.WeaverScheduler"
WORKER_EXTENSION = "weaver.vllm_ext.worker.WeaverWorkerExtension"


def hot_plan(vllm_config: Any) -> PairPlan | None:
    """The weaving plan of a hot engine, or None for any other engine."""
    section = (getattr(vllm_config, "additional_config", None) or {}).get(KEY) or {}
    data = section.get("hot")
    return PairPlan.from_dict(data) if data else None


def cold_plans(vllm_config: Any) -> list[PairPlan]:
    section = (getattr(vllm_config, "additional_config", None) or {}).get(KEY) or {}
    return [PairPlan.from_dict(d) for d in section.get("cold", [])]


def split_section(vllm_config: Any) -> dict:
    """A cold engine's operator split plan, ``{"chunks": {op: n}}``; {} for any other."""
    section = (getattr(vllm_config, "additional_config", None) or {}).get(KEY) or {}
    return section.get("split") or {}


def split_chunks_of(vllm_config: Any) -> dict[str, int]:
    """Chunks per operator kind of this engine's split plan; empty when it has none."""
    section = split_section(vllm_config)
    return validate_split_chunks(dict(section.get("chunks", {}))) if section else {}


def pool_section(vllm_config: Any) -> tuple[PoolPlan, str] | None:
    """The unified KV pool this engine keeps its KV in, and its tenant name there."""
    return pool_of(getattr(vllm_config, "additional_config", None) or {})


def pool_of(additional_config: dict) -> tuple[PoolPlan, str] | None:
    data = (additional_config.get(KEY) or {}).get("pool")
    return (PoolPlan.from_dict(data["plan"]), data["tenant"]) if data else None


def phase_split_of(additional_config: dict) -> tuple[str, str] | None:
    """(the phase-split model's API name, "prefill" or "decode") for an engine of a phase
    split, else None."""
    data = (additional_config.get(KEY) or {}).get("phase_split")
    return (data["model"], data["phase"]) if data else None


def make_additional_config(hot: PairPlan | None, cold: list[PairPlan],
                           split_chunks: dict[str, int] | None = None,
                           pool: tuple[PoolPlan, str] | None = None,
                           mux: dict | None = None,
                           phase_split: tuple[str, str] | None = None) -> dict:
    """`mux`: a colocated engine's group block (weaver/vllm_ext/mux_gate.py);
    `phase_split`: the model a phase-split engine serves and its phase there."""
    section: dict[str, Any] = {}
    if hot is not None:
        section["hot"] = hot.to_dict()
    if cold:
        section["cold"] = [p.to_dict() for p in cold]
    if split_chunks and any(n > 1 for n in split_chunks.values()):
        section["split"] = {"chunks": dict(split_chunks)}
    if pool is not None:
        plan, tenant = pool
        plan.tenant(tenant)  # ValueError now rather than in the engine
        section["pool"] = {"plan": plan.to_dict(), "tenant": tenant}
    if mux is not None:
        section["mux"] = dict(mux)
    if phase_split is not None:
        model, phase = phase_split
        if phase not in ("prefill", "decode"):
            raise ValueError(f"phase {phase!r} is not 'prefill' or 'decode'")
        section["phase_split"] = {"model": model, "phase": phase}
    return {KEY: section} if section else {}
