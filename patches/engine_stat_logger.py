"""Add a per-engine recorder to an engine client's stat loggers.

vLLM calls each of ``AsyncLLM.logger_manager.stat_loggers`` after every engine step with
that engine's scheduler stats. The gateway appends its own recorder there
(weaver/vllm_ext/engine/stats.py), because ``build_async_engine_client`` takes no
``stat_loggers`` argument.
"""

from __future__ import annotations

from typing import Any

from .registry import PatchTargetMissing


def attach(client: Any, recorder: Any) -> bool:
    """True once recording; False when the engine runs with stats disabled (no manager)."""
    manager = getattr(client, "logger_manager", None)
    if manager is None:
        return False
    loggers = getattr(manager, "stat_loggers", None)
    if not isinstance(loggers, list):
        raise PatchTargetMissing("the engine's logger_manager has no stat_loggers list "
                                 "(patches/engine_stat_logger.py)")
    loggers.append(recorder)
    return True
