"""CPU_ATTN with weaving: vLLM's CPU attention backend behind Weaver's mixins (backend.py).

The CPU platform always picks CPU_ATTN for a non-MLA model and ignores any other backend
choice (``vllm/platforms/cpu.py``), so the plugin registers this class *as* CPU_ATTN
(``register_backend``, docs/vllm-hooks.md). It keeps CPU_ATTN's name, validation and
metadata; it behaves exactly like it until a worker attaches weaving, a split plan or a
unified pool.
"""

from __future__ import annotations

from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
)

from weaver.vllm_ext.attention.backend import WovenAttentionImpl, WovenMetadataBuilder


class WeaverCPUAttentionImpl(WovenAttentionImpl, CPUAttentionBackendImpl):
    pass


class WeaverCPUMetadataBuilder(WovenMetadataBuilder, CPUAttentionMetadataBuilder):
    pass


class WeaverCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[WeaverCPUAttentionImpl]:
        return WeaverCPUAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[WeaverCPUMetadataBuilder]:
        return WeaverCPUMetadataBuilder
