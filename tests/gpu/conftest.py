"""GPU tests skip with a reason when CUDA is absent; the rest of this folder runs on CPU."""

from __future__ import annotations

import pytest


def cuda_skip_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "needs a CUDA device (torch.cuda.is_available() is False)"
    try:
        import cupy  # noqa: F401
    except ImportError:
        return "needs CuPy to load the kernels (pip install cupy-cuda13x)"
    return None


@pytest.fixture(scope="session")
def library(tmp_path_factory: pytest.TempPathFactory):
    """One KernelLibrary for the GPU tests, with its own cache folder."""
    reason = cuda_skip_reason()
    if reason:
        pytest.skip(reason)
    from weaver.offload.cuda.jit import KernelLibrary

    return KernelLibrary(cache_dir=tmp_path_factory.mktemp("kernel-cache"))
