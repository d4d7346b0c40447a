"""Run-time compilation of csrc/*.cu, cached on disk (style.md "Kernels").

A kernel file is compiled once per (source, flags, compiler version): the key is the
sha256 of the source with its ``#include "..."`` files inlined, the flags and the
compiler's version string, so editing a header or upgrading the toolkit recompiles. The
cubin lands in ``$WEAVER_KERNEL_CACHE`` (default ``~/.cache/weaver/kernels``).

Compilers: NVRTC through ctypes (preferred: only the libnvrtc shared library is needed,
no toolkit and no GPU) or the ``nvcc`` binary (when no libnvrtc is found). Loading and
launching go through CuPy (``RawModule``); ``load_cubin`` is the only function that needs
a GPU. This module imports without CUDA, CuPy or torch. (torch's ``load_inline`` is not
used: it needs a host compiler and a C++ launcher per kernel, and NVRTC needs neither.)
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

logger = logging.getLogger(__name__)

CACHE_DIR_ENV = "WEAVER_KERNEL_CACHE"
CSRC_DIR_ENV = "WEAVER_CSRC_DIR"
NVRTC_LIB_ENV = "WEAVER_NVRTC_LIB"
DEFAULT_CACHE_DIR = Path("~/.cache/weaver/kernels")
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.MULTILINE)
_PRAGMA_ONCE = re.compile(r"^\s*#\s*pragma\s+once\s*$", re.MULTILINE)


def csrc_dir() -> Path:
    """Where the kernel sources live: $WEAVER_CSRC_DIR or the repository's csrc/."""
    configured = os.environ.get(CSRC_DIR_ENV)
    path = Path(configured) if configured else Path(__file__).resolve().parents[3] / "csrc"
    if not path.is_dir():
        raise ValueError(f"kernel source folder {path} not found; set ${CSRC_DIR_ENV}")
    return path


def kernel_cache_dir() -> Path:
    return Path(os.environ.get(CACHE_DIR_ENV) or DEFAULT_CACHE_DIR).expanduser()


def expand_includes(path: Path, _seen: set[Path] | None = None) -> str:
    """The file's text with every quoted include inlined once (``#pragma once`` honoured).

    NVRTC then needs no include path, and the cache key covers the headers too.
    """
    seen = set() if _seen is None else _seen
    path = path.resolve()
    if path in seen:
        return ""
    seen.add(path)
    text = _PRAGMA_ONCE.sub("", path.read_text())

    def inline(match: re.Match[str]) -> str:
        header = path.parent / match.group(1)
        if not header.is_file():
            raise ValueError(f"{path.name}: included file {match.group(1)!r} not found")
        return expand_includes(header, seen)

    return _INCLUDE.sub(inline, text)


def cache_key(source: str, flags: Sequence[str], compiler_version: str) -> str:
    """sha256 over source, flags and compiler version (NUL-separated, so no collisions
    from concatenation)."""
    digest = hashlib.sha256()
    for part in (source, "\0".join(flags), compiler_version):
        digest.update(part.encode())
        digest.update(b"\0\1\0")
    return digest.hexdigest()


def arch_flag(major: int, minor: int) -> str:
    if major < 7:
        raise ValueError(
            f"compute capability {major}.{minor} is too old: the offload kernels need sm_70+ "
            "(acquire/release PTX and __nanosleep)"
        )
    return f"--gpu-architecture=sm_{major}{minor}"


class Compiler(Protocol):
    name: str

    def version(self) -> str: ...

    def compile(self, source: str, flags: Sequence[str], file_name: str) -> bytes:
        """Return a cubin; raise RuntimeError with the compiler's log on failure."""
        ...


