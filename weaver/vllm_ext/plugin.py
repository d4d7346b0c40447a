"""vLLM general plugin (entry point `vllm.general_plugins: weaver`).

vLLM calls `register()` once in each of its processes (front end, EngineCore, worker;
vllm-notes §1), so it must be idempotent and cheap. It checks, loudly, that the installed
vLLM is the one Weaver pins, and on CPU it puts Weaver's attention backend in place of
CPU_ATTN (the CPU platform ignores any other backend choice, vllm-notes §1). That backend
is vLLM's own until a hot worker attaches a weaving region, so dedicated and cold
engines run unchanged. It also registers Weaver's out-of-tree linear layers and logits
processor (weaver/vllm_ext/split_layers.py), which are vLLM's own unless the engine's
additional_config carries a split plan (cold engines only), and wraps the CPU model
runner's KV-cache allocation, which is vLLM's own unless the engine keeps its KV in a
unified pool (weaver/vllm_ext/pool_worker.py).
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

WEAVER_CPU_BACKEND = "weaver.vllm_ext.hot_attention.WeaverCPUAttentionBackend"

_state = {"registered": False}


def register() -> None:
    if _state["registered"]:
        return
    _state["registered"] = True
    from weaver.vllm_ext.version import check_vllm_version

    problem = check_vllm_version()
    if problem is not None:
        logger.error("%s", problem)
    from vllm.platforms import current_platform

    from weaver.vllm_ext.split_layers import register_split_layers

    register_split_layers()

    from weaver.vllm_ext.pool_worker import install_pool_kv_allocation

    install_pool_kv_allocation()

    if current_platform.is_cpu():
        from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

        register_backend(AttentionBackendEnum.CPU_ATTN, WEAVER_CPU_BACKEND)
