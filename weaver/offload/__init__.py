"""Offload channel between a hot engine and a cold engine (architecture.md part 4).

Modules: layout (region byte layout, pure Python), naming (region names from config),
transport (the interface), shm_transport (CPU: POSIX shm + FIFO doorbells), channel
(the protocol: OffloadSender / OffloadReceiver), reference_attention (torch oracle),
probe / probe_config / cli (`weaver offload-probe`). The vLLM-backed executor lives in
weaver/vllm_ext/cpu_paged_attention.py. Nothing is re-exported here so that importing
the package stays free of torch.
"""
