"""Give a hot engine's scheduler a KV-cache manager that routes over two block pools.

vLLM's ``Scheduler.__init__`` builds one ``KVCacheManager``; a weaving hot engine admits
against its own blocks and the blocks a cold engine lends. Weaver's scheduler
(weaver/vllm_ext/scheduler.py) replaces ``scheduler.kv_cache_manager`` after vLLM's own
``__init__`` with a ``RoutingKVCacheManager`` (weaver/vllm_ext/routing_kv_cache_manager.py)
that owns the original (kept as
``_weaver_original_kv_cache_manager``) and a second manager over the remote ids.
"""

from __future__ import annotations

from typing import Any

from .registry import PatchTargetMissing


def install(scheduler: Any, routing: Any) -> None:
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    current = getattr(scheduler, "kv_cache_manager", None)
    if not isinstance(current, KVCacheManager):
        raise PatchTargetMissing(
            f"{type(scheduler).__name__}.kv_cache_manager is {type(current).__name__}, not "
            "vLLM's KVCacheManager: the scheduler changed (patches/routing_kv_cache_manager.py)")
    scheduler._weaver_original_kv_cache_manager = current
    scheduler.kv_cache_manager = routing
