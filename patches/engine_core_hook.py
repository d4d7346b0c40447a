"""Let the plugin act once an EngineCore is up (weaving under plain `vllm serve`,
weaver/vllm_ext/plugin_pairs.py): its scheduler, executor and workers then exist.

``EngineCoreProc.run_busy_loop`` is wrapped once per process (from the plugin): the wrapper
calls ``ready(engine_core)`` once, then vLLM's original loop. Not ``EngineCore.__init__``:
vLLM loads the plugins inside that very call, too late for a wrapper of it to run. The
original stays reachable as ``weaver_original`` on the wrapper.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from .registry import PatchTargetMissing


def install(ready: Callable[[Any], None]) -> None:
    from vllm.v1.engine.core import EngineCoreProc

    original = EngineCoreProc.__dict__.get("run_busy_loop")
    if original is None:
        raise PatchTargetMissing("EngineCoreProc.run_busy_loop is gone: weaving under plain "
                                 "vllm serve cannot link its engines "
                                 "(patches/engine_core_hook.py)")
    if hasattr(original, "weaver_original"):
        return

    @functools.wraps(original)
    def run_busy_loop(self: Any) -> Any:
        ready(self)
        return original(self)

    run_busy_loop.weaver_original = original  # type: ignore[attr-defined]
    EngineCoreProc.run_busy_loop = run_busy_loop
