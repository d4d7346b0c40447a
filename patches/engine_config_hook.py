"""Let the plugin adjust an engine's arguments before vLLM builds its config, and complete
the config once it exists (weaving under plain `vllm serve`, weaver/vllm_ext/plugin_pairs.py).

``EngineArgs.create_engine_config`` is wrapped once per process (from the plugin): the
wrapper calls ``before(engine_args)``, then vLLM's original, then ``after(vllm_config)``.
It runs in the front end, where `vllm serve` builds the config that its EngineCore and
workers then receive. The original stays reachable as ``weaver_original`` on the wrapper.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from .registry import PatchTargetMissing


def install(before: Callable[[Any], None], after: Callable[[Any], None]) -> None:
    from vllm.engine.arg_utils import EngineArgs

    original = getattr(EngineArgs, "create_engine_config", None)
    if original is None:
        raise PatchTargetMissing("EngineArgs.create_engine_config is gone: weaving under "
                                 "plain vllm serve cannot configure its engines "
                                 "(patches/engine_config_hook.py)")
    if hasattr(original, "weaver_original"):
        return

    @functools.wraps(original)
    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        before(self)
        config = original(self, *args, **kwargs)
        after(config)
        return config

    create_engine_config.weaver_original = original  # type: ignore[attr-defined]
    EngineArgs.create_engine_config = create_engine_config
