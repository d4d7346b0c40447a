"""Where RoutingKVCacheManager places a new request (the hot scheduler's local/remote split),
and that it stands in for all of vLLM's KVCacheManager (a drift check: nothing falls
through to one pool unlisted).

The pools (the local one, one remote one per cold engine) are stand-ins for vLLM's
KVCacheManager that only count blocks: placement reads nothing else of them. The
engine-level behaviour (a unified pool whose owner dies) is pinned end to end in
tests/weaving/test_unified_pool_e2e.py."""

from __future__ import annotations

import importlib.util
import inspect
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed", allow_module_level=True)

from weaver.vllm_ext.routing_kv_cache_manager import RoutingKVCacheManager  # noqa: E402
from weaver.weaving.placement import Placement, RatioPlacement  # noqa: E402


@dataclass
class FakeRequest:
    request_id: str


class CountingPool:
    """Stand-in for a KVCacheManager: hands out `num_free` blocks, one per allocation."""

    def __init__(self, num_free: int) -> None:
        self.num_free = num_free
        self.held: dict[str, int] = {}
        self.block_pool = self  # what placement reads of a remote pool: its free count

    def allocate_slots(self, request: FakeRequest, num_new_tokens: int, *args, **kwargs):
        if self.num_free < 1:
            return None
        self.num_free -= 1
        self.held[request.request_id] = self.held.get(request.request_id, 0) + 1
        return ("blocks", request.request_id)

    def get_num_free_blocks(self) -> int:
        return self.num_free


def routing(ratio: float, *, local: int, remote: int, remote_available=None):
    return RoutingKVCacheManager(CountingPool(local), [CountingPool(remote)], 8,
                                 RatioPlacement(ratio), remote_available=remote_available)


def test_all_remote_places_every_request_remotely_while_the_pool_gives_blocks():
    manager = routing(1.0, local=4, remote=4)
    for i in range(3):
        assert manager.allocate_slots(FakeRequest(f"r{i}"), 16) is not None
    assert set(manager.placed.values()) == {Placement.REMOTE}
    # Ratio 1.0 means "always remote": no spill to local when the remote pool is full.
    manager.remotes[0].num_free = 0
    assert manager.allocate_slots(FakeRequest("r3"), 16) is None


def test_once_the_remote_pool_is_gone_new_requests_are_placed_locally():
    available = [True]
    manager = routing(1.0, local=4, remote=4, remote_available=lambda cold: available[0])
    assert manager.allocate_slots(FakeRequest("before"), 16) is not None
    available[0] = False  # e.g. the unified pool's owner died: its lease is broken
    assert manager.allocate_slots(FakeRequest("after"), 16) is not None
    assert manager.placed == {"before": Placement.REMOTE, "after": Placement.LOCAL}
    assert manager.local.held == {"after": 1}
    # A request already placed keeps its pool (its K/V are where they are).
    assert manager.allocate_slots(FakeRequest("before"), 1) is not None
    assert manager.remotes[0].held == {"before": 2}


def test_a_spilling_ratio_never_tries_a_remote_pool_that_is_gone():
    manager = routing(0.5, local=1, remote=4, remote_available=lambda cold: False)
    assert manager.allocate_slots(FakeRequest("a"), 16) is not None
    assert manager.allocate_slots(FakeRequest("b"), 16) is None  # local full: it waits
    assert manager.remotes[0].held == {}


def _public_members(cls: type) -> set[str]:
    return {name for name, _ in inspect.getmembers(cls) if not name.startswith("_")}


