"""How Weaver's per-engine settings reach vLLM's processes.

The gateway puts them under `additional_config["weaver"]` (an engine argument vLLM
carries, as part of VllmConfig, into EngineCore, where the scheduler lives, and into the
worker, where attention runs), so no environment variable has to differ per engine.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
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


@dataclass(frozen=True)
class LinkSection:
    """How an engine links itself to the other side of its weaving pairs
    (weaver/weaving/pair_link.py), whichever launcher started it: the plugin writes it from
    the user's block, `weaver serve` from its plan."""

    role: str  # "hot" or "cold": every pair the engine is in (a hot one's in plan order)
    pairs: tuple[str, ...]
    root: str  # the pairs' directory (weaver/weaving/rendezvous.py)
    lend_bytes: int = 0  # cold: the KV it lends, all pairs together
    cold_model: str = ""  # cold: its served name, in its answers and counters

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "pairs": list(self.pairs)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LinkSection:
        return cls(**{**data, "pairs": tuple(data["pairs"])})


def link_of(additional_config: Any) -> LinkSection | None:
    """The engine's link section, or None for an engine in no weaving pair."""
    section = (additional_config or {}).get(KEY) if isinstance(additional_config, dict) else None
    data = section.get("link") if isinstance(section, dict) else None
    return LinkSection.from_dict(data) if data else None


def hot_plans(vllm_config: Any) -> list[PairPlan]:
    """The weaving plans of a hot engine, one per cold engine it weaves into (in the order
    its remote block ranges follow one another); [] for any other engine."""
    section = (getattr(vllm_config, "additional_config", None) or {}).get(KEY) or {}
    return [PairPlan.from_dict(data) for data in section.get("hot") or ()]


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


# Each feature of `weaver serve` writes its own keys of the block (weaver/server/features.py);
# these build them, so that the format the engine reads is written in one place.
def hot_section(plans: list[PairPlan]) -> dict[str, Any]:
    """A hot engine's weaving plans, one per cold engine (read back by `hot_plans`)."""
    if len({plan.cold for plan in plans}) != len(plans) or len({p.hot for p in plans}) > 1:
        raise ValueError(f"a hot engine's plans name one hot model and each cold once: "
                         f"{[(p.hot, p.cold) for p in plans]}")
    return {"hot": [plan.to_dict() for plan in plans]}


def link_section_for(link: LinkSection) -> dict[str, Any]:
    """An engine's side of its weaving pairs (read back by `link_of`)."""
    return {"link": link.to_dict()}


def split_section_for(split_chunks: dict[str, int]) -> dict[str, Any]:
    """An engine's operator split plan; {} when nothing is split."""
    if split_chunks and any(n > 1 for n in split_chunks.values()):
        return {"split": {"chunks": dict(split_chunks)}}
    return {}


def pool_section_for(plan: PoolPlan, tenant: str) -> dict[str, Any]:
    """The unified KV pool an engine keeps its KV in, as `tenant`."""
    plan.tenant(tenant)  # ValueError now rather than in the engine
    return {"pool": {"plan": plan.to_dict(), "tenant": tenant}}


def mux_section(block: dict) -> dict[str, Any]:
    """A colocated engine's group block (weaver/vllm_ext/mux_gate.py)."""
    return {"mux": dict(block)}


def phase_split_section(model: str, phase: str) -> dict[str, Any]:
    """The model a phase-split engine serves, and its phase there."""
    if phase not in ("prefill", "decode"):
        raise ValueError(f"phase {phase!r} is not 'prefill' or 'decode'")
    return {"phase_split": {"model": model, "phase": phase}}


def merge_sections(*sections: dict[str, Any]) -> dict:
    """One engine's `additional_config` from the sections its features wrote."""
    merged: dict[str, Any] = {}
    for section in sections:
        clash = merged.keys() & section.keys()
        if clash:
            raise ValueError(f"two features wrote the engine's {sorted(clash)} section")
        merged.update(section)
    return {KEY: merged} if merged else {}


def make_additional_config(split_chunks: dict[str, int] | None = None,
                           pool: tuple[PoolPlan, str] | None = None) -> dict:
    """The block of one engine with these parts (engines started by hand: tests, the
    profilers); a weaving engine's come from `weaver serve` or the plugin."""
    return merge_sections(split_section_for(split_chunks or {}),
                          pool_section_for(*pool) if pool is not None else {})
