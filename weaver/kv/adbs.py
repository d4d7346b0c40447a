"""Quota re-balancing from utilisation, after MuxServe's adaptive dynamic block scheduling.

MuxServe (§4.2.4, "ADBS") gives each co-located LLM a KV-block quota and periodically moves
quota from LLMs that under-use theirs to LLMs that are short of blocks. MuxServe states
the idea, not a step size, so Weaver fixes the exact rule here (all counts in pages):

1. A tenant is *busy* when it is not shrinking and either an allocation of its failed since
   the last rebalance (``is_starved``) or its utilisation ``used / quota`` is at least
   ``busy_utilisation`` (0.9, MuxServe's threshold).
2. Every other non-shrinking tenant with a positive quota and utilisation below
   ``busy_utilisation`` is a *donor*. It gives ``floor(donate_fraction * (quota - used))``
   pages (half of its unused quota), but never goes below ``max(min_quota, used +
   pages_per_block)``: it keeps one free block of headroom and any floor the operator set.
   Because a donor keeps at least ``used`` pages of quota, re-balancing never invalidates a
   live block and never needs a shrink ticket.
3. If there is no busy tenant nothing moves (donors keep their quota). Otherwise the pool
   ``unassigned + sum(donations)`` is split equally among busy tenants; each takes its
   share rounded down to whole blocks of its own shape. What no busy tenant can use (the
   rounding remainder) stays unassigned and is handed out first at the next rebalance.

Tenants that are shrinking (an open shrink ticket) are left alone: they are over quota on
purpose and must not win back the quota they are giving up.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AdbsPolicy:
    busy_utilisation: float = 0.9
    donate_fraction: float = 0.5

    def __post_init__(self) -> None:
        if not 0.0 < self.busy_utilisation <= 1.0:
            raise ValueError(
                f"busy_utilisation must be in (0, 1], got {self.busy_utilisation}; "
                "MuxServe uses 0.9"
            )
        if not 0.0 < self.donate_fraction <= 1.0:
            raise ValueError(
                f"donate_fraction must be in (0, 1], got {self.donate_fraction}; "
                "0.5 gives half of a donor's unused quota per rebalance"
            )


@dataclass(frozen=True)
class TenantLoad:
    """What the rule needs to know about one tenant at rebalance time."""

    name: str
    quota_pages: int
    num_used_pages: int
    pages_per_block: int
    min_quota_pages: int = 0
    is_starved: bool = False
    is_shrinking: bool = False

    @property
    def utilisation(self) -> float:
        return self.num_used_pages / self.quota_pages if self.quota_pages else 0.0


def is_busy(load: TenantLoad, policy: AdbsPolicy) -> bool:
    if load.is_shrinking:
        return False
    is_full = load.quota_pages > 0 and load.utilisation >= policy.busy_utilisation
    return load.is_starved or is_full


def num_donated_pages(load: TenantLoad, policy: AdbsPolicy) -> int:
    if load.is_shrinking or load.quota_pages == 0 or is_busy(load, policy):
        return 0
    unused = load.quota_pages - load.num_used_pages
    floor = max(load.min_quota_pages, load.num_used_pages + load.pages_per_block)
    return max(0, min(int(policy.donate_fraction * unused), load.quota_pages - floor))


def plan_rebalance(
    loads: list[TenantLoad], num_unassigned_pages: int, policy: AdbsPolicy
) -> dict[str, int]:
    """New quota per tenant (every tenant listed). Their sum never exceeds the old sum plus
    ``num_unassigned_pages``."""
    new_quotas = {load.name: load.quota_pages for load in loads}
    busy = [load for load in loads if is_busy(load, policy)]
    if not busy:
        return new_quotas
    pool = num_unassigned_pages
    for load in loads:
        donated = num_donated_pages(load, policy)
        new_quotas[load.name] -= donated
        pool += donated
    share = pool // len(busy)
    for load in busy:
        new_quotas[load.name] += share // load.pages_per_block * load.pages_per_block
    return new_quotas
