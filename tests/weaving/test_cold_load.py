"""The cold TPOT factor the cold side publishes for the adaptive placement
(weaver/weaving/cold_load.py)."""

from __future__ import annotations

import os
import threading
import uuid

import pytest

from weaver.offload.layout import HotAttentionShape, RegionLayout
from weaver.offload.naming import region_name, region_paths
from weaver.offload.receiver import OffloadReceiver
from weaver.offload.sender import OffloadSender
from weaver.offload.shm import ShmRegion
from weaver.weaving.cold import ColdWeaving
from weaver.weaving.cold_load import ColdInflation, StepMeter, factor
from weaver.weaving.hot import HotWeaving


def test_factor_is_step_time_over_own_compute():
    # 10 s window: steps held 5 s, of which 0.4 s served tasks; 0.1 s waited on the idle
    # poller: (5 + 0.1) / 4.6.
    assert factor((0.0, 0, 0, 0), (10.0, 5.0, 0.1, 0.4)) == pytest.approx(5.1 / 4.6)
    assert factor((0.0, 0, 0, 0), (10.0, 0.1, 0.0, 0.05)) == 1.0  # idle: nothing to hurt
    assert factor((0.0, 0, 0, 0), (0.0, 0.0, 0.0, 0.0)) == 1.0


def test_step_meter_times_held_and_waited():
    lock = threading.Lock()
    meter = StepMeter(lock)
    with meter:
        assert lock.locked()
    assert not lock.locked() and meter.held_s >= 0 and meter.waited_s >= 0
    meter.held_s = meter.waited_s = 0.0
    task_s = [0.0]
    inflation = ColdInflation(meter, lambda: task_s[0], window_s=1.0)
    assert inflation.sample(0.0) == 1.0
    meter.held_s, meter.waited_s, task_s[0] = 0.5, 0.0, 0.1
    assert inflation.sample(1.0) == pytest.approx(0.5 / 0.4)
    # The window slides: only the last second counts.
    meter.held_s = 0.6
    assert inflation.sample(2.5) == pytest.approx(1.0)  # 0.1 s held in 1.5 s: idle


def test_a_cold_hosting_two_hots_gives_both_its_one_tpot_factor():
    """The cold TPOT budget of several hots weaving into one cold is shared by feedback:
    the cold side measures its factor once, over every hot's tasks, and writes it into
    each hot's region; each hot's adaptive placement holds that one factor to the budget
    (tests/weaving/test_adaptive_placement.py), so together they cut."""
    shape = HotAttentionShape(num_layers=1, num_q_heads=2, num_kv_heads=1, head_size=8,
                              block_size=4, dtype="float32")
    layout = RegionLayout(shape, num_remote_blocks=2, max_seqs_per_task=1,
                          max_blocks_per_seq=2)
    names = [region_name(f"wvtest{os.getpid()}", hot, uuid.uuid4().hex[:8])
             for hot in ("hot-a", "hot-b")]
    cold = ColdWeaving({name: OffloadReceiver(ShmRegion.create(layout, name), lambda t: None)
                        for name in names})
    hots = [HotWeaving(None, OffloadSender(ShmRegion.attach(layout, name))) for name in names]
    try:
        cold.inflation.sample = lambda now: 1.25  # a measured window, standing in
        cold.publish_load(now=0.0)
        assert [hot.pair_load()["cold_inflation"] for hot in hots] == [1.25, 1.25]
    finally:
        for hot in hots:
            hot.sender.close()
        cold.close()
        for name in names:
            for path in region_paths(name):
                assert not os.path.exists(path)
