"""Every csrc/*.cu compiles warning-free: with nvcc for sm_90 and for nvcc's default target,
and with NVRTC (the run-time path) for sm_90.

The kernels are compiled from the include-expanded source that NVRTC receives, so the
expansion is checked too. Each compiler's tests skip where it is not found.
"""

from __future__ import annotations

import shutil

import pytest

from weaver.offload.cuda import jit

CU_FILES = sorted(p.name for p in jit.csrc_dir().glob("*.cu"))
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")


def test_there_are_kernel_files() -> None:
    assert {"offload_cold.cu", "offload_hot.cu", "paged_attention.cu"} <= set(CU_FILES)


@needs_nvcc
@pytest.mark.parametrize("file_name", CU_FILES)
@pytest.mark.parametrize("arch", [("--gpu-architecture=sm_90",), ()], ids=["sm_90", "default"])
def test_kernel_file_compiles_without_warnings(
    file_name: str, arch: tuple[str, ...], tmp_path, caplog
) -> None:
    compiler = jit.NvccCompiler()
    flags = ("-std=c++17", *arch)
    with caplog.at_level("WARNING", logger=jit.__name__):
        compiled = jit.compile_file(file_name, flags, compiler, cache_dir=tmp_path)
    assert compiled.cubin_path.read_bytes()[:4] == b"\x7fELF"
    assert not caplog.records, f"nvcc warned: {caplog.text}"


@pytest.mark.parametrize("file_name", CU_FILES)
def test_kernel_file_compiles_with_nvrtc_without_warnings(file_name: str, tmp_path, caplog) -> None:
    """What KernelLibrary does at run time; skipped where no libnvrtc is found (set
    $WEAVER_NVRTC_LIB or pip install nvidia-cuda-nvrtc)."""
    if jit.find_nvrtc() is None:
        pytest.skip("libnvrtc not found (set WEAVER_NVRTC_LIB or install nvidia-cuda-nvrtc)")
    compiler = jit.NvrtcCompiler()
    with caplog.at_level("WARNING", logger=jit.__name__):
        compiled = jit.compile_file(
            file_name, ("-std=c++17", jit.arch_flag(9, 0)), compiler, cache_dir=tmp_path
        )
    assert compiled.cubin_path.read_bytes()[:4] == b"\x7fELF"
    assert not caplog.records, f"NVRTC warned: {caplog.text}"
