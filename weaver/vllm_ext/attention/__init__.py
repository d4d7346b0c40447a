"""Weaver's attention in vLLM: the backend wrapper (backend.py; cpu.py and gpu_backends.py put
it in front of vLLM's CPU and GPU backends), vLLM's batch slicing for it (partition.py), the
CPU kernels at shapes no engine layer has (cpu_kernels.py: the cold side's executor, the
unified pool's head-wise attention in headwise.py) and the unified pool's worker side
(pool.py)."""
