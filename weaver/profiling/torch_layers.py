"""Measure a profile on a real device: random-weight Llama-shaped layers in plain torch.

CPU only here (the GPU path would time the same code with CUDA events). Each layer is
RMSNorm -> fused qkv -> GQA attention over a KV cache -> o_proj -> RMSNorm -> gated MLP,
followed by the LM head, so step times scale with the shape the same way a real model's
do. Each point is the minimum of a few repeats after a warm-up (as `timeit` advises: on a
shared machine the noise only ever adds time). Import torch lazily: the rest of
`weaver.sim` stays importable without it.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass

from weaver.profiling.timer import best_time, copy_bandwidth
from weaver.sim.profile import ModelShape, Profile

DEFAULT_PREFILL_TOKENS = [16, 32, 64, 128, 256, 512]
DEFAULT_BATCH_SIZES = [1, 2, 4, 8, 16]
DEFAULT_CONTEXT_TOKENS = [64, 256, 1024, 4096]


@dataclass(frozen=True)
class MeasureSettings:
    prefill_tokens: tuple[int, ...] = tuple(DEFAULT_PREFILL_TOKENS)
    batch_sizes: tuple[int, ...] = tuple(DEFAULT_BATCH_SIZES)
    context_tokens: tuple[int, ...] = tuple(DEFAULT_CONTEXT_TOKENS)
    num_repeats: int = 5
    seed: int = 0
    num_threads: int = 1  # one thread: stable timings on a machine shared with others


class _Stack:
    """Random-weight decoder layers of `shape` (weights in float32 on CPU)."""

    def __init__(self, shape: ModelShape, seed: int) -> None:
        import torch

        gen = torch.Generator().manual_seed(seed)
        h, d = shape.hidden_size, shape.head_size

        def weight(rows: int, cols: int):
            return torch.randn(rows, cols, generator=gen) / cols**0.5

        self.shape = shape
        self.layers = [
            {
                "qkv": weight((shape.num_heads + 2 * shape.num_kv_heads) * d, h),
                "o": weight(h, shape.num_heads * d),
                "gate_up": weight(2 * shape.intermediate_size, h),
                "down": weight(h, shape.intermediate_size),
            }
            for _ in range(shape.num_layers)
        ]
        self.lm_head = weight(shape.vocab_size, h)

    def attention(self, q, k, v, causal: bool):
        import torch.nn.functional as F

        groups = self.shape.num_heads // self.shape.num_kv_heads
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def forward(self, x, kv_cache: list | None):
        """x: [batch, tokens, hidden]; kv_cache: per layer (k, v) of [batch, kv, ctx, d]
        for decode, None for prefill. Returns logits of the last token."""
        import torch
        import torch.nn.functional as F

        s = self.shape
        b, n, _ = x.shape
        for i, layer in enumerate(self.layers):
            hx = F.rms_norm(x, (s.hidden_size,))
            qkv = hx @ layer["qkv"].T
            q, k, v = qkv.split([s.num_heads * s.head_size, s.num_kv_heads * s.head_size,
                                 s.num_kv_heads * s.head_size], dim=-1)
            q = q.view(b, n, s.num_heads, s.head_size).transpose(1, 2)
            k = k.view(b, n, s.num_kv_heads, s.head_size).transpose(1, 2)
            v = v.view(b, n, s.num_kv_heads, s.head_size).transpose(1, 2)
            if kv_cache is not None:
                k = torch.cat([kv_cache[i][0], k], dim=2)
                v = torch.cat([kv_cache[i][1], v], dim=2)
            attn = self.attention(q, k, v, causal=kv_cache is None)
            x = x + attn.transpose(1, 2).reshape(b, n, -1) @ layer["o"].T
            hx = F.rms_norm(x, (s.hidden_size,))
            gate, up = (hx @ layer["gate_up"].T).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ layer["down"].T
        return x[:, -1] @ self.lm_head.T


def _kv_cache(shape: ModelShape, batch: int, per_seq: int):
    import torch

    size = (batch, shape.num_kv_heads, per_seq, shape.head_size)
    return [(torch.randn(size), torch.randn(size)) for _ in range(shape.num_layers)]


def measure_cpu_profile(shape: ModelShape, settings: MeasureSettings | None = None,
                        progress: bool = True) -> Profile:
    """Time prefill, decode steps and decode attention of `shape` on this CPU."""
    import torch
    from tqdm import tqdm

    settings = settings or MeasureSettings()
    torch.set_num_threads(settings.num_threads)
    stack = _Stack(shape, settings.seed)
    num_points = (len(settings.prefill_tokens) + len(settings.context_tokens)
                  * (len(settings.batch_sizes) + 1) + 1)
    bar = tqdm(total=num_points, desc=f"profile {shape.name} on cpu", disable=not progress)
    hidden = shape.hidden_size
    with torch.inference_mode():
        prefill_s = []
        for n in settings.prefill_tokens:
            x = torch.randn(1, n, hidden)
            prefill_s.append(best_time(lambda x=x: stack.forward(x, None),
                                          settings.num_repeats))
            bar.update()
        decode_s = []
        for b in settings.batch_sizes:
            row = []
            for total in settings.context_tokens:
                cache = _kv_cache(shape, b, max(total // b, 1))
                x = torch.randn(b, 1, hidden)
                row.append(best_time(lambda x=x, c=cache: stack.forward(x, c),
                                        settings.num_repeats))
                bar.update()
            decode_s.append(row)
        attention_s = []
        for total in settings.context_tokens:
            attention_s.append(_attention_time(stack, total, settings.num_repeats))
            bar.update()
        bandwidth = copy_bandwidth()
        bar.update()
    bar.close()
    return Profile(
        device=f"cpu:{platform.machine()}",
        shape=shape,
        source=f"measured on {platform.processor() or platform.machine()} CPU, "
               f"{torch.get_num_threads()} torch threads, torch {torch.__version__}, "
               f"random-weight Llama-shaped layers (weaver.profiling.torch_layers)",
        memory_bytes=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        prefill_tokens=list(settings.prefill_tokens),
        prefill_s=prefill_s,
        decode_batch_sizes=list(settings.batch_sizes),
        decode_context_tokens=list(settings.context_tokens),
        decode_s=decode_s,
        attention_context_tokens=list(settings.context_tokens),
        attention_s=attention_s,
        link_bandwidth_bps=bandwidth,
        link_latency_s=1e-6,
        notes={"link": "memcpy bandwidth of this host (the CPU transport is shared "
                       "memory)", "dtype": "float32"},
    )


def _attention_time(stack: _Stack, total: int, num_repeats: int) -> float:
    """Decode attention alone, all layers, 4 sequences sharing `total` context tokens."""
    import torch

    s = stack.shape
    batch = min(4, total)
    cache = _kv_cache(s, batch, max(total // batch, 1))
    q = torch.randn(batch, s.num_heads, 1, s.head_size)

    def run() -> None:
        for k, v in cache:
            stack.attention(q, k, v, causal=False)

    return best_time(run, num_repeats)
