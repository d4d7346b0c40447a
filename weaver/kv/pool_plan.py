"""What every process of a unified KV pool needs to agree on.

The pool's bytes and its page table are shared-memory segments; the allocator lives in
one process and its readers map the segments. For a weaving cold device that process is
the cold engine's scheduler (the pool's owner tenant), read by the cold worker's attention
and the hot workers; for a colocated group it is the gateway (no owner tenant), and each
engine of the group leases its blocks and maps the pool. They must agree on the page
size, the pool's size, the tenants, their shapes and where each tenant's block ids start
in its scheduler's numbering. A `PoolPlan` says all of it; it travels as JSON in the engines'
``additional_config`` (``weaver/vllm_ext/additional_config.py``), like the weaving plan.

Pure Python: no torch, no vLLM.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from weaver.kv.allocator import UnifiedKVAllocator
from weaver.kv.pages import TenantShape, check_page_bytes


@dataclass(frozen=True)
class PoolTenantPlan:
    """One model that keeps KV blocks in the pool."""

    name: str
    shape: TenantShape
    quota_pages: int
    is_owner: bool = False
    # The scheduler's id of the tenant's block 0: vLLM keeps id 0 as its null block, so a
    # cold engine whose whole cache is the tenant sees its blocks at ids 1, 2, ...
    first_block_id: int = 1
    # ADBS never takes the quota below this (weaver.kv.adbs): a colocated model keeps room
    # for one longest sequence however long it idled, so it is never starved outright.
    min_quota_pages: int = 0


@dataclass(frozen=True)
class PoolPlan:
    pool_name: str  # shared-memory segment of the pool's bytes
    table_name: str  # shared-memory segment of the block -> page table
    page_bytes: int
    num_pages: int
    tenants: tuple[PoolTenantPlan, ...]
    # Where the owner answers other processes' allocation requests (weaver.kv.service,
    # weaver.kv.lease): an AF_UNIX address ("\0name" is Linux's abstract namespace, no
    # file), and the key both sides authenticate the connection with. Empty: no remote
    # tenant allocates, no listener.
    service_address: str = ""
    authkey_hex: str = ""
    # How often the owner re-balances quotas by ADBS (weaver.kv.adbs) and publishes its
    # stats; 0 turns both off (quotas stay as planned).
    rebalance_interval_s: float = 1.0

    @property
    def stats_path(self) -> str:
        """Where the owner publishes the allocator's stats (JSON, replaced atomically) for
        the gateway's metrics: next to the pool's segment in /dev/shm."""
        return f"/dev/shm/{self.pool_name}.stats.json"

    def __post_init__(self) -> None:
        check_page_bytes(self.page_bytes)
        if self.num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {self.num_pages}")
        names = [t.name for t in self.tenants]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"a pool needs tenants with distinct names, got {names}")
        if sum(t.is_owner for t in self.tenants) > 1:
            raise ValueError("a pool has at most one owner tenant (the cold model)")
        for tenant in self.tenants:
            # The kernels read a head-block as one [K | V] page
            # (weaver/vllm_ext/attention/headwise.py).
            if tenant.shape.head_block_bytes != self.page_bytes:
                raise ValueError(
                    f"tenant {tenant.name!r}: a head-block is {tenant.shape.head_block_bytes} "
                    f"bytes but a page is {self.page_bytes}; set its block_size to "
                    "weaver.kv.pages.headwise_block_size(page_bytes, head_size, dtype_bytes)"
                )
        if self.service_address and len(self.authkey_hex) < 32:
            raise ValueError("a pool with a service_address needs an authkey_hex of >= 16 bytes")
        if sum(t.quota_pages for t in self.tenants) > self.num_pages:
            raise ValueError(
                f"tenant quotas add up to {sum(t.quota_pages for t in self.tenants)} pages but "
                f"the pool has {self.num_pages}"
            )

    @property
    def pool_bytes(self) -> int:
        return self.num_pages * self.page_bytes

    @property
    def owner(self) -> PoolTenantPlan | None:
        """The tenant whose engine creates and owns the pool (a weaving cold model); None
        when the gateway hosts it and every engine leases (a colocated group)."""
        return next((t for t in self.tenants if t.is_owner), None)

    def tenant(self, name: str) -> PoolTenantPlan:
        for tenant in self.tenants:
            if tenant.name == name:
                return tenant
        raise ValueError(f"pool {self.pool_name!r} has no tenant {name!r}; it has "
                         f"{[t.name for t in self.tenants]}")

    def max_blocks(self, name: str) -> int:
        """The tenant's block ids stay below this (as `UnifiedKVAllocator.max_blocks`)."""
        return self.num_pages // self.tenant(name).shape.pages_per_block(self.page_bytes)

    def engine_kv_bytes(self, name: str) -> int:
        """The KV budget to give the tenant's engine so that its scheduler has an id for
        every block the tenant may ever hold (plus the ids below ``first_block_id``)."""
        tenant = self.tenant(name)
        return (self.max_blocks(name) + tenant.first_block_id) * tenant.shape.block_bytes()

    def build_allocator(self) -> UnifiedKVAllocator:
        allocator = UnifiedKVAllocator(self.num_pages, self.page_bytes)
        for tenant in self.tenants:
            allocator.add_tenant(tenant.name, tenant.shape, tenant.quota_pages,
                                 is_owner=tenant.is_owner,
                                 min_quota_pages=tenant.min_quota_pages)
        return allocator

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PoolPlan:
        tenants = tuple(PoolTenantPlan(**{**t, "shape": TenantShape(**t["shape"])})
                        for t in data["tenants"])
        return cls(**{**data, "tenants": tenants})
