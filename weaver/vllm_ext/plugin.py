"""vLLM general plugin (entry point ``vllm.general_plugins: weaver``).

vLLM calls ``register()`` once in each of its processes (front end, EngineCore, worker;
docs/vllm-hooks.md, "Plugin"), so it must be idempotent and cheap. It checks, loudly,
that the installed vLLM is the one Weaver pins and that every vLLM attribute Weaver
patches is still there (patches/registry.py: start-up fails with the list of what
moved). Then:
- on CPU it puts Weaver's attention backend in place of CPU_ATTN (the CPU platform ignores
  any other backend choice); it is vLLM's own until a worker attaches weaving, a split
  plan or a unified pool, so dedicated engines run unchanged;
- it registers Weaver's out-of-tree linear layers and logits processor
  (weaver/vllm_ext/layers.py), vLLM's own unless the engine has a split plan;
- it wraps the CPU model runner's KV-cache allocation (patches/kv_cache_allocation.py), a
  no-op unless the engine keeps its KV in a unified pool.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

WEAVER_CPU_BACKEND = "weaver.vllm_ext.attention.cpu.WeaverCPUAttentionBackend"

_state = {"registered": False}


def register() -> None:
    if _state["registered"]:
        return
    from weaver.patches.registry import check_targets
    from weaver.vllm_ext.version import check_vllm_version

    problem = check_vllm_version()
    if problem is not None:
        logger.error("%s", problem)
    check_targets()
    _state["registered"] = True
    from vllm.platforms import current_platform

    from weaver.patches import kv_cache_allocation
    from weaver.vllm_ext.additional_config import pool_section
    from weaver.vllm_ext.attention.pool import initialize_with_pool
    from weaver.vllm_ext.layers import register_split_layers

    register_split_layers()
    kv_cache_allocation.install(pool_section, initialize_with_pool)
    if current_platform.is_cpu():
        from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

        register_backend(AttentionBackendEnum.CPU_ATTN, WEAVER_CPU_BACKEND)
