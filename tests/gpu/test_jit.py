"""Cache keys, include expansion and the compile cache, with a recording fake compiler."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from weaver.offload.cuda import jit


class RecordingCompiler:
    name = "recording"

    def __init__(self, version: str = "v1") -> None:
        self._version = version
        self.calls: list[tuple[str, tuple[str, ...]]] = []

    def version(self) -> str:
        return self._version

    def compile(self, source: str, flags: Sequence[str], file_name: str) -> bytes:
        self.calls.append((source, tuple(flags)))
        return f"cubin:{len(self.calls)}:{source}".encode()


def test_cache_key_changes_with_each_input() -> None:
    base = jit.cache_key("src", ["-a", "-b"], "nvrtc 13.0")
    assert base == jit.cache_key("src", ["-a", "-b"], "nvrtc 13.0")
    assert len(base) == 64
    others = {
        jit.cache_key("src ", ["-a", "-b"], "nvrtc 13.0"),
        jit.cache_key("src", ["-a"], "nvrtc 13.0"),
        jit.cache_key("src", ["-b", "-a"], "nvrtc 13.0"),
        jit.cache_key("src", ["-a", "-b"], "nvrtc 13.1"),
        # moving characters between parts must not collide
        jit.cache_key("src-a", ["-b"], "nvrtc 13.0"),
    }
    assert base not in others and len(others) == 5


def test_expand_includes_inlines_each_header_once(tmp_path: Path) -> None:
    (tmp_path / "a.cuh").write_text('#pragma once\n#include "b.cuh"\nint a;\n')
    (tmp_path / "b.cuh").write_text("#pragma once\nint b;\n")
    (tmp_path / "k.cu").write_text('#include "a.cuh"\n#include "b.cuh"\nint k;\n')
    text = jit.expand_includes(tmp_path / "k.cu")
    assert text.count("int b;") == 1 and text.index("int b;") < text.index("int a;")
    assert "#include" not in text and "pragma once" not in text


def test_expand_includes_names_a_missing_header(tmp_path: Path) -> None:
    (tmp_path / "k.cu").write_text('#include "nope.cuh"\n')
    with pytest.raises(ValueError, match="nope.cuh"):
        jit.expand_includes(tmp_path / "k.cu")


def test_compile_file_caches_by_source_flags_and_version(tmp_path: Path) -> None:
    src, cache = tmp_path / "src", tmp_path / "cache"
    src.mkdir()
    (src / "k.cu").write_text("int k;\n")
    compiler = RecordingCompiler()
    first = jit.compile_file("k.cu", ["-x"], compiler, source_dir=src, cache_dir=cache)
    again = jit.compile_file("k.cu", ["-x"], compiler, source_dir=src, cache_dir=cache)
    assert not first.was_cached and again.was_cached and len(compiler.calls) == 1
    assert again.cubin_path == first.cubin_path and first.cubin_path.read_bytes().startswith(
        b"cubin:1"
    )
    jit.compile_file("k.cu", ["-y"], compiler, source_dir=src, cache_dir=cache)
    assert len(compiler.calls) == 2
    jit.compile_file("k.cu", ["-x"], RecordingCompiler("v2"), source_dir=src, cache_dir=cache)
    (src / "k.cu").write_text("int k2;\n")
    edited = jit.compile_file("k.cu", ["-x"], compiler, source_dir=src, cache_dir=cache)
    assert not edited.was_cached and len(compiler.calls) == 3
    assert not list(cache.glob("*.tmp")), "temporary files must be renamed into place"


def test_cache_dir_comes_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(jit.CACHE_DIR_ENV, str(tmp_path / "kc"))
    assert jit.kernel_cache_dir() == tmp_path / "kc"
    monkeypatch.delenv(jit.CACHE_DIR_ENV)
    assert jit.kernel_cache_dir() == Path.home() / ".cache" / "weaver" / "kernels"


def test_csrc_dir_finds_the_kernels_and_rejects_a_bad_override(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    assert (jit.csrc_dir() / "offload_cold.cu").is_file()
    monkeypatch.setenv(jit.CSRC_DIR_ENV, str(tmp_path / "missing"))
    with pytest.raises(ValueError, match=jit.CSRC_DIR_ENV):
        jit.csrc_dir()


def test_arch_flag_and_compiler_choice() -> None:
    assert jit.arch_flag(9, 0) == "--gpu-architecture=sm_90"
    with pytest.raises(ValueError, match="sm_70"):
        jit.arch_flag(6, 1)
    with pytest.raises(ValueError, match="'auto', 'nvrtc' or 'nvcc'"):
        jit.select_compiler("clang")


def test_jit_imports_without_cuda_libraries() -> None:
    import subprocess
    import sys

    code = (
        "import sys, weaver.offload.cuda.jit, weaver.offload.cuda.region_desc, "
        "weaver.offload.cuda.ipc, weaver.offload.cuda.transport; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('cupy', 'vllm', 'torch')]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
