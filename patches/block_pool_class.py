"""Make one of vLLM's ``BlockPool`` instances allocate through the unified KV pool.

The scheduler's block pool is built deep inside ``KVCacheManager``; Weaver swaps that
instance's class to a subclass (weaver/vllm_ext/block_pool.py ``AllocatorBlockPool``)
whose methods take and return pool pages around vLLM's own. The original class is kept
as ``_weaver_original_class``.
"""

from __future__ import annotations

from typing import Any

from .registry import PatchTargetMissing


def adopt(pool: Any, cls: type) -> Any:
    from vllm.v1.core.block_pool import BlockPool

    if not isinstance(pool, BlockPool) or not issubclass(cls, type(pool)):
        raise PatchTargetMissing(
            f"cannot make a {type(pool).__name__} a {cls.__name__}: it is not the vLLM "
            "BlockPool the subclass extends (patches/block_pool_class.py)")
    pool._weaver_original_class = type(pool)
    pool.__class__ = cls
    return pool
