"""A Llama-shaped decoder with seeded random weights, in plain torch (no HF, no vLLM).

The layers of Llama (embedding, RMSNorm, q/k/v/o projections, rotary embedding, SwiGLU
MLP, LM head); only the shapes and the seed say which model it is, as in
weaver/models/random_llama.py. The attention is a callable the caller passes per forward
(``Attend``), so the same model decodes with a local paged cache or weaves its remote
sequences' attention into another process. Every operator is a module of its own, so a
cold process can put a poll point after each (``operators``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

# (layer index, q [T, num_q_heads, head_size], k and v [T, num_kv_heads, head_size])
#   -> attention output [T, num_q_heads, head_size]
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class LlamaShape:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_size: int
    intermediate_size: int
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"num_q_heads {self.num_q_heads} must be a multiple of "
                             f"num_kv_heads {self.num_kv_heads}")
        if self.head_size % 2:
            raise ValueError(f"head_size {self.head_size} must be even (rotary halves)")

    @property
    def scale(self) -> float:
        return self.head_size ** -0.5


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def apply_rotary(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding of x [T, heads, D] at positions [T], halves rotated (HF Llama)."""
    half = x.shape[-1] // 2
    inv_freq = theta ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class AttentionOp(nn.Module):
    """The attention proper of one layer: a module of its own so a poll point follows it."""

    def __init__(self, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                attend: Attend) -> torch.Tensor:
        return attend(self.layer_index, q, k, v)


class SelfAttention(nn.Module):
    def __init__(self, shape: LlamaShape, layer_index: int) -> None:
        super().__init__()
        self.shape = shape
        q_size, kv_size = shape.num_q_heads * shape.head_size, shape.num_kv_heads * shape.head_size
        self.q_proj = nn.Linear(shape.hidden_size, q_size, bias=False)
        self.k_proj = nn.Linear(shape.hidden_size, kv_size, bias=False)
        self.v_proj = nn.Linear(shape.hidden_size, kv_size, bias=False)
        self.o_proj = nn.Linear(q_size, shape.hidden_size, bias=False)
        self.attn = AttentionOp(layer_index)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        s, num_tokens = self.shape, x.shape[0]
        q = self.q_proj(x).view(num_tokens, s.num_q_heads, s.head_size)
        k = self.k_proj(x).view(num_tokens, s.num_kv_heads, s.head_size)
        v = self.v_proj(x).view(num_tokens, s.num_kv_heads, s.head_size)
        q, k = apply_rotary(q, positions, s.rope_theta), apply_rotary(k, positions, s.rope_theta)
        out = self.attn(q, k, v, attend)
        return self.o_proj(out.reshape(num_tokens, s.num_q_heads * s.head_size))


class SwiGLU(nn.Module):
    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(shape.hidden_size, shape.intermediate_size, bias=False)
        self.up_proj = nn.Linear(shape.hidden_size, shape.intermediate_size, bias=False)
        self.down_proj = nn.Linear(shape.intermediate_size, shape.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, shape: LlamaShape, layer_index: int) -> None:
        super().__init__()
        self.input_norm = RMSNorm(shape.hidden_size, shape.rms_eps)
        self.self_attn = SelfAttention(shape, layer_index)
        self.post_attention_norm = RMSNorm(shape.hidden_size, shape.rms_eps)
        self.mlp = SwiGLU(shape)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        x = x + self.self_attn(self.input_norm(x), positions, attend)
        return x + self.mlp(self.post_attention_norm(x))


class TinyLlama(nn.Module):
    """float32 weights drawn from one seed on the CPU, then moved: the same model on any
    device."""

    def __init__(self, shape: LlamaShape, seed: int, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.shape = shape
        self.embed = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(shape, i) for i in range(shape.num_layers))
        self.norm = RMSNorm(shape.hidden_size, shape.rms_eps)
        self.lm_head = nn.Linear(shape.hidden_size, shape.vocab_size, bias=False)
        self._draw_weights(seed)
        self.to(device)

    def _draw_weights(self, seed: int) -> None:
        # std 1/sqrt(fan_in) keeps activations and logits O(1): the closest greedy pick of
        # a default run is ~7e-3 ahead of the runner-up (min_logit_margin in the figures),
        # far above what two correct float32 attention kernels differ by.
        gen = torch.Generator().manual_seed(seed)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                std = 1.0 / math.sqrt(module.in_features)
            elif isinstance(module, nn.Embedding):
                std = 1.0
            else:
                continue
            module.weight.requires_grad_(False)
            module.weight.copy_(torch.randn(module.weight.shape, generator=gen) * std)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attend: Attend,
                sample_rows: torch.Tensor) -> torch.Tensor:
        """Logits [len(sample_rows), vocab] (float32) of the given token rows."""
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x, positions, attend)
        return self.lm_head(self.norm(x[sample_rows]))

    def operators(self) -> list[nn.Module]:
        """The modules a cold process polls after: linear layers, attention, MLPs, norms."""
        kinds = (nn.Linear, AttentionOp, SwiGLU, RMSNorm)
        return [m for m in self.modules() if isinstance(m, kinds)]
