"""Worker-side timing of the operators that the splitter plans for (docs/architecture.md, part 7).

``OpProfiler`` puts forward pre/post hooks on a running model's operators, by the names the
split profile uses (weaver/splitting/profile.py): per layer ``qkv``, ``attn``, ``o``,
``gate_up``, ``down``, and the ``lm_head`` (inside ``LogitsProcessor``: docs/vllm-hooks.md,
"Layers").
Each call is recorded with the number of tokens it ran on, so the gateway can keep the
pure decode steps of a known batch. The hooks fire in eager mode only (engines are
started with --enforce-eager). On an asynchronous device ``synchronize`` brackets each
sample so that it covers the kernel, not its launch.

``time_attention`` times vLLM's CPU paged-attention kernel at a hot model's shape (K and
N of the paper), and ``time_split_overhead`` the cost of one extra GEMM chunk.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from weaver.offload.layout import HotAttentionShape
from weaver.profiling.timer import measure
from weaver.vllm_ext.layers import LINEAR_OP_KINDS, ChunkedLinear


def _op_kind(module: Any) -> str | None:
    from vllm.model_executor.layers.attention import Attention
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.logits_processor import LogitsProcessor

    if isinstance(module, LinearBase):
        return LINEAR_OP_KINDS.get(module.prefix.rsplit(".", 1)[-1])
    if isinstance(module, Attention):
        return "attn"
    if isinstance(module, LogitsProcessor):
        return "lm_head"
    return None


def _num_tokens(args: tuple) -> int:
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    return int(tensors[0].shape[0]) if tensors else -1


def _split_dim_size(kind: str, module: Any) -> int | None:
    """Output features of a linear layer; None for attention and the LM head (known
    from the batch and the vocabulary)."""
    if kind in ("attn", "lm_head"):
        return None
    return int(module.output_size_per_partition)


class OpProfiler:
    """Records (op kind, tokens, seconds) for every hooked call until ``stop``."""

    def __init__(self, model: torch.nn.Module,
                 synchronize: Callable[[], None] | None = None) -> None:
        self._sync = synchronize or (lambda: None)
        self._starts: dict[int, float] = {}
        self.samples: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
        self.lm_head_ends: dict[int, list[float]] = defaultdict(list)
        self.split_dims: dict[str, int] = {}
        self.num_layers = 0
        self._handles = []
        for module in model.modules():
            kind = _op_kind(module)
            if kind is None:
                continue
            self.num_layers += kind == "attn"
            dim = _split_dim_size(kind, module)
            if dim is not None:
                self.split_dims[kind] = dim
            self._handles.append(module.register_forward_pre_hook(self._pre))
            self._handles.append(module.register_forward_hook(self._make_post(kind)))
        if not self.num_layers:
            raise RuntimeError("no attention layers found to profile: is this a decoder model "
                               "built by vLLM in eager mode?")
        self.split_dims["lm_head"] = _vocab_rows(model)

    def _pre(self, module: Any, args: tuple) -> None:
        self._sync()
        self._starts[id(module)] = time.perf_counter()

    def _make_post(self, kind: str) -> Callable[..., None]:
        def post(module: Any, args: tuple, output: Any) -> None:
            self._sync()
            end = time.perf_counter()
            start = self._starts.pop(id(module), None)
            if start is None:
                return
            tokens = _num_tokens(args)
            self.samples[kind][tokens].append(end - start)
            if kind == "lm_head":
                self.lm_head_ends[tokens].append(end)

        return post

    def stop(self) -> dict[str, Any]:
        """Remove the hooks; the raw samples, keyed by op kind then token count (as str:
        the result crosses vLLM's RPC as msgpack/JSON)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        return {
            "num_layers": self.num_layers,
            "split_dims": dict(self.split_dims),
            "samples": {kind: {str(t): v for t, v in by_tokens.items()}
                        for kind, by_tokens in self.samples.items()},
            "lm_head_ends": {str(t): v for t, v in self.lm_head_ends.items()},
        }


def _vocab_rows(model: torch.nn.Module) -> int:
    lm_head = getattr(model, "lm_head", None)
    weight = getattr(lm_head, "weight", None)
    if weight is None or weight.ndim != 2:
        raise RuntimeError("the model has no lm_head weight to profile; only causal LMs with "
                           "an unquantized head are supported")
    return int(weight.shape[0])


def time_attention(shape: HotAttentionShape, num_seqs: int, context_len: int, *,
                   num_iters: int = 30) -> dict[str, float]:
    """One decode-attention call of ``num_seqs`` sequences of ``context_len`` tokens at
    ``shape``, with vLLM's CPU kernel (what the hot side runs locally and what the cold
    side runs for an offloaded task)."""
    from weaver.vllm_ext.attention.cpu_kernels import CpuPagedAttentionExecutor

    if num_seqs < 1 or context_len < 1:
        raise ValueError(f"num_seqs={num_seqs} and context_len={context_len} must be >= 1")
    dtype = shape.torch_dtype
    blocks_per_seq = -(-context_len // shape.block_size)
    num_blocks = num_seqs * blocks_per_seq
    gen = torch.Generator().manual_seed(0)
    kv_layer = torch.randn(num_blocks, shape.num_kv_heads, shape.block_size,
                           2 * shape.head_size, generator=gen).to(dtype)
    q = torch.randn(num_seqs, shape.num_q_heads, shape.head_size, generator=gen).to(dtype)
    out = torch.empty_like(q)
    table = torch.randperm(num_blocks, generator=gen).to(torch.int32).view(num_seqs, -1)
    seq_lens = torch.full((num_seqs,), context_len, dtype=torch.int32)
    executor = CpuPagedAttentionExecutor(shape)
    scale = shape.head_size ** -0.5
    stats = measure(lambda: executor.run(q, kv_layer, seq_lens, table, out, scale=scale),
                    num_iters=num_iters)
    return {"mean_s": stats.mean_s, "p50_s": stats.p50_s, "num_samples": stats.num_samples}


def time_split_overhead(in_features: int, out_features: int, num_tokens: int, *,
                        num_chunks: int = 8, num_iters: int = 50) -> float:
    """Seconds one extra chunk adds: a GEMM packed as ``num_chunks`` chunks against the
    same GEMM whole, with the engine's own packing, divided by the extra chunks. Never
    negative (noise can make the chunked run the faster one)."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=gen)
    x = torch.randn(num_tokens, in_features, generator=gen)
    whole = ChunkedLinear(weight, None, 1, "overhead-probe")
    chunked = ChunkedLinear(weight, None, num_chunks, "overhead-probe")
    whole_s = measure(lambda: whole(x, use_bias=False), num_iters=num_iters).p50_s
    chunked_s = measure(lambda: chunked(x, use_bias=False), num_iters=num_iters).p50_s
    return max(0.0, (chunked_s - whole_s) / (num_chunks - 1))