class NvccCompiler:
    """The nvcc binary (on PATH, or $CUDA_HOME/bin)."""

    name = "nvcc"

    def __init__(self, executable: str | None = None) -> None:
        found = executable or shutil.which("nvcc")
        if found is None and os.environ.get("CUDA_HOME"):
            candidate = Path(os.environ["CUDA_HOME"]) / "bin" / "nvcc"
            found = str(candidate) if candidate.is_file() else None
        if found is None:
            raise ValueError("nvcc not found: put it on PATH or set CUDA_HOME")
        self._executable = found
        self._version: str | None = None

    def version(self) -> str:
        if self._version is None:
            result = subprocess.run(
                [self._executable, "--version"], capture_output=True, text=True, check=True
            )
            self._version = "nvcc " + result.stdout.strip().splitlines()[-1]
        return self._version

    def compile(self, source: str, flags: Sequence[str], file_name: str) -> bytes:
        with tempfile.TemporaryDirectory(prefix="weaver-nvcc-") as tmp:
            src = Path(tmp) / file_name
            out = Path(tmp) / "out.cubin"
            src.write_text(source)
            cmd = [self._executable, "-cubin", *flags, "-o", str(out), str(src)]
            result = subprocess.run(cmd, capture_output=True, text=True)
            if result.returncode != 0:
                raise RuntimeError(f"nvcc failed on {file_name}:\n{result.stderr}")
            if result.stderr.strip():
                logger.warning("nvcc warnings for %s:\n%s", file_name, result.stderr)
            return out.read_bytes()


class NvrtcCompiler:
    """NVRTC through ctypes (libnvrtc from $WEAVER_NVRTC_LIB, the nvidia-cuda-nvrtc wheel,
    $CUDA_HOME or the system): no CuPy and no GPU needed to compile."""

    name = "nvrtc"

    def __init__(self, library_path: str | None = None) -> None:
        path = library_path or find_nvrtc()
        if path is None:
            raise ValueError(
                "libnvrtc not found: pip install nvidia-cuda-nvrtc (matching the driver's CUDA "
                f"major), or set ${NVRTC_LIB_ENV} to the library's path"
            )
        # libnvrtc dlopens its builtins library by soname at compile time; a wheel's lib
        # folder is not on the loader path, so load it first (dlopen then finds it loaded).
        for builtins in sorted(Path(path).parent.glob("libnvrtc-builtins.so.*")):
            if "alt" not in builtins.name:
                ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
        self._lib = ctypes.CDLL(path)
        self._lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        self.path = path

    def _check(self, status: int, what: str) -> None:
        if status != 0:
            message = self._lib.nvrtcGetErrorString(status).decode()
            raise RuntimeError(f"{what} failed: {message}")

    def version(self) -> str:
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._check(
            self._lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion"
        )
        return f"nvrtc {major.value}.{minor.value}"

    def compile(self, source: str, flags: Sequence[str], file_name: str) -> bytes:
        lib = self._lib
        program = ctypes.c_void_p()
        self._check(
            lib.nvrtcCreateProgram(
                ctypes.byref(program), source.encode(), file_name.encode(), 0, None, None
            ),
            "nvrtcCreateProgram",
        )
        try:
            options = (ctypes.c_char_p * len(flags))(*(f.encode() for f in flags))
            status = lib.nvrtcCompileProgram(program, len(flags), options)
            log = self._read(program, lib.nvrtcGetProgramLogSize, lib.nvrtcGetProgramLog)
            log_text = log.rstrip(b"\0").decode(errors="replace").strip()
            if status != 0:
                raise RuntimeError(f"NVRTC failed on {file_name}:\n{log_text}")
            if log_text:
                logger.warning("NVRTC log for %s:\n%s", file_name, log_text)
            return self._read(program, lib.nvrtcGetCUBINSize, lib.nvrtcGetCUBIN)
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(program))

    def _read(self, program: ctypes.c_void_p, size_fn: Any, read_fn: Any) -> bytes:
        size = ctypes.c_size_t()
        self._check(size_fn(program, ctypes.byref(size)), size_fn.__name__)
        buffer = ctypes.create_string_buffer(size.value)
        self._check(read_fn(program, buffer), read_fn.__name__)
        return buffer.raw


def find_nvrtc() -> str | None:
    """Path of libnvrtc, or None: $WEAVER_NVRTC_LIB, the nvidia-cuda-nvrtc wheel (CUDA 13
    then 12 layouts), $CUDA_HOME/lib64, then the dynamic loader's search path."""
    configured = os.environ.get(NVRTC_LIB_ENV)
    if configured:
        return configured
    candidates: list[Path] = []
    for entry in sys.path:
        for sub in ("nvidia/cu13/lib", "nvidia/cuda_nvrtc/lib"):
            candidates.extend(sorted((Path(entry) / sub).glob("libnvrtc.so.*")))
    for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if home:
            candidates.extend(sorted((Path(home) / "lib64").glob("libnvrtc.so*")))
    for candidate in candidates:
        if candidate.is_file() and "alt" not in candidate.name and "builtins" not in candidate.name:
            return str(candidate)
    return ctypes.util.find_library("nvrtc")


