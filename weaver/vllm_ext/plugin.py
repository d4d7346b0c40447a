"""vLLM general plugin (entry point ``vllm.general_plugins: weaver``).

vLLM calls ``register()`` once in each of its processes (front end, EngineCore, worker;
docs/vllm-hooks.md, "Plugin"), so it must be idempotent and cheap. It checks, loudly,
that the installed vLLM is the one Weaver pins and that every vLLM attribute Weaver
patches is still there (patches/registry.py: start-up fails with the list of what
moved). Then:
- on CPU it puts Weaver's attention backend in place of CPU_ATTN (the CPU platform ignores
  any other backend choice), on CUDA in place of FLASH_ATTN, TRITON_ATTN and FLASHINFER
  (whichever vLLM picks; attention/gpu_backends.py); each is vLLM's own until a worker
  attaches weaving, a split plan or a unified pool, so dedicated engines run unchanged;
- it registers Weaver's out-of-tree linear layers and logits processor
  (weaver/vllm_ext/layers.py), vLLM's own unless the engine has a split plan;
- it wraps the CPU model runner's KV-cache allocation (patches/kv_cache_allocation.py), a
  no-op unless the engine keeps its KV in a unified pool;
- it hooks vLLM's config building (patches/engine_config_hook.py) for weaving under plain
  `vllm serve` (weaver/vllm_ext/plugin_pairs.py), a no-op unless the engine has a `weaver`
  block with a role, and for what a plain `vllm serve` engine with a Weaver block leaves
  behind (weaver/vllm_ext/plain_serve.py); and EngineCore start
  (patches/engine_core_hook.py), where an engine of a weaving pair links itself
  (weaver/vllm_ext/pair_links.py, both launchers) and a colocated engine takes turns with
  its group (weaver/vllm_ext/mux_gate.py); each a no-op unless the block has its section.
  There, too, an engine stops once the server that started it is gone
  (weaver/vllm_ext/gateway_watch.py), and lists the shared memory it holds for that
  server to reclaim (weaver/vllm_ext/engine/leftovers.py).
"""

from __future__ import annotations

import logging
import os
from typing import Any

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
    _log_like_vllm()
    from vllm.platforms import current_platform

    from weaver.patches import engine_config_hook, engine_core_hook, kv_cache_allocation
    from weaver.vllm_ext import plugin_pairs
    from weaver.vllm_ext.additional_config import pool_section
    from weaver.vllm_ext.attention.pool import initialize_with_pool
    from weaver.vllm_ext.layers import register_split_layers

    register_split_layers()
    kv_cache_allocation.install(pool_section, initialize_with_pool)
    engine_config_hook.install(plugin_pairs.configure_engine_args, _complete_engine_config)
    engine_core_hook.install(_on_engine_core_ready)
    register_woven_backends(current_platform)


def _complete_engine_config(vllm_config: Any) -> None:
    from weaver.vllm_ext import plain_serve, plugin_pairs

    plain_serve.look_after_front_end(vllm_config)  # first: it names the server's pid
    plugin_pairs.complete_engine_config(vllm_config)


def _on_engine_core_ready(engine_core: Any) -> None:
    from weaver.vllm_ext import gateway_watch, mux_gate, pair_links, scheduler
    from weaver.vllm_ext.engine.leftovers import record_engine_shm

    gateway_watch.follow_gateway()  # an engine ends with the server that started it
    mux_gate.on_engine_core_ready(engine_core)
    pair_links.on_engine_core_ready(engine_core)
    scheduler.connect_pair_load(engine_core)
    record_engine_shm()  # last: its workers have joined their group, made their regions


def register_woven_backends(platform: Any) -> list[str]:
    """Put Weaver's wrapper in front of the platform's attention backends; returns the
    names of the backends it now stands for."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if platform.is_cpu():
        paths = {"CPU_ATTN": WEAVER_CPU_BACKEND}
    elif platform.is_cuda():
        from weaver.vllm_ext.attention.gpu_backends import WOVEN_BACKEND_PATHS

        paths = WOVEN_BACKEND_PATHS
    else:
        logger.warning("Weaver's attention wraps CPU and CUDA backends only; on %s, engines "
                       "run vLLM's own attention and cannot weave", type(platform).__name__)
        paths = {}
    for name, path in paths.items():
        register_backend(AttentionBackendEnum[name], path)
    return sorted(paths)


def _log_like_vllm() -> None:
    """Under plain `vllm serve` nothing configures Weaver's loggers: its INFO lines (a pair
    connected, a region made) would be dropped (the root logger has no handler, or one at
    ERROR that a library of vLLM's set). Then they go to vLLM's own handlers, looked up at
    each record (the front end loads plugins before vLLM configures its logging), at
    vLLM's level; under `weaver serve` (root at INFO or finer) its configuration stands."""
    weaver_logger, root = logging.getLogger("weaver"), logging.getLogger()
    if weaver_logger.handlers or (root.handlers and root.level <= logging.INFO):
        return
    weaver_logger.addHandler(_ToVllmHandlers())
    weaver_logger.setLevel(os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper())
    weaver_logger.propagate = False


class _ToVllmHandlers(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        for handler in logging.getLogger("vllm").handlers:
            if record.levelno >= handler.level:
                handler.handle(record)
