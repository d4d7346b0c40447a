"""cpu_cores: vLLM's bind syntax parsed with clear errors, an engine's scheduler process
pinned thread by thread, and the front end pinned with what it starts
(weaver/config/cpu_cores.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from weaver.config.cpu_cores import (
    parse_cpu_cores,
    pin_engine_processes,
    pin_frontend,
    pin_process_threads,
    usable_cpu_cores,
)


@pytest.mark.parametrize(("text", "cores"), [
    ("0", {0}), ("0-3", {0, 1, 2, 3}), ("0,2", {0, 2}), (" 1 ", {1}),
    ("0-1|2-3", {0, 1, 2, 3}), ("0-1,5", {0, 1, 5}),
])
def test_parses_vllm_bind_syntax(text, cores):
    assert parse_cpu_cores(text) == frozenset(cores)


@pytest.mark.parametrize("text", ["auto", "nobind"])
def test_unbound_values_name_no_cores(text):
    assert parse_cpu_cores(text) is None


@pytest.mark.parametrize(("text", "message"), [
    ("zero", "not a core or a range"), ("0-", "not a core or a range"),
    ("1-2-3", "not a core or a range"), ("3-1", "runs backwards"), ("", "not a core"),
])
def test_bad_values_say_what_is_wrong(text, message):
    with pytest.raises(ValueError, match=message):
        parse_cpu_cores(text)


def test_cores_this_machine_lacks_are_refused_before_start():
    missing = os.cpu_count()
    with pytest.raises(ValueError, match=f"names cores \\[{missing}\\]"):
        usable_cpu_cores("model 'm'", str(missing))
    assert usable_cpu_cores("m", "nobind") is None


def test_a_process_pinned_elsewhere_may_still_name_other_cores():
    # The benchmark pins the gateway to the hot core; it starts the cold engine on another.
    saved = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(saved)})
    try:
        assert usable_cpu_cores("m", f"0-{os.cpu_count() - 1}") == frozenset(
            range(os.cpu_count()))
    finally:
        os.sched_setaffinity(0, saved)


CHILD = """
import threading, time
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
print("ready", flush=True)
time.sleep(60)
"""


def _thread_affinities(pid: int) -> dict[int, set[int]]:
    return {int(tid): os.sched_getaffinity(int(tid)) for tid in os.listdir(f"/proc/{pid}/task")}


def test_every_thread_of_the_process_is_pinned():
    core = min(os.sched_getaffinity(0))
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        before = _thread_affinities(child.pid)
        assert len(before) >= 2
        pin_engine_processes("m", [child.pid], frozenset({core}))
        after = _thread_affinities(child.pid)
        assert set(after) == set(before)
        assert all(cores == {core} for cores in after.values())
        assert pin_process_threads(child.pid, frozenset(os.sched_getaffinity(0))) == len(after)
    finally:
        child.kill()
        child.wait(timeout=10)


FRONTEND = """
import os, subprocess, sys, threading, time
from weaver.config.cpu_cores import pin_frontend
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()  # before the pin
assert pin_frontend("--frontend-cores", sys.argv[1]) == {int(sys.argv[1])}
CHILD = "import os; print(sorted(os.sched_getaffinity(0)))"
started = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                         check=True).stdout.strip()
own = {tuple(sorted(os.sched_getaffinity(int(t)))) for t in os.listdir("/proc/self/task")}
print(sorted(own), started)
"""


def test_the_frontend_and_what_it_starts_run_on_the_frontend_cores():
    # In a child: pinning the test process itself would pin the rest of the suite.
    core = max(os.sched_getaffinity(0))
    out = subprocess.run([sys.executable, "-c", FRONTEND, str(core)], capture_output=True,
                         text=True, check=True, timeout=60).stdout.split()
    assert " ".join(out) == f"[({core},)] [{core}]"


def test_frontend_cores_left_to_the_os_or_wrong_say_so():
    assert pin_frontend("--frontend-cores", "auto") is None  # pins nothing
    with pytest.raises(ValueError, match="--frontend-cores: cpu_cores 'x'"):
        pin_frontend("--frontend-cores", "x")


CONFINED = """
import os, sys
from weaver.config.cpu_cores import pin_frontend
os.sched_setaffinity(0, {int(sys.argv[1])})
try:
    pin_frontend("--frontend-cores", sys.argv[2])
except ValueError as exc:
    print(exc)
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two usable cores")
def test_frontend_cores_this_process_may_not_use_are_refused():
    allowed = sorted(os.sched_getaffinity(0))
    out = subprocess.run([sys.executable, "-c", CONFINED, str(allowed[0]), str(allowed[1])],
                         capture_output=True, text=True, check=True, timeout=60).stdout
    assert f"names cores this process may not use (it may use [{allowed[0]}])" in out
