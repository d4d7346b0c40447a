"""What `weaver serve` does for each engine it starts (weaver/vllm_ext/engine/app.py), done
by a plain `vllm serve` front end whose engine has a Weaver block (a weaving role or a
mux group), so that nothing is left behind under either launcher:

- the front end names itself in its engine's environment (GATEWAY_PID_ENV): an EngineCore
  whose front end was SIGKILLed stops itself (weaver/vllm_ext/gateway_watch.py);
- the engine's processes get a socket directory of their own (VLLM_RPC_BASE_PATH), where
  libzmq's socket files go and where the EngineCore, once up, lists the /dev/shm files it
  and its workers hold (weaver/vllm_ext/engine/leftovers.py `record_engine_shm`);
- at exit (a SIGTERM included: vLLM's server then returns from its loop), the front end
  unlinks what that list names and no living process holds: vLLM's default
  `--shutdown-timeout 0` kills the worker on SIGTERM before it unlinks its message
  queues, and a mux group's turn table goes with the group's last member. So do Weaver's
  files named after a dead owner (a cold worker's regions, made after the list was
  written) and the pairs' files whose writer is gone. Then the socket directory goes,
  and the shared runtime directories once empty (weaver/runtime_dirs.py);
- at start, what a SIGKILLed predecessor of either launcher left is reclaimed: Weaver's
  files named after a dead owner, and the socket directories (with what their lists name)
  of dead servers.
"""

from __future__ import annotations

import atexit
import logging
import os
from pathlib import Path
from typing import Any

from weaver.runtime_dirs import remove_default_if_empty
from weaver.vllm_ext.additional_config import KEY
from weaver.vllm_ext.engine.leftovers import (
    RPC_BASE_PATH_ENV,
    make_rpc_dir,
    reclaim_dead_owners_rpc_dirs,
    reclaim_dead_owners_shm,
    remove_left_over_shm,
    remove_rpc_dir,
)
from weaver.vllm_ext.gateway_watch import GATEWAY_PID_ENV
from weaver.weaving import rendezvous
from weaver.weaving.rendezvous import PairFiles

logger = logging.getLogger(__name__)

# Blocks that make an engine Weaver's to look after under plain `vllm serve`: a weaving
# role (weaver/vllm_ext/plugin_pairs.py) or a mux group (weaver/vllm_ext/mux_gate.py).
_PLAIN_BLOCKS = ("role", "mux")
_state: dict[str, Path | None] = {"rpc_dir": None}


def is_plain_weaver_engine(additional_config: Any) -> bool:
    """An engine a plain `vllm serve` starts with a Weaver block. False for one `weaver
    serve` builds: its gateway names itself in the environment while it builds the
    engine's config and spawns it (weaver/vllm_ext/engine/app.py)."""
    section = additional_config.get(KEY) if isinstance(additional_config, dict) else None
    if not isinstance(section, dict) or not any(key in section for key in _PLAIN_BLOCKS):
        return False
    return os.environ.get(GATEWAY_PID_ENV) != str(os.getpid())


def look_after_front_end(vllm_config: Any) -> Path | None:
    """Run in the front end once vLLM's config exists, before the EngineCore is spawned.
    Returns the engine's socket directory; None for an engine that is not Weaver's to look
    after here. Once per process: a front end starts one engine."""
    if _state["rpc_dir"] is not None:
        return _state["rpc_dir"]
    if not is_plain_weaver_engine(vllm_config.additional_config):
        return None
    reclaim_dead_owners_shm()
    reclaim_dead_owners_rpc_dirs()
    rpc_dir = make_rpc_dir()
    # The EngineCore is spawned after this and copies the environment; nothing of this
    # front end has named a socket yet (vLLM reads the variable when it names one).
    os.environ[RPC_BASE_PATH_ENV] = str(rpc_dir)
    os.environ[GATEWAY_PID_ENV] = str(os.getpid())
    _state["rpc_dir"] = rpc_dir
    atexit.register(clean_up_after_engine, rpc_dir)
    logger.info("Weaver looks after this server's engine: its socket files and the list "
                "of its shared memory in %s, reclaimed when the server exits", rpc_dir)
    return rpc_dir


def clean_up_after_engine(rpc_dir: Path) -> list[str]:
    """At the front end's exit, once its engine stopped: what the engine left, its socket
    directory, and the shared runtime directories once empty. Returns what was unlinked."""
    removed = remove_left_over_shm("of this server", rpc_dir) + reclaim_dead_owners_shm()
    removed += map(str, PairFiles(rendezvous.runtime_dir()).remove_dead_writers_files())
    remove_rpc_dir(rpc_dir)
    for kind in ("pairs", "mux"):  # weaver/weaving/rendezvous.py, weaver/mux/table.py
        remove_default_if_empty(kind)
    return removed
