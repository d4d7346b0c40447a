"""Every csrc/*.cu compiles warning-free: with nvcc for sm_90 and for nvcc's default target,
and with NVRTC (the run-time path) for sm_90.

The kernels are compiled from the include-expanded source that NVRTC receives, so the
expansion is checked too. nvcc's tests skip where it is not on PATH; NVRTC's never skip
(the test extras install it).
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
    """What KernelLibrary does at run time. The test extras carry libnvrtc (the
    nvidia-cuda-nvrtc wheel), so this runs in CI on a machine with no CUDA at all; a
    missing library fails rather than skips, or a kernel that stopped compiling would
    pass CI unseen."""
    if jit.find_nvrtc() is None:
        pytest.fail("libnvrtc not found: pip install -e '.[test]' (the nvidia-cuda-nvrtc "
                    "wheel) or set WEAVER_NVRTC_LIB")
    compiler = jit.NvrtcCompiler()
    with caplog.at_level("WARNING", logger=jit.__name__):
        compiled = jit.compile_file(
            file_name, ("-std=c++17", jit.arch_flag(9, 0)), compiler, cache_dir=tmp_path
        )
    assert compiled.cubin_path.read_bytes()[:4] == b"\x7fELF"
    assert not caplog.records, f"NVRTC warned: {caplog.text}"
