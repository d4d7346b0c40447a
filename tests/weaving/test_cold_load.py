"""The cold TPOT factor the cold side publishes for the adaptive placement
(weaver/weaving/cold_load.py)."""

from __future__ import annotations

import threading

import pytest

from weaver.weaving.cold_load import ColdInflation, StepMeter, factor


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
