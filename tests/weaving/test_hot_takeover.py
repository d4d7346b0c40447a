"""A hot runtime carries on after its cold engine restarted (weaving/hot.py,
take_over_from): the new region gets the K/V of the remote sequences still running and the
counters go on; a pair whose remote KV lived in the dead engine's unified pool cannot.

Real shared-memory regions; `_Plan` stands in for the PairPlan fields the runtime reads."""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass

import pytest
import torch

from weaver.offload.layout import HotAttentionShape, RegionLayout
from weaver.offload.naming import region_name, region_paths
from weaver.offload.sender import OffloadSender
from weaver.offload.shm import ShmRegion
from weaver.weaving.hot import HotWeaving

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


def test_a_pair_in_a_unified_pool_cannot_take_over(name):
    owner = ShmRegion.create(LAYOUT, name)
    before = attach(name, _Plan(region_name=name))
    after = attach(name, _Plan(region_name=name, pool=object()))
    with pytest.raises(ValueError, match="unified pool"):
        after.take_over_from(before)
    for runtime in (before, after):
        runtime.sender.close()
    owner.close()
