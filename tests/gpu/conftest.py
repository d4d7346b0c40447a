"""GPU tests skip with a reason when CUDA is absent; the rest of this folder runs on CPU."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def library(tmp_path_factory: pytest.TempPathFactory):
    """One KernelLibrary for the GPU tests, with its own cache folder."""
    from weaver.offload.cuda.jit import unavailable_reason

    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    from weaver.offload.cuda.jit import KernelLibrary

    return KernelLibrary(cache_dir=tmp_path_factory.mktemp("kernel-cache"))
