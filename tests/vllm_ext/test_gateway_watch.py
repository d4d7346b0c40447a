"""An engine process ends with the `weaver serve` that started it
(weaver/vllm_ext/gateway_watch.py): a stand-in gateway SIGKILLed, its stand-in EngineCore
(a real process running the watch) stops on its own; one without a gateway is left alone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

from weaver.processes import is_process_alive
from weaver.vllm_ext.gateway_watch import GATEWAY_PID_ENV, follow_gateway, wait_for_exit

# The engine: follows its gateway (the real stop: SIGTERM to itself), then sleeps.
ENGINE = textwrap.dedent("""
    import time
    from weaver.vllm_ext.gateway_watch import follow_gateway
    follow_gateway()
    print("watching", flush=True)
    time.sleep(120)
""")
# The gateway: starts the engine with its pid in the environment, says the engine's pid.
GATEWAY = textwrap.dedent(f"""
    import os, subprocess, sys, time
    env = dict(os.environ, {GATEWAY_PID_ENV}=str(os.getpid()))
    engine = subprocess.Popen([sys.executable, "-c", sys.argv[1]], env=env,
                              stdout=subprocess.PIPE, text=True)
    engine.stdout.readline()  # watching
    print(engine.pid, flush=True)
    time.sleep(120)
""")


def test_an_engine_stops_once_its_gateway_is_killed():
    gateway = subprocess.Popen([sys.executable, "-c", GATEWAY, ENGINE], stdout=subprocess.PIPE,
                               text=True)
    engine = int(gateway.stdout.readline())
    try:
        assert is_process_alive(engine)
        gateway.send_signal(signal.SIGKILL)
        gateway.wait()
        deadline = time.monotonic() + 30
        while is_process_alive(engine) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not is_process_alive(engine), "the engine outlived its gateway"
    finally:
        if gateway.poll() is None:
            gateway.kill()
        if is_process_alive(engine):
            os.kill(engine, signal.SIGKILL)
        gateway.stdout.close()


def test_no_gateway_named_no_watch(monkeypatch):
    monkeypatch.delenv(GATEWAY_PID_ENV, raising=False)
    assert follow_gateway(stop=lambda: None) is None


def test_the_watch_runs_its_stop_when_the_process_ends(monkeypatch):
    sleeper = subprocess.Popen(["sleep", "60"])
    monkeypatch.setenv(GATEWAY_PID_ENV, str(sleeper.pid))
    stopped = threading.Event()
    thread = follow_gateway(stop=stopped.set)
    assert thread is not None and thread.daemon
    assert not stopped.wait(0.3)  # the gateway lives
    sleeper.kill()
    sleeper.wait()
    assert stopped.wait(10)
    wait_for_exit(sleeper.pid)  # a process already gone: returns at once
