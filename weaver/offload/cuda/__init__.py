"""CUDA transport of the offload channel (architecture.md part 4).

Importable without CUDA, CuPy or vLLM: everything that touches a device imports it
inside the function that needs it. Kernels live in ``csrc/*.cu`` and are compiled at run
time by ``jit.py``.
"""
