"""An EngineCore that outlives the `weaver serve` that started it stops itself.

vLLM's workers stop when their EngineCore dies (the executor's death pipe), but an
EngineCore does not watch the process that spawned it: a gateway killed by SIGKILL (or by a
signal it does not handle) left its EngineCores and their workers running for good, ~2 GB
each on this machine (seen: eight such processes after two gateways were killed). The
gateway names itself in its engines' environment (GATEWAY_PID_ENV, set by
weaver/vllm_ext/engine/app.py); once an EngineCore's loop starts, a daemon thread waits for
that process to end, then sends the EngineCore SIGTERM (vLLM's own shutdown, which takes
its workers and their message queues with it) and SIGKILL if it is still there after
STOP_GRACE_S. An engine with a Weaver block under plain `vllm serve` watches its front end
the same way (the plugin names it when it completes the engine's config:
weaver/vllm_ext/plain_serve.py); other engines have no such variable and are left alone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import threading
import time
from collections.abc import Callable

from weaver.processes import is_process_alive

logger = logging.getLogger(__name__)

GATEWAY_PID_ENV = "WEAVER_GATEWAY_PID"
STOP_GRACE_S = 15.0
POLL_S = 1.0  # where the kernel has no pidfd_open


def follow_gateway(stop: Callable[[], None] | None = None) -> threading.Thread | None:
    """Watch the gateway named in the environment from a daemon thread; `stop` (default:
    this process's SIGTERM, then SIGKILL) runs once it is gone. None: no gateway named."""
    value = os.environ.get(GATEWAY_PID_ENV)
    if not value:
        return None
    gateway = int(value)
    thread = threading.Thread(target=_stop_when_gone, args=(gateway, stop or stop_this_process),
                              name="weaver-gateway-watch", daemon=True)
    thread.start()
    return thread


def wait_for_exit(pid: int) -> None:
    """Return once process `pid` has ended (at once if it already has)."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):  # no pidfd here, or the process is already gone
        while is_process_alive(pid):
            time.sleep(POLL_S)
        return
    try:
        select.select([fd], [], [])  # a pidfd turns readable when its process exits
    finally:
        os.close(fd)


def stop_this_process() -> None:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(STOP_GRACE_S)
    os.kill(os.getpid(), signal.SIGKILL)  # still here: vLLM's shutdown hung


def _stop_when_gone(gateway: int, stop: Callable[[], None]) -> None:
    wait_for_exit(gateway)
    with contextlib.suppress(Exception):
        logger.error("the server that started this engine (pid %d: weaver serve or vllm "
                     "serve) is gone; stopping the engine", gateway)
    stop()
