"""A hot runtime carries on after its cold engine restarted (weaving/hot.py,
take_over_from): the new region gets the K/V of the remote sequences still running and the
counters go on; a pair whose remote KV lives in a pool (the dead engine's unified pool, or
the gateway's loan pool) lets the old mapping go and carries its counters on. A pair
degraded by one late task resumes once its cold side answers again (settle_step).

Real shared-memory regions; `_Plan` stands in for the PairPlan fields the runtime reads."""

from __future__ import annotations

import os
import threading
import time
import uuid
from dataclasses import dataclass

import pytest
import torch

from weaver.offload.layout import HotAttentionShape, RegionLayout
from weaver.offload.naming import region_name, region_paths
from weaver.offload.protocol import OffloadTask
from weaver.offload.receiver import OffloadReceiver
from weaver.offload.sender import OffloadSender
from weaver.offload.shm import ShmRegion
from weaver.weaving.hot import RESUME_FIRST_S, HotWeaving, RemoteRows, RowGroup
from weaver.weaving.hot_pairs import HotPairs, StepRows

SHAPE = HotAttentionShape(num_layers=2, num_q_heads=4, num_kv_heads=2, head_size=8,
                          block_size=4, dtype="float32")
LAYOUT = RegionLayout(SHAPE, num_remote_blocks=6, max_seqs_per_task=2, max_blocks_per_seq=3)


@dataclass
class _Plan:
    hot: str = "h"
    cold: str = "c"
    shape: HotAttentionShape = SHAPE
    pool: object = None
    region_name: str = ""
    timeout_s: float = 0.05
    num_remote_blocks: int = LAYOUT.num_remote_blocks


@pytest.fixture
def name():
    name = region_name(f"wvtest{os.getpid()}", "takeover", uuid.uuid4().hex[:8])
    yield name
    for path in region_paths(name):
        if os.path.exists(path):
            os.unlink(path)


def attach(name: str, plan: _Plan) -> HotWeaving:
    return HotWeaving(plan, OffloadSender(ShmRegion.attach(LAYOUT, name)))


def test_a_restarted_cold_sides_region_gets_the_running_sequences_kv(name):
    plan = _Plan(region_name=name)
    first_owner = ShmRegion.create(LAYOUT, name)
    before = attach(name, plan)
    written = [torch.randn_like(before.sender.kv_layer(i)) for i in range(SHAPE.num_layers)]
    for layer, values in enumerate(written):
        before.sender.kv_layer(layer).copy_(values)
    before.stats.num_offloaded_tasks = 17
    first_owner.close()  # the cold engine died: its names are gone, the mapping stays here
    second_owner = ShmRegion.create(LAYOUT, name)  # the restarted cold worker's region
    after = attach(name, plan)
    after.take_over_from(before)
    for layer, values in enumerate(written):
        assert torch.equal(after.sender.kv_layer(layer), values)
    assert after.stats.num_offloaded_tasks == 17 and after.degraded_reason is None
    with pytest.raises(ValueError, match="closed"):
        before.sender.kv_layer(0)
    after.sender.close()
    second_owner.close()


class _PoolKV:
    """A unified pool's mapping as the runtime sees it (RemotePoolKV's close)."""

    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


@dataclass
class _PoolPlan:
    owner: str | None  # the cold engine's tenant for a unified pool; None for a loan pool


@pytest.mark.parametrize("owner", ["c", None], ids=["unified_pool", "loan_pool"])
def test_a_pair_in_a_pool_takes_over_with_the_new_mapping_and_lets_the_old_one_go(name, owner):
    """Nothing is copied: a unified pool died with the cold engine (the scheduler preempted
    every request on it before this attach), a loan pool outlived it (the new mapping is of
    the same pages). The old mapping is closed, the counters go on."""
    plan = _Plan(region_name=name, pool=_PoolPlan(owner))
    first_owner = ShmRegion.create(LAYOUT, name)
    old_pool, new_pool = _PoolKV(), _PoolKV()
    before = HotWeaving(plan, OffloadSender(ShmRegion.attach(LAYOUT, name)), old_pool)
    before.sender.kv_layer(0).fill_(3.0)
    before.stats.num_offloaded_tasks = 5
    first_owner.close()
    second_owner = ShmRegion.create(LAYOUT, name)
    after = HotWeaving(plan, OffloadSender(ShmRegion.attach(LAYOUT, name)), new_pool)
    after.take_over_from(before)
    assert old_pool.closed and not new_pool.closed
    assert not after.sender.kv_layer(0).any()  # the region's KV section is not the pool's
    assert after.stats.num_offloaded_tasks == 5
    with pytest.raises(ValueError, match="closed"):
        before.sender.kv_layer(0)
    after.sender.close()
    second_owner.close()


