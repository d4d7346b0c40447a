"""Both sides of a weaving pair whose hot engine attends with vLLM's TRITON_ATTN, kernels run
by Triton's interpreter on CPU tensors, for test_triton_woven.py (not a test).

Usage: python triton_woven_run.py cold|hot PLAN_JSON   (TRITON_INTERPRET=1 in the env)
- cold: creates the plan's region and serves its tasks from an idle poller with vLLM's
  Triton kernel over the region's KV ("token" format); prints READY, then on "close" (or
  EOF) on stdin prints "CLOSED served=N failed=M" and exits.
- hot: resolves TRITON_ATTN through Weaver's class path (gpu_backends.py), attaches the
  region and runs one woven step: earlier K/V and the step's new K/V written through
  Weaver's impl (remote slots into the region), attention through Weaver's builder and impl
  (remote decode rows offloaded to the cold process). Then the same batch unsplit, through
  vLLM's own TRITON_ATTN classes over one cache holding every block. Prints one JSON line.

Protocol lines and the JSON go to the real stdout; everything else (vLLM logs to stdout)
goes to stderr. vLLM and Weaver's vLLM modules are imported inside the functions: main()
must enable the interpreter before any of them is imported.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

from triton_interpreter import enable_triton_interpreter

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 4, 2, 32, 16
NUM_LOCAL_BLOCKS = 16
# Keys a query sees (the GPU backends keep it as (SLIDING_WINDOW - 1, 0)); shorter than the
# longest sequences, so the cold side's task must carry it right.
SLIDING_WINDOW = 40
# One step, local and remote requests interleaved: (query tokens, tokens so far, is remote).
STEP = (
    (1, 37, False),  # local decode
    (1, 50, True),  # remote decode over 4 blocks
    (20, 20, False),  # local prefill, first chunk
    (12, 45, True),  # remote prefill, a chunk after 33 tokens of earlier chunks
    (1, 33, True),  # remote decode whose new token opens a block
    (18, 18, True),  # remote prefill, first chunk: a sequence placed remotely this step
    (1, 16, False),  # local decode that fills its last block
)
LAYER_NAME = "model.layers.0.self_attn.attn"
OTHER_GPU_BACKEND_MODULES = ("vllm.v1.attention.backends.flash_attn",
                             "vllm.v1.attention.backends.flashinfer")


def tiny_vllm_config(model_dir: Path):
    """A VllmConfig of a one-layer Llama at the step's attention shape (config.json only:
    no weights, no tokenizer)."""
    from vllm.config import CacheConfig, ModelConfig, VllmConfig

    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "hidden_size": NUM_HEADS * HEAD_SIZE, "num_attention_heads": NUM_HEADS,
              "num_key_value_heads": NUM_KV_HEADS, "head_dim": HEAD_SIZE,
              "num_hidden_layers": 1, "intermediate_size": 256, "vocab_size": 256,
              "max_position_embeddings": 512, "torch_dtype": "float32"}
    (model_dir / "config.json").write_text(json.dumps(config))
    model = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="float32",
                        max_model_len=512)
    return VllmConfig(model_config=model, cache_config=CacheConfig(block_size=BLOCK_SIZE))


class TritonDecodeExecutor:
    """An offloaded decode task (one query token per sequence) with vLLM's TRITON_ATTN
    kernel, over the region's KV in the "token" format, as TritonAttentionImpl.forward
    reads its cache."""

    def __init__(self, shape) -> None:
        if shape.kv_format != "token":
            raise ValueError(f"TRITON_ATTN reads K|V token rows; the region is {shape.kv_format!r}")
        self.head_size = shape.head_size

    def __call__(self, task) -> None:
        import torch
        from vllm.v1.attention.ops.triton_unified_attention import unified_attention

        key_cache, value_cache = task.kv_layer.transpose(1, 2).split(self.head_size, dim=-1)
        window = task.sliding_window
        unified_attention(
            q=task.q, k=key_cache, v=value_cache, out=task.out,
            cu_seqlens_q=torch.arange(task.num_seqs + 1, dtype=torch.int32), max_seqlen_q=1,
            seqused_k=task.seq_lens, max_seqlen_k=int(task.seq_lens.max()),
            softmax_scale=task.scale, causal=True,
            window_size=(window - 1, 0) if window > 0 else (-1, -1),
            block_table=task.block_table, softcap=task.softcap,
            q_descale=None, k_descale=None, v_descale=None)


def run_cold(plan, protocol) -> None:
    from weaver.offload.receiver import OffloadReceiver
    from weaver.offload.shm import ShmRegion
    from weaver.weaving.cold import ColdWeaving

    region = ShmRegion.create(plan.layout(), plan.region_name)
    receiver = OffloadReceiver(region, TritonDecodeExecutor(plan.shape))
    cold = ColdWeaving({plan.region_name: receiver})  # the cold engine's idle poller
    cold.start_idle_poller()
    print("READY", file=protocol)
    for line in sys.stdin:
        if line.strip() == "close":
            break
    stats = receiver.stats
    served, failed = stats.num_served, stats.num_failed
    cold.close()
    print(f"CLOSED served={served} failed={failed}", file=protocol)


class Layer:
    """What TRITON_ATTN reads of its attention layer (vLLM's Attention keeps these)."""

    def __init__(self) -> None:
        import torch

        self._q_scale = torch.tensor(1.0)
        self._k_scale = torch.tensor(1.0)
        self._v_scale = torch.tensor(1.0)


class StepData:
    """The step's requests: block tables (remote ids past the local ones), every token's
    K/V and slot, the new tokens' queries."""

    def __init__(self, num_remote_blocks: int, seed: int = 0) -> None:
        import torch

        gen = torch.Generator().manual_seed(seed)
        local_ids = torch.randperm(NUM_LOCAL_BLOCKS, generator=gen).tolist()
        remote_ids = (torch.randperm(num_remote_blocks, generator=gen) + NUM_LOCAL_BLOCKS).tolist()
        width = max(-(-seq_len // BLOCK_SIZE) for _, seq_len, _ in STEP)
        self.block_table = torch.zeros(len(STEP), width, dtype=torch.int32)
        self.keys, self.values, self.slots = [], [], []
        for r, (_, seq_len, is_remote) in enumerate(STEP):
            ids = remote_ids if is_remote else local_ids
            num_blocks = -(-seq_len // BLOCK_SIZE)
            self.block_table[r, :num_blocks] = torch.tensor([ids.pop() for _ in range(num_blocks)])
            positions = torch.arange(seq_len)
            self.slots.append(self.block_table[r, positions // BLOCK_SIZE].to(torch.int64)
                              * BLOCK_SIZE + positions % BLOCK_SIZE)
            self.keys.append(torch.randn(seq_len, NUM_KV_HEADS, HEAD_SIZE, generator=gen))
            self.values.append(torch.randn(seq_len, NUM_KV_HEADS, HEAD_SIZE, generator=gen))
        num_tokens = sum(query_len for query_len, _, _ in STEP)
        self.query = torch.randn(num_tokens, NUM_HEADS, HEAD_SIZE, generator=gen)

    def tokens(self, *, new: bool):
        """K, V and slots of the step's new tokens (new) or of the earlier ones."""
        import torch

        parts = []
        for r, (query_len, seq_len, _) in enumerate(STEP):
            rows = slice(seq_len - query_len, seq_len) if new else slice(0, seq_len - query_len)
            parts.append((self.keys[r][rows], self.values[r][rows], self.slots[r][rows]))
        return tuple(torch.cat(column) for column in zip(*parts, strict=True))

    def common_metadata(self):
        import dataclasses

        from attention_batches import common_metadata

        cm = common_metadata([q for q, _, _ in STEP], [s for _, s, _ in STEP], self.block_table)
        return dataclasses.replace(cm, slot_mapping=self.tokens(new=True)[2])

    def dense_attention(self):
        """The oracle: each new token over its sequence's last SLIDING_WINDOW keys up to
        itself, in torch."""
        import torch

        rows = []
        group = NUM_HEADS // NUM_KV_HEADS
        for r, (query_len, seq_len, _) in enumerate(STEP):
            start = sum(q for q, _, _ in STEP[:r])
            for j in range(query_len):
                end = seq_len - query_len + j + 1
                keys = slice(max(0, end - SLIDING_WINDOW), end)
                k = self.keys[r][keys].repeat_interleave(group, dim=1)  # [L, H, D]
                v = self.values[r][keys].repeat_interleave(group, dim=1)
                scores = torch.einsum("hd,lhd->hl", self.query[start + j], k) * HEAD_SIZE ** -0.5
                rows.append(torch.einsum("hl,lhd->hd", torch.softmax(scores, dim=-1), v))
        return torch.stack(rows)


def attention_args(vllm_config):
    """What vLLM hands a TRITON_ATTN builder and impl for the step's one layer."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS,
                             head_size=HEAD_SIZE, dtype=torch.float32)
    builder_args = (spec, [LAYER_NAME], vllm_config, torch.device("cpu"))
    impl_args = (NUM_HEADS, HEAD_SIZE, HEAD_SIZE ** -0.5, NUM_KV_HEADS, None, SLIDING_WINDOW,
                 "auto")
    return builder_args, impl_args


def woven_triton_backend():
    """TRITON_ATTN as the plugin would register it: Weaver's class path, resolved by vLLM's
    own enum; and which other GPU backends' vLLM modules gpu_backends.py had imported."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from weaver.vllm_ext.attention import gpu_backends

    preloaded = [name for name in OTHER_GPU_BACKEND_MODULES if name in sys.modules]
    register_backend(AttentionBackendEnum.TRITON_ATTN,
                     gpu_backends.WOVEN_BACKEND_PATHS["TRITON_ATTN"])
    return AttentionBackendEnum.TRITON_ATTN.get_class(), preloaded


def run_woven(backend, hot, vllm_config, data: StepData):
    """The step through Weaver's classes, attached as the hot worker attaches them: the
    engine's own cache holds the local blocks, the region the remote ones."""
    import torch

    builder_args, impl_args = attention_args(vllm_config)
    builder = backend.get_builder_cls()(*builder_args)
    impl = backend.get_impl_cls()(*impl_args)
    builder.weaver_hot, builder.weaver_num_local_blocks = hot, NUM_LOCAL_BLOCKS
    impl.weaver_hot, impl.weaver_layer_index = hot, 0
    impl.weaver_num_local_slots = NUM_LOCAL_BLOCKS * BLOCK_SIZE
    local_kv = torch.zeros(NUM_LOCAL_BLOCKS, NUM_KV_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE)
    old_k, old_v, old_slots = data.tokens(new=False)
    impl.do_kv_cache_update(Layer(), old_k, old_v, local_kv, old_slots)  # earlier steps
    md = builder.build(0, data.common_metadata())
    new_k, new_v, new_slots = data.tokens(new=True)
    impl.do_kv_cache_update(Layer(), new_k, new_v, local_kv, new_slots)
    out = torch.full_like(data.query, float("nan"))
    impl.forward(Layer(), data.query, new_k, new_v, local_kv, md, out)
    return out, md, local_kv


def run_unsplit(vllm_config, data: StepData, num_remote_blocks: int):
    """The step through vLLM's own classes over one cache holding both pools (remote ids
    past the local ones)."""
    import torch
    from vllm.v1.attention.backends import triton_attn

    builder_args, impl_args = attention_args(vllm_config)
    builder = triton_attn.TritonAttentionMetadataBuilder(*builder_args)
    impl = triton_attn.TritonAttentionImpl(*impl_args)
    whole_kv = torch.zeros(NUM_LOCAL_BLOCKS + num_remote_blocks, NUM_KV_HEADS, BLOCK_SIZE,
                           2 * HEAD_SIZE)
    all_k, all_v, all_slots = (torch.cat(pair) for pair in zip(
        data.tokens(new=False), data.tokens(new=True), strict=True))
    impl.do_kv_cache_update(Layer(), all_k, all_v, whole_kv, all_slots)
    new_k, new_v, _ = data.tokens(new=True)
    out = torch.full_like(data.query, float("nan"))
    impl.forward(Layer(), data.query, new_k, new_v, whole_kv,
                 builder.build(0, data.common_metadata()), out)
    return out, whole_kv


def group_seq_lens(md) -> dict | None:
    from weaver.vllm_ext.attention.backend import WovenMetadata

    if not isinstance(md, WovenMetadata):
        return None
    step = md.step
    (remote,) = step.remotes  # one cold side
    groups = {"local": step.local, "remote_prefill": remote.prefill,
              "remote_decode": remote.decode}
    return {name: None if rows is None else rows.seq_lens.tolist()
            for name, rows in groups.items()}


def run_hot(plan, protocol) -> None:
    import torch
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend

    from weaver.weaving.hot import HotWeaving
    from weaver.weaving.hot_pairs import HotPairs

    backend, preloaded = woven_triton_backend()
    with tempfile.TemporaryDirectory() as model_dir:
        vllm_config = tiny_vllm_config(Path(model_dir))
    data = StepData(plan.num_remote_blocks)
    hot = HotWeaving.attach(plan)
    woven, md, local_kv = run_woven(backend, HotPairs.of(hot), vllm_config, data)
    region_kv = hot.sender.kv_layer(0).clone()
    plain, whole_kv = run_unsplit(vllm_config, data, plan.num_remote_blocks)
    result = {
        "backend_path": f"{backend.__module__}.{backend.__qualname__}",
        "backend_name": backend.get_name(),
        "is_triton_backend": issubclass(backend, TritonAttentionBackend),
        "gpu_backend_modules_preloaded": preloaded,
        "metadata": type(md).__name__,
        "groups": group_seq_lens(md),
        "max_err_woven_vs_plain": (woven - plain).abs().max().item(),
        "max_err_plain_vs_oracle": (plain - data.dense_attention()).abs().max().item(),
        "local_kv_equal": torch.equal(local_kv, whole_kv[:NUM_LOCAL_BLOCKS]),
        "region_kv_equal": torch.equal(region_kv, whole_kv[NUM_LOCAL_BLOCKS:]),
        "hot": {k: v for k, v in hot.drain_stats().items() if k != "wait_seconds"},
        "sender": vars(hot.sender.stats),
    }
    hot.sender.close()
    print(json.dumps(result), file=protocol)


def main() -> int:
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    role, plan_json = sys.argv[1], sys.argv[2]
    enable_triton_interpreter()
    from weaver.weaving.plan import PairPlan

    plan = PairPlan.from_dict(json.loads(plan_json))
    {"cold": run_cold, "hot": run_hot}[role](plan, protocol)
    return 0


if __name__ == "__main__":
    sys.exit(main())
