"""The hot scheduler's KV-cache manager: vLLM's `KVCacheManager` interface over the hot
engine's local pool and one remote pool per cold engine (weaver/vllm_ext/scheduler.py builds
it, patches/routing_kv_cache_manager.py installs it in vLLM's Scheduler). Each new request is
placed in one pool by the placement policy (weaver/weaving/placement.py), and every later
call for it goes to that pool.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from vllm.v1.core.kv_cache_manager import KVCacheManager

from weaver.vllm_ext.block_pool import AllocatorBlockPool
from weaver.weaving.placement import AdaptivePlacement, Placement, RatioPlacement, cold_order

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

VICTIM_LOG_EVERY = 100  # a victim lined up in its pool is logged the 1st, 101st, ... time

# KVCacheManager's members that are the whole pool's, not a request's: they are the local
# pool's (remote requests get no prefix caching, events or stats). Listed, not forwarded
# wholesale, so that a member vLLM adds is not silently sent to one pool: the drift test
# (tests/vllm_ext/test_routing_kv_cache_manager.py) fails until it is placed here or below.
LOCAL_ATTRIBUTES = ("block_pool", "coordinator", "kv_cache_config", "enable_caching",
                    "empty_kv_cache_blocks", "max_model_len", "mamba_shared_prefix_checkpoint",
                    "num_kv_cache_groups", "prefix_cache_stats", "log_stats", "usage")
LOCAL_METHODS = ("make_prefix_cache_stats", "prefix_cache_lookup_enabled",
                 "record_prefix_cache_stats", "evict_blocks", "reset_prefix_cache",
                 "take_events", "create_kv_cache_blocks", "truncate_computed_blocks",
                 "take_boundary_state_offloads")


def _local_attribute(name: str) -> property:
    return property(lambda self: getattr(self.local, name),
                    doc=f"The local pool's {name}.")


def _local_method(name: str) -> Callable[..., Any]:
    def forward(self: RoutingKVCacheManager, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.local, name)(*args, **kwargs)

    forward.__name__ = name
    forward.__doc__ = f"The local pool's {name}."
    return forward


class RoutingKVCacheManager:
    """Stands in for vLLM's `KVCacheManager`: per-request calls go to the pool that holds
    the request (the local one, or one cold engine's remote one); the pool-wide members
    are the local pool's (LOCAL_ATTRIBUTES/METHODS)."""

    def __init__(self, local: KVCacheManager, remotes: list[KVCacheManager],
                 num_local_blocks: int, placement: RatioPlacement | AdaptivePlacement,
                 remote_available: Callable[[int], bool] | None = None,
                 running: Callable[[], list[Request]] | None = None) -> None:
        self.local = local
        self.remotes = remotes
        self.num_local_blocks = num_local_blocks
        self.placement = placement
        # False for a cold whose remote pool can give no more blocks now (its side is not
        # connected, or its unified pool's owner is gone): new placements skip it; with
        # none left every new placement is local, whatever the ratio, or a hot model that
        # places everything remotely would wait forever.
        self.remote_available = remote_available
        # The scheduler's running list (FCFS order), in which a request that cannot grow
        # lines up its preemption victim (_line_up_victim); None: vLLM's victim, unchanged.
        self.running = running
        self.num_victims_lined_up = 0
        self.placed: dict[str, Placement] = {}
        self.cold_of: dict[str, int] = {}  # a remote request's cold engine (plan order)
        self.num_placed_remote = 0  # requests ever placed remotely (a Prometheus counter)
        self._said_gone: set[int] = set()  # colds logged as unavailable
        self.peak_running_remote = 0

    def _pool(self, request_id: str) -> KVCacheManager:
        cold = self.cold_of.get(request_id)
        return self.local if cold is None else self.remotes[cold]

    def _pool_key(self, request_id: str) -> int:
        """Which pool holds a placed request: -1 local, i the i-th cold's."""
        return self.cold_of.get(request_id, -1)

    def allocate_slots(self, request: Request, num_new_tokens: int, *args, **kwargs):
        request_id = request.request_id
        if request_id in self.placed:
            blocks = self._pool(request_id).allocate_slots(
                request, num_new_tokens, *args, **kwargs)
            if blocks is None:
                self._line_up_victim(request, self._pool_key(request_id))
            return blocks
        # A new (or preempted and re-admitted) request: decide where its KV lives.
        num_remote = self.num_running_remote
        order = self.placement.order(len(self.placed) - num_remote, num_remote)
        available = [self._remote_is_available(cold) for cold in range(len(self.remotes))]
        if not any(available):
            order = [Placement.LOCAL]
        for choice in order:
            if choice is Placement.LOCAL:
                blocks = self.local.allocate_slots(request, num_new_tokens, *args, **kwargs)
                if blocks is not None:
                    self.placed[request_id] = choice
                    return blocks
                continue
            # Prefix-cache hits are local blocks; a remote request starts from none.
            remote_kwargs = kwargs if kwargs.get("new_computed_blocks") is None else {
                **kwargs, "new_computed_blocks": None, "num_new_computed_tokens": 0}
            for cold in self.cold_order(available):
                blocks = self.remotes[cold].allocate_slots(request, num_new_tokens, *args,
                                                           **remote_kwargs)
                if blocks is not None:
                    self.placed[request_id] = choice
                    self.cold_of[request_id] = cold
                    self.num_placed_remote += 1
                    self.peak_running_remote = max(self.peak_running_remote,
                                                   self.num_running_remote)
                    return blocks
        return None

    def cold_order(self, available: list[bool]) -> list[int]:
        """The colds a new remote request may go to, in the order to try them
        (weaver/weaving/placement.py cold_order); `available`: each cold's remote pool
        can give blocks now (_remote_is_available)."""
        is_open = [is_available and self.placement.cold_is_open(cold)
                   for cold, is_available in enumerate(available)]
        free = [lendable_blocks(remote.block_pool) for remote in self.remotes]
        return cold_order(free, is_open)

    def _line_up_victim(self, request: Request, pool: int) -> None:
        """A running request cannot grow in its pool; vLLM then preempts the last running
        request, again and again until this one can grow or is preempted itself
        (Scheduler.schedule, FCFS), whichever pool the victims are in. Freeing another
        pool's blocks cannot help it, so the last later request of its own pool is moved
        to the end for vLLM to take, or, when there is none, this request itself (vLLM
        then stops there): no sequence of another pool is preempted for nothing."""
        if self.running is None:
            return
        running = self.running()
        try:
            index = running.index(request)
        except ValueError:
            return  # not running (being admitted): vLLM preempts nothing for it
        victim = next((later for later in range(len(running) - 1, index - 1, -1)
                       if running[later].request_id in self.placed
                       and self._pool_key(running[later].request_id) == pool), index)
        if victim != len(running) - 1:
            running.append(running.pop(victim))
            self.num_victims_lined_up += 1
            if self.num_victims_lined_up % VICTIM_LOG_EVERY == 1:
                logger.info("a %s request could not grow: its preemption victim was taken "
                            "from its own pool (%d times so far)",
                            "local" if pool < 0 else "remote", self.num_victims_lined_up)

    def _remote_is_available(self, cold: int) -> bool:
        if self.remote_available is None or self.remote_available(cold):
            self._said_gone.discard(cold)
            return True
        if cold not in self._said_gone:
            self._said_gone.add(cold)
            logger.warning("no remote KV blocks can be had now on cold engine %d of this hot "
                           "engine (its side is not connected, or its pool is gone): new and "
                           "recomputed requests go elsewhere until it is back", cold)
        return False

    @property
    def num_running_remote(self) -> int:
        return len(self.cold_of)

    def num_running_on(self, cold: int) -> int:
        return sum(1 for index in self.cold_of.values() if index == cold)

    # --- per request: the pool that holds it ------------------------------------------
    def free(self, request: Request) -> None:
        self._pool(request.request_id).free(request)
        self._forget(request.request_id)

    def pop_blocks_for_free(self, request: Request):
        blocks = self._pool(request.request_id).pop_blocks_for_free(request)
        self._forget(request.request_id)
        return blocks

    def _forget(self, request_id: str) -> None:
        self.placed.pop(request_id, None)
        self.cold_of.pop(request_id, None)

    def get_computed_blocks(self, request: Request):
        return self._pool(request.request_id).get_computed_blocks(request)

    def get_computed_blocks_for_connector(self, request: Request):
        return self._pool(request.request_id).get_computed_blocks_for_connector(request)

    def estimate_cached_tokens(self, request: Request) -> int:
        return self._pool(request.request_id).estimate_cached_tokens(request)

    def finalize_partial_tail_offloads(self, request: Request):
        return self._pool(request.request_id).finalize_partial_tail_offloads(request)

    def get_blocks(self, request_id: str):
        return self._pool(request_id).get_blocks(request_id)

    def get_block_ids(self, request_id: str):
        return self._pool(request_id).get_block_ids(request_id)

    def get_block_ids_for_computed_tokens(self, request_id: str, *args, **kwargs):
        return self._pool(request_id).get_block_ids_for_computed_tokens(
            request_id, *args, **kwargs)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        self._pool(request.request_id).cache_blocks(request, num_computed_tokens)

    def remove_skipped_blocks(self, request_id: str, *args, **kwargs) -> None:
        self._pool(request_id).remove_skipped_blocks(request_id, *args, **kwargs)

    def record_blocks_for_zeroing(self, request_id: str, *args, **kwargs) -> None:
        self._pool(request_id).record_blocks_for_zeroing(request_id, *args, **kwargs)

    def get_num_common_prefix_blocks(self, running_request_id: str):
        return self._pool(running_request_id).get_num_common_prefix_blocks(running_request_id)

    # --- every step: every pool ---------------------------------------------------------
    def new_step_starts(self) -> None:
        for pool in (self.local, *self.remotes):
            pool.new_step_starts()

    def take_new_block_ids(self) -> list[int]:
        return [block for pool in (self.local, *self.remotes)
                for block in pool.take_new_block_ids()]

    def take_kv_cache_block_copies(self):
        copies, retained = [], []
        for pool in (self.local, *self.remotes):
            pool_copies, pool_retained = pool.take_kv_cache_block_copies()
            copies += pool_copies
            retained += pool_retained
        return copies, retained


for _name in LOCAL_ATTRIBUTES:
    setattr(RoutingKVCacheManager, _name, _local_attribute(_name))
for _name in LOCAL_METHODS:
    setattr(RoutingKVCacheManager, _name, _local_method(_name))


def lendable_blocks(block_pool: BlockPool) -> int:
    """What a cold's remote pool can lend a new sequence: its free blocks, or for blocks
    leased from a pool of pages, its spares and the room its quota still grants."""
    if isinstance(block_pool, AllocatorBlockPool):
        return block_pool.weaver_lendable_blocks()
    return block_pool.get_num_free_blocks()
