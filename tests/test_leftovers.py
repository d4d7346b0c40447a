"""The suite's own /dev/shm guard (tests/leftovers.py): what it counts as left behind and
whom it names."""

from __future__ import annotations

import os
import time

import leftovers


def test_an_unheld_new_entry_is_left_and_a_held_one_is_not(tmp_path):
    before = leftovers.shm_entries()
    left_path = leftovers.SHM / f"weaver-test-left-{os.getpid()}"
    held_path = leftovers.SHM / f"weaver-test-held-{os.getpid()}"
    left_path.write_bytes(b"x")
    held_path.write_bytes(b"x")
    try:
        with open(held_path, "rb"):  # this process holds it open: in use, not left
            left = leftovers.shm_left(before, grace_s=0.0)
        assert set(left) == {left_path.name}
        assert abs(left[left_path.name] - time.time()) < 60
    finally:
        leftovers.remove_shm({left_path.name, held_path.name})
    assert not left_path.exists() and not held_path.exists()


def test_the_modules_running_when_an_entry_appeared_are_named():
    windows = [("tests.a", 100.0, 200.0), ("tests.b", 150.0, 300.0), ("tests.c", 310.0, 400.0)]
    assert leftovers.suspects(160.0, windows) == ["tests.a", "tests.b"]
    assert leftovers.suspects(300.5, windows) == ["tests.b"]  # a second of slack
    assert leftovers.suspects(500.0, windows) == []
    text = leftovers.describe_shm_left({"sem.mp-x": 160.0, "psm_y": 500.0}, windows)
    assert "sem.mp-x" in text and "tests.a, tests.b" in text and "psm_y" in text and "?" in text


def test_a_live_servers_entries_beside_the_suite_are_its_own_and_a_dead_ones_are_left():
    """A `weaver serve` running beside the suite (its pairs' directory named after its
    pid) keeps its entries; the same name of a dead process is left, and removed whole."""
    before = leftovers.shm_entries()
    outside = leftovers.SHM / f"weaver{os.getppid()}-pairs"  # pytest's parent: alive, not ours
    dead = leftovers.SHM / f"weaver{_dead_pid()}-pairs"
    try:
        for directory in (outside, dead):
            directory.mkdir()
            (directory / "p0.json").write_text("{}")
        left = leftovers.shm_left(before, grace_s=0.0)
        assert dead.name in left and outside.name not in left
        leftovers.remove_shm({dead.name})
        assert not dead.exists() and outside.exists()
    finally:
        for directory in (outside, dead):
            leftovers.remove_shm({directory.name})


def _dead_pid() -> int:
    pid = 4_000_000
    while leftovers.is_process_alive(pid):
        pid += 1
    return pid
