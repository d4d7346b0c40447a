"""vLLM general plugin (entry point `vllm.general_plugins: weaver`).

vLLM calls `register()` once in each of its processes (front end, EngineCore, worker;
vllm-notes §1), so it must be idempotent and cheap. It checks that the installed vLLM is
the one Weaver pins, loudly, because every hook Weaver adds leans on its internals.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

_state = {"registered": False}


def register() -> None:
    if _state["registered"]:
        return
    _state["registered"] = True
    from weaver.vllm_ext.version import check_vllm_version

    problem = check_vllm_version()
    if problem is not None:
        logger.error("%s", problem)