def select_compiler(preference: str = "auto") -> Compiler:
    """ "nvrtc", "nvcc" or "auto" (NVRTC when CuPy is importable, else nvcc)."""
    if preference not in ("auto", "nvrtc", "nvcc"):
        raise ValueError(f"compiler must be 'auto', 'nvrtc' or 'nvcc', got {preference!r}")
    if preference == "nvcc":
        return NvccCompiler()
    try:
        return NvrtcCompiler()
    except ValueError:
        if preference == "nvrtc":
            raise
        return NvccCompiler()


@dataclass(frozen=True)
class CompiledKernelFile:
    file_name: str
    key: str
    cubin_path: Path
    was_cached: bool


def compile_file(
    file_name: str,
    flags: Sequence[str],
    compiler: Compiler,
    *,
    source_dir: Path | None = None,
    cache_dir: Path | None = None,
) -> CompiledKernelFile:
    """Compile csrc/<file_name> (or reuse the cached cubin) and return where it is."""
    source = expand_includes((source_dir or csrc_dir()) / file_name)
    key = cache_key(source, flags, compiler.version())
    directory = cache_dir or kernel_cache_dir()
    cubin_path = directory / f"{Path(file_name).stem}-{key[:32]}.cubin"
    if cubin_path.is_file():
        return CompiledKernelFile(file_name, key, cubin_path, was_cached=True)
    logger.info("compiling %s with %s %s", file_name, compiler.version(), " ".join(flags))
    cubin = compiler.compile(source, flags, file_name)
    directory.mkdir(parents=True, exist_ok=True)
    # Write then rename: two processes compiling at once never see a half-written file.
    fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        f.write(cubin)
    os.replace(tmp, cubin_path)
    return CompiledKernelFile(file_name, key, cubin_path, was_cached=False)


def unavailable_reason() -> str | None:
    """Why Weaver's kernels cannot be launched here (no torch CUDA device, no CuPy), or
    None when they can."""
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


class KernelLibrary:
    """Compiled kernels for one device, loaded on first use and kept by this object.

    Owned by whoever launches (a sender, a receiver, a benchmark), not a module global.
    """

    def __init__(
        self,
        device_index: int | None = None,
        *,
        compiler: str = "auto",
        extra_flags: Sequence[str] = (),
        cache_dir: Path | None = None,
    ) -> None:
        import torch

        if not torch.cuda.is_available():
            raise ValueError(
                "KernelLibrary needs a CUDA device (torch.cuda.is_available() is False)"
            )
        self.device_index = torch.cuda.current_device() if device_index is None else device_index
        major, minor = torch.cuda.get_device_capability(self.device_index)
        self._compiler = select_compiler(compiler)
        self._flags = ("-std=c++17", arch_flag(major, minor), "-lineinfo", *extra_flags)
        self._cache_dir = cache_dir
        self._modules: dict[str, Any] = {}
        self._functions: dict[tuple[str, str], Any] = {}

    def function(self, file_name: str, kernel_name: str) -> Any:
        """The cupy.RawKernel `kernel_name` (an extern "C" name) from csrc/<file_name>."""
        cached = self._functions.get((file_name, kernel_name))
        if cached is not None:
            return cached
        module = self._modules.get(file_name)
        if module is None:
            compiled = compile_file(
                file_name, self._flags, self._compiler, cache_dir=self._cache_dir
            )
            module = load_cubin(compiled.cubin_path, self.device_index)
            self._modules[file_name] = module
        function = module.get_function(kernel_name)
        self._functions[(file_name, kernel_name)] = function
        return function


def load_cubin(path: Path, device_index: int) -> Any:
    try:
        import cupy
    except ImportError as exc:
        raise ValueError(
            "launching Weaver's CUDA kernels needs CuPy (pip install cupy-cuda13x)"
        ) from exc
    with cupy.cuda.Device(device_index):
        return cupy.RawModule(path=str(path))
