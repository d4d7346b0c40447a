"""KV shapes of the models the kv tests use (from each model's config.json).

A plain module, imported by name: pytest puts tests/kv on sys.path (no __init__.py here)."""

from weaver.kv.pages import TenantShape

# HuggingFaceTB/SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64 (576 hidden / 9 heads).
SMOLLM2_135M = TenantShape(
    num_layers=30, num_kv_heads=3, head_size=64, block_size=32, dtype_bytes=2
)
# A small Llama as the other side of the SmolLM2 pair.
TINY_LLAMA = TenantShape(num_layers=2, num_kv_heads=2, head_size=32, block_size=32, dtype_bytes=2)
# meta-llama/Meta-Llama-3-8B (GQA) and Llama-2-7B (MHA), vLLM's GPU block size 16.
LLAMA3_8B = TenantShape(num_layers=32, num_kv_heads=8, head_size=128, block_size=16, dtype_bytes=2)
LLAMA2_7B = TenantShape(num_layers=32, num_kv_heads=32, head_size=128, block_size=16, dtype_bytes=2)
