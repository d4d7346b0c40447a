"""reap_children (weaver/server/app.py), the server's last step: it kills leftover
children but leaves multiprocessing's resource tracker, which ignores SIGTERM and exits by
itself with its parent. Run in a child interpreter: here it would reap pytest's children."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = """
import json, subprocess, sys, time
import psutil
from multiprocessing import resource_tracker
from weaver.server.app import reap_children

resource_tracker.ensure_running()
tracker = resource_tracker._resource_tracker._pid
sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
reap_children(grace_s=0.5)
time.sleep(0.2)
print(json.dumps({"tracker_alive": psutil.pid_exists(tracker) and
                  psutil.Process(tracker).status() != psutil.STATUS_ZOMBIE,
                  "sleeper_exit": sleeper.poll()}))
"""


def test_leftover_children_are_reaped_but_not_the_resource_tracker():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["sleeper_exit"] is not None  # terminated
    assert result["tracker_alive"]  # before, it was SIGKILLed once the grace ran out
