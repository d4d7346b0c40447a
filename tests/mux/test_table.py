"""A group's turn table across real processes (weaver/mux/table.py): the invariants the
engines of a colocated group rely on."""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import signal
import time
from pathlib import Path

import pytest

from weaver.mux.table import GroupLayout, TurnTable, table_path
from weaver.mux.turns import Kind, Mode

FORK = multiprocessing.get_context("fork")


def layout(mode: Mode, group: str = "g", num: int = 3) -> GroupLayout:
    names = tuple(f"m{i}" for i in range(num))
    return GroupLayout(group, names, tuple(float(i + 1) for i in range(num)), mode)


def run_member(group: GroupLayout, runtime_dir: Path, index: int, num_steps: int,
               out: Path) -> None:
    rng = random.Random(index)
    table = TurnTable.open(group, runtime_dir)
    records = []
    for _ in range(num_steps):
        kind = rng.choice([Kind.PREFILL, Kind.DECODE])
        table.start(index, kind)
        began = time.monotonic()
        time.sleep(rng.uniform(0.0005, 0.003))
        records.append((began, time.monotonic(), kind.value))
        table.finish(index)
    out.write_text(json.dumps(records))


def run_group(mode: Mode, tmp_path: Path, num_steps: int = 60) -> dict[int, list]:
    group = layout(mode)
    procs = [FORK.Process(target=run_member,
                          args=(group, tmp_path, i, num_steps, tmp_path / f"{i}.json"))
             for i in range(len(group.members))]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=60)
        assert proc.exitcode == 0, "a member hung or failed"
    return {i: json.loads((tmp_path / f"{i}.json").read_text()) for i in range(len(procs))}


def overlaps(steps: dict[int, list]) -> list[tuple]:
    flat = [(b, e, kind, i) for i, records in steps.items() for b, e, kind in records]
    return [(x, y) for n, x in enumerate(flat) for y in flat[n + 1:]
            if x[0] < y[1] and y[0] < x[1]]


def test_temporal_steps_never_overlap(tmp_path):
    steps = run_group(Mode.TEMPORAL, tmp_path)
    assert all(len(records) == 60 for records in steps.values())
    assert overlaps(steps) == []


def test_spatial_temporal_overlaps_only_a_prefill_with_another_models_decode(tmp_path):
    steps = run_group(Mode.SPATIAL_TEMPORAL, tmp_path)
    pairs = overlaps(steps)
    for x, y in pairs:
        assert x[3] != y[3] and {x[2], y[2]} == {"prefill", "decode"}, (x, y)
    table = TurnTable.open(layout(Mode.SPATIAL_TEMPORAL), tmp_path)
    counters = table.counters()
    assert sum(c.num_prefill_steps + c.num_decode_steps for c in counters) == 180
    # Recorded intervals sit inside granted ones: every overlap seen was granted as one.
    assert sum(c.num_overlapped for c in counters) >= len(pairs) > 0


def hold_turn_and_die(group: GroupLayout, runtime_dir: Path) -> None:
    table = TurnTable.open(group, runtime_dir)
    table.start(0, Kind.PREFILL)
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_member_that_dies_during_its_step_gives_its_turn_back(tmp_path):
    group = layout(Mode.TEMPORAL, num=2)
    proc = FORK.Process(target=hold_turn_and_die, args=(group, tmp_path))
    proc.start()
    proc.join(timeout=30)
    assert proc.exitcode == -signal.SIGKILL
    table = TurnTable.open(group, tmp_path)
    assert table.running() == [(0, Kind.PREFILL)]
    assert table.try_start(1, Kind.DECODE)
    assert table.counters()[0].num_reclaimed == 1


def test_a_table_in_use_by_other_live_members_is_refused(tmp_path):
    first = TurnTable.open(layout(Mode.TEMPORAL, num=2), tmp_path)
    assert first.try_start(0, Kind.DECODE)  # this process is a live member now
    with pytest.raises(ValueError, match="other members"):
        TurnTable.open(layout(Mode.TEMPORAL, num=3), tmp_path)
    assert table_path("g", tmp_path).exists()


def test_a_stale_table_of_dead_engines_is_reset(tmp_path):
    path = table_path("g", tmp_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\x01" * 64)
    table = TurnTable.open(layout(Mode.TEMPORAL, num=2), tmp_path)
    assert [c.num_decode_steps for c in table.counters()] == [0, 0]
