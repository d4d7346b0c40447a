"""How Weaver's per-engine settings reach vLLM's processes.

The gateway puts them under `additional_config["weaver"]` (an engine argument vLLM
carries, as part of VllmConfig, into EngineCore, where the scheduler lives, and into the
worker, where attention runs), so no environment variable has to differ per engine.
"""

from __future__ import annotations

from typing import Any

from weaver.weaving.plan import PairPlan

KEY = "weaver"


def hot_plan(vllm_config: Any) -> PairPlan | None:
    """The weaving plan of a hot engine, or None for any other engine."""
    section = (getattr(vllm_config, "additional_config", None) or {}).get(KEY) or {}
    data = section.get("hot")
    return PairPlan.from_dict(data) if data else None


def cold_plans(vllm_config: Any) -> list[PairPlan]:
    section = (getattr(vllm_config, "additional_config", None) or {}).get(KEY) or {}
    return [PairPlan.from_dict(d) for d in section.get("cold", [])]


def make_additional_config(hot: PairPlan | None, cold: list[PairPlan]) -> dict:
    section: dict[str, Any] = {}
    if hot is not None:
        section["hot"] = hot.to_dict()
    if cold:
        section["cold"] = [p.to_dict() for p in cold]
    return {KEY: section} if section else {}
