"""Weaver: multi-LLM serving on vLLM 0.32.0.

`from weaver import LLM, SamplingParams` is a drop-in for the same vLLM import. The vLLM
names are resolved lazily so that the pure-Python parts of Weaver (deployment files,
allocators, workloads, the simulator) import without loading vLLM.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# Names re-exported from vLLM, so existing scripts change one import line only.
_VLLM_REEXPORTS = ("LLM", "SamplingParams", "EngineArgs", "AsyncEngineArgs", "AsyncLLMEngine")


def __getattr__(name: str) -> Any:
    if name in _VLLM_REEXPORTS:
        return getattr(importlib.import_module("vllm"), name)
    raise AttributeError(f"module 'weaver' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_VLLM_REEXPORTS])