def test_every_public_member_of_kv_cache_manager_is_routed_or_placed():
    """A member vLLM adds to KVCacheManager must be placed on purpose: per request (routed)
    or pool-wide (LOCAL_*); RoutingKVCacheManager forwards nothing by default."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    missing = _public_members(KVCacheManager) - _public_members(RoutingKVCacheManager)
    assert not missing, f"KVCacheManager members RoutingKVCacheManager lacks: {missing}"


def test_every_member_vllm_reads_of_the_manager_is_there():
    """Everything vLLM's v1 code reads as `kv_cache_manager.<name>` (attributes set in
    KVCacheManager.__init__ included), found in its source."""
    import vllm.v1

    root = Path(vllm.v1.__file__).parent
    read = {match for path in root.rglob("*.py")
            for match in re.findall(r"kv_cache_manager\.([A-Za-z]\w*)", path.read_text())}
    assert read, "found no reads of kv_cache_manager in vLLM: the search is broken"
    missing = {name for name in read if not hasattr(RoutingKVCacheManager, name)}
    assert not missing, f"vLLM reads {missing} of the KV-cache manager"


def test_pool_wide_members_are_the_local_pools():
    local, remote = CountingPool(1), CountingPool(1)
    local.usage, local.block_pool = 0.25, "local pool"
    local.evict_blocks = lambda ids: ("evicted", ids)
    manager = RoutingKVCacheManager(local, [remote], 8, RatioPlacement(0.5))
    assert manager.usage == 0.25 and manager.block_pool == "local pool"
    assert manager.evict_blocks({3}) == ("evicted", {3})
    with pytest.raises(AttributeError):
        manager.not_a_member  # noqa: B018  # nothing else falls through


def test_auto_places_locally_until_the_local_pool_is_full_then_fills_the_remote_pool():
    from weaver.weaving.placement import AdaptivePlacement

    manager = RoutingKVCacheManager(CountingPool(2), [CountingPool(3)], 8, AdaptivePlacement())
    for i in range(2):  # not KV-bound: nothing goes remote
        assert manager.allocate_slots(FakeRequest(f"l{i}"), 16) is not None
    assert set(manager.placed.values()) == {Placement.LOCAL}
    for i in range(3):  # KV-bound: the remote pool fills
        assert manager.allocate_slots(FakeRequest(f"r{i}"), 16) is not None
    assert sum(p is Placement.REMOTE for p in manager.placed.values()) == 3
    assert manager.allocate_slots(FakeRequest("waits"), 16) is None  # both full


def test_auto_that_stepped_aside_sends_nothing_remote():
    from weaver.weaving.placement import AdaptivePlacement, PairLoad

    placement = AdaptivePlacement()
    placement.observe_step(0.05, 4, 1)  # one remote sequence running
    placement.observe_pair(PairLoad(cold_inflation=1.3))  # over the 1.10 budget
    assert placement.update(now=0.0) and not placement.is_open
    manager = RoutingKVCacheManager(CountingPool(1), [CountingPool(3)], 8, placement)
    assert manager.allocate_slots(FakeRequest("a"), 16) is not None
    assert manager.allocate_slots(FakeRequest("b"), 16) is None  # local full: it waits
    assert manager.remotes[0].held == {}


def _fcfs_grow(manager: RoutingKVCacheManager, running: list, request) -> list:
    """vLLM's FCFS loop for one running request that needs a block (Scheduler.schedule):
    preempt running[-1] until it can grow or is preempted itself; the victims."""
    victims = []
    while manager.allocate_slots(request, 1) is None:
        victim = running.pop()
        manager.free(victim)
        victims.append(victim.request_id)
        if victim is request:
            break
    return victims


def place(manager: RoutingKVCacheManager, request, cold: int | None) -> None:
    """Place a request as allocate_slots would: locally (None) or on cold `cold`."""
    manager.placed[request.request_id] = Placement.LOCAL if cold is None else Placement.REMOTE
    if cold is not None:
        manager.cold_of[request.request_id] = cold
    (manager.local if cold is None else manager.remotes[cold]).allocate_slots(request, 1)


class FreeingPool(CountingPool):
    def free(self, request: FakeRequest) -> None:
        self.num_free += self.held.pop(request.request_id, 0)


def test_a_request_that_cannot_grow_preempts_in_its_own_pool_only():
    # Admission order l0 r0 l1 r1 r2: the local pool (2 blocks) is full, the remote one
    # has room. l0 needs a block: vLLM alone would preempt r2, r1, then l1.
    running: list = []
    manager = RoutingKVCacheManager(FreeingPool(2), [FreeingPool(8)], 8, RatioPlacement(0.5),
                                    running=lambda: running)
    for name in ("l0", "r0", "l1", "r1", "r2"):
        request = FakeRequest(name)
        place(manager, request, 0 if name[0] == "r" else None)
        running.append(request)
    assert _fcfs_grow(manager, running, running[0]) == ["l1"]
    assert [r.request_id for r in running] == ["l0", "r0", "r1", "r2"]  # order kept
    assert manager.num_victims_lined_up == 1
    # The last local request itself cannot grow: it is the victim, no remote one is.
    l0 = running[0]
    manager.local.num_free = 0
    assert _fcfs_grow(manager, running, l0) == ["l0"]
    assert [r.request_id for r in running] == ["r0", "r1", "r2"]


def test_without_the_running_list_vllms_victim_stands():
    running: list = []
    manager = RoutingKVCacheManager(FreeingPool(1), [FreeingPool(8)], 8, RatioPlacement(0.5))
    for name in ("l0", "r0"):
        request = FakeRequest(name)
        place(manager, request, 0 if name[0] == "r" else None)
        running.append(request)
    assert _fcfs_grow(manager, running, running[0]) == ["r0", "l0"]


def test_a_remote_request_goes_to_the_connected_cold_with_most_free_blocks():
    connected = [True, True, True]
    manager = RoutingKVCacheManager(FreeingPool(0), [FreeingPool(2), FreeingPool(3),
                                                     FreeingPool(9)], 8, RatioPlacement(1.0),
                                    remote_available=lambda cold: connected[cold])
    connected[2] = False  # its side is not linked (or died): skipped, however free
    for name in ("a", "b", "c", "d"):
        assert manager.allocate_slots(FakeRequest(name), 16) is not None
    assert manager.cold_of == {"a": 1, "b": 0, "c": 1, "d": 0}  # the freer first, ties: order
    assert manager.num_running_on(0) == 2 == manager.num_running_on(1)
    assert manager.num_running_remote == 4
    assert manager.allocate_slots(FakeRequest("e"), 16) is not None  # cold 1's last block
    assert manager.allocate_slots(FakeRequest("f"), 16) is None  # both full: it waits
    manager.free(FakeRequest("a"))
    assert "a" not in manager.cold_of and "a" not in manager.placed


def test_auto_sends_no_new_sequence_to_a_cold_over_its_budget():
    from weaver.weaving.placement import AdaptivePlacement, PairLoad

    placement = AdaptivePlacement()
    placement.observe_pair(PairLoad.of_colds([{"cold_inflation": 1.3}, {"cold_inflation": 1.0}]))
    manager = RoutingKVCacheManager(CountingPool(0), [CountingPool(9), CountingPool(2)], 8,
                                    placement)
    for name in ("a", "b"):
        assert manager.allocate_slots(FakeRequest(name), 16) is not None
    assert manager.cold_of == {"a": 1, "b": 1}
    assert manager.allocate_slots(FakeRequest("c"), 16) is None


def test_a_request_that_cannot_grow_preempts_on_its_own_cold_only():
    running: list = []
    manager = RoutingKVCacheManager(FreeingPool(8), [FreeingPool(2), FreeingPool(8)], 8,
                                    RatioPlacement(1.0), running=lambda: running)
    for name, cold in (("a0", 0), ("b0", 1), ("a1", 0), ("b1", 1)):
        request = FakeRequest(name)
        place(manager, request, cold)
        running.append(request)
    assert _fcfs_grow(manager, running, running[0]) == ["a1"]  # not b1 of the other cold
    assert [r.request_id for r in running] == ["a0", "b0", "b1"]


def test_a_cold_over_its_budget_gets_its_newest_remote_requests_preempted():
    """The hot scheduler's part of shed_for_cold (weaver/weaving/placement.py): vLLM's own
    preemption of the newest requests on that cold, no other cold's, no local one."""
    from weaver.vllm_ext.scheduler import shed_remote

    class StandInScheduler:  # the members of vLLM's Scheduler that shed_remote touches
        def __init__(self, manager: RoutingKVCacheManager) -> None:
            self.kv_cache_manager, self.running, self.preempted = manager, [], []

        def _preempt_request(self, request, timestamp: float) -> None:
            self.kv_cache_manager.free(request)
            self.preempted.append(request.request_id)

    manager = RoutingKVCacheManager(FreeingPool(8), [FreeingPool(8), FreeingPool(8)], 8,
                                    RatioPlacement(1.0))
    scheduler = StandInScheduler(manager)
    for name, cold in (("a0", 0), ("l0", None), ("b0", 1), ("a1", 0), ("a2", 0), ("l1", None)):
        request = FakeRequest(name)
        place(manager, request, cold)
        scheduler.running.append(request)
    shed_remote(scheduler, [2, 0])
    assert scheduler.preempted == ["a2", "a1"]
    assert [r.request_id for r in scheduler.running] == ["a0", "l0", "b0", "l1"]
    assert manager.num_running_on(0) == 1 and manager.remotes[0].num_free == 7
