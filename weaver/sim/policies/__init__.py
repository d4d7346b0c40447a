"""Serving policies, one per file, looked up by name (as in SplitwiseSim and vidur)."""

from __future__ import annotations

from weaver.sim.policies.base import Policy
from weaver.sim.policies.dedicated import DedicatedPolicy
from weaver.sim.policies.mux_temporal import MuxTemporalPolicy
from weaver.sim.policies.muxserve import MuxServePolicy
from weaver.sim.policies.splitwise import SplitwisePolicy
from weaver.sim.policies.weaver import WeaverPolicy

POLICY_CLASSES: dict[str, type[Policy]] = {
    cls.name: cls for cls in (DedicatedPolicy, MuxTemporalPolicy, MuxServePolicy,
                              SplitwisePolicy, WeaverPolicy)
}


def get_policy(name: str) -> type[Policy]:
    if name not in POLICY_CLASSES:
        raise ValueError(f"unknown policy {name!r}; choose one of {sorted(POLICY_CLASSES)}")
    return POLICY_CLASSES[name]


__all__ = ["POLICY_CLASSES", "Policy", "get_policy"]