def _one_decode_step() -> StepRows:
    rows = RowGroup(tokens=torch.tensor([0]), query_start_loc=torch.tensor([0, 1]),
                    seq_lens=torch.tensor([3]), block_table=torch.tensor([[0]]))
    return StepRows(local=None, remotes=[RemoteRows(0, prefill=None, decode=rows)])


class _HereAttention:
    """The remote pool as the hot side reads it when degraded: writes -1."""

    def attend(self, ops, rows: RowGroup, query: torch.Tensor, output: torch.Tensor) -> None:
        output[rows.tokens] = -1.0


def _attend(runtime: HotWeaving) -> torch.Tensor:
    query = torch.zeros(1, SHAPE.num_q_heads, SHAPE.head_size)
    return HotPairs.of(runtime).attend(None, 0, _one_decode_step(), query,
                                       torch.zeros_like(query), scale=1.0, sliding_window=-1,
                                       softcap=0.0)


def test_a_pair_degraded_by_a_late_task_resumes_once_its_cold_side_answers(name):
    def cold_answers_ones(task: OffloadTask) -> None:
        task.out.fill_(1.0)

    owner = ShmRegion.create(LAYOUT, name)
    receiver = OffloadReceiver(owner, cold_answers_ones)  # served only when polled here
    runtime = HotWeaving(_Plan(region_name=name),
                         OffloadSender(ShmRegion.attach(LAYOUT, name)), _HereAttention())
    now = [100.0]
    runtime.clock = lambda: now[0]
    # Nobody polls: the task is late, its rows are attended here, the pair degrades.
    assert torch.all(_attend(runtime) == -1.0)
    assert "not done" in runtime.degraded_reason
    assert runtime.resume_at == 100.0 + RESUME_FIRST_S
    # Back-off over, but the late task is still unserved: no resume, a longer back-off.
    now[0] += RESUME_FIRST_S
    runtime.settle_step()
    assert runtime.degraded_reason is not None
    assert runtime.resume_at == now[0] + 2 * RESUME_FIRST_S
    assert torch.all(_attend(runtime) == -1.0)  # still here: nothing was sent
    assert receiver.poll() and receiver.stats.num_served == 1  # the late task, served now
    now[0] += 2 * RESUME_FIRST_S
    runtime.settle_step()
    assert runtime.degraded_reason is None and runtime.stats.num_resumes == 1
    served = threading.Thread(target=lambda: [receiver.poll() or time.sleep(0.001)
                                              for _ in range(2000)
                                              if receiver.stats.num_served < 2])
    served.start()
    assert torch.all(_attend(runtime) == 1.0)  # offloaded again, answered by the cold side
    served.join()
    assert runtime.drain_stats()["resumes"] == 1 and runtime.stats.num_fallback_tasks == 2
    runtime.sender.close()
    receiver.close()


def test_a_pair_whose_cold_side_closed_stays_degraded(name):
    owner = ShmRegion.create(LAYOUT, name)
    receiver = OffloadReceiver(owner, lambda task: task.out.zero_())
    runtime = HotWeaving(_Plan(region_name=name),
                         OffloadSender(ShmRegion.attach(LAYOUT, name)), _HereAttention())
    receiver.close()
    assert torch.all(_attend(runtime) == -1.0)
    assert "CLOSED" in runtime.degraded_reason and runtime.resume_at is None
    runtime.sender.close()
