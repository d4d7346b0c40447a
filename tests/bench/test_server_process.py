"""A server started by `weaver.bench.server_process` does not outlive a killed parent."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest

PARENT = """
import subprocess, sys, time
from weaver.bench.server_process import popen_dying_with_parent
start = popen_dying_with_parent if sys.argv[1] == "dying" else subprocess.Popen
child = start([sys.executable, "-c", "import time; time.sleep(120)"])
print(child.pid, flush=True)
time.sleep(120)
"""


def _is_gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _child_after_parent_killed(mode: str, wait_s: float) -> tuple[int, bool]:
    """Start a parent that starts a child, SIGKILL the parent (no finally block runs),
    and say whether the child is gone within `wait_s`."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT, mode], stdout=subprocess.PIPE,
                              text=True)
    try:
        child_pid = int(parent.stdout.readline())
        assert not _is_gone(child_pid)
    finally:
        parent.kill()
        parent.wait(timeout=30)
        parent.stdout.close()
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and not _is_gone(child_pid):
        time.sleep(0.1)
    return child_pid, _is_gone(child_pid)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux")
def test_child_gets_sigterm_when_its_parent_is_killed():
    _, gone = _child_after_parent_killed("dying", wait_s=10)
    assert gone


def test_without_it_the_child_would_outlive_its_parent():
    """The control: a plain Popen child survives, so the test above can fail."""
    child_pid, gone = _child_after_parent_killed("plain", wait_s=2)
    try:
        assert not gone
    finally:
        if not gone:
            psutil.Process(child_pid).kill()
