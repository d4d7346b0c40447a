"""Offload channel between a hot engine and a cold engine (docs/architecture.md, part 4).

Modules: layout (region byte layout, pure Python), naming (region names from config),
protocol (records, errors and the Transport interface), sender / receiver (the two sides,
written once over any transport), shm (the CPU transport: POSIX shm + FIFO doorbells),
cuda/ (the CUDA transport: device counters and kernels), reference_attention (torch
oracle). The vLLM-backed CPU executor lives in weaver/vllm_ext/attention/cpu_kernels.py.
Nothing is re-exported here so that importing the package stays free of torch.
"""
