"""Every csrc/*.cu compiles with nvcc, warning-free, for sm_90 and for nvcc's default target.

The kernels are compiled from the include-expanded source that NVRTC receives, so the
expansion is checked too. Skipped where nvcc is not on PATH.
"""

from __future__ import annotations

import shutil

import pytest

from weaver.offload.cuda import jit

CU_FILES = sorted(p.name for p in jit.csrc_dir().glob("*.cu"))
pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")


def test_there_are_kernel_files() -> None:
    assert {"offload_cold.cu", "offload_hot.cu", "paged_attention.cu"} <= set(CU_FILES)


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
