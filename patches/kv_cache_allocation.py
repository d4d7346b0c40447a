"""Let a cold engine keep its KV cache in the unified pool instead of vLLM's buffer.

``CPUModelRunner.initialize_kv_cache_tensors`` is wrapped once per process (from the
plugin). For an engine without a pool the wrapper calls the original and nothing else.
For a pool engine it lets vLLM build its usual per-layer views over a buffer that is never
touched (the only ``torch.zeros`` of ``allocate_kv_cache`` is served by ``torch.empty`` for
that one call, so the buffer costs address space, not memory), then opens the pool. The
original method stays reachable as ``weaver_original`` on the wrapper.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .registry import PatchTargetMissing

# pool_of(vllm_config) -> the engine's pool section or None; initialize(runner, section,
# allocate) -> vLLM's kv caches, where allocate() runs vLLM's own initialisation.
PoolOf = Callable[[Any], Any]
InitializeWithPool = Callable[[Any, Any, Callable[[], Any]], Any]


def install(pool_of: PoolOf, initialize_with_pool: InitializeWithPool) -> None:
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    original = getattr(CPUModelRunner, "initialize_kv_cache_tensors", None)
    if original is None:
        raise PatchTargetMissing("CPUModelRunner.initialize_kv_cache_tensors is gone "
                                 "(patches/kv_cache_allocation.py)")
    if getattr(original, "weaver_original", None) is not None:
        return  # installed already (the plugin runs more than once per process)

    def initialize_kv_cache_tensors(self, kv_cache_config, kernel_block_sizes,
                                    kv_cache_allocation_context=None):
        args = (self, kv_cache_config, kernel_block_sizes, kv_cache_allocation_context)
        section = pool_of(self.vllm_config)
        if section is None:
            return original(*args)

        def allocate() -> Any:
            with kv_buffer_left_untouched():
                return original(*args)

        return initialize_with_pool(self, section, allocate)

    initialize_kv_cache_tensors.weaver_original = original
    CPUModelRunner.initialize_kv_cache_tensors = initialize_kv_cache_tensors


class _TorchZerosAsEmpty:
    """``torch`` for one call of vLLM's ``allocate_kv_cache``: its zero-filled buffer is
    allocated but never touched, so the OS backs none of it."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def zeros(*args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.empty(*args, **kwargs)


@contextlib.contextmanager
def kv_buffer_left_untouched() -> Iterator[None]:
    from vllm.v1.worker import utils as worker_utils

    real = worker_utils.torch
    worker_utils.torch = _TorchZerosAsEmpty()
    try:
        yield
    finally:
        worker_utils.torch = real
