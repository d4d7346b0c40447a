"""CUDA transport of the offload channel (docs/architecture.md, part 4).

Same region layout and protocol as the CPU transport (weaver/offload/layout.py,
protocol.py); the counters are moved by device kernels instead of the host:

- ``jit``: compiles ``csrc/*.cu`` at run time (NVRTC through ctypes, or nvcc), cached on
  disk by sha256(source with headers inlined + flags + compiler version); ``KernelLibrary``
  loads the cubins through CuPy.
- ``kernels``: one validating wrapper per kernel (``paged_decode_attention``, ``publish``,
  ``wait_done``, ``poll_and_attend``), launched on ``torch.cuda.current_stream()``.
- ``transport``: ``CudaRegion``, the region in cold-device memory (exported once through
  CUDA IPC) implementing ``protocol.Transport`` with those kernels, so the one
  ``OffloadSender`` and ``OffloadReceiver`` run over it; ``CudaPollingExecutor`` is the
  cold side's executor (the polling kernel serves tasks on the device).
- ``region_desc``: the int64 descriptor of a RegionLayout that device code reads.
- ``pool``: writes K/V into the remote pool (layer view [num_blocks, num_kv_heads,
  block_size, 2*head_size] in the region's KV format: "pages" or the GPU backends'
  "token", weaver/offload/layout.py KV_FORMATS) where no backend kernel writes them.
- ``ipc``: CUDA IPC handles as plain bytes (JSON, never pickle).

Importable without CUDA, CuPy or vLLM: everything that touches a device imports it
inside the function that needs it.
"""
