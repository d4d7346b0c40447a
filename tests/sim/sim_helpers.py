"""A linear profile whose step times are easy to compute by hand (simulator tests)."""

from __future__ import annotations

from weaver.sim.profile import ModelShape, Profile

# prefill(n) = P0 + P1 * n; decode(b, c) = D0 + DB * b + DC * c; attention(c) = A1 * c
P0, P1 = 0.010, 1e-4
D0, DB, DC = 0.020, 1e-3, 1e-6
A1 = 5e-7
SHAPE = ModelShape("test-1b", num_layers=4, hidden_size=256, num_heads=4, num_kv_heads=2,
                   head_size=64, intermediate_size=512, vocab_size=1000)


def linear_profile() -> Profile:
    batches, contexts = [1, 1000], [0, 1_000_000]
    return Profile(
        device="A100-80GB", shape=SHAPE, source="synthetic linear profile for tests",
        memory_bytes=80 << 30,
        prefill_tokens=[1, 10_000], prefill_s=[P0 + P1 * 1, P0 + P1 * 10_000],
        decode_batch_sizes=batches, decode_context_tokens=contexts,
        decode_s=[[D0 + DB * b + DC * c for c in contexts] for b in batches],
        attention_context_tokens=contexts, attention_s=[A1 * c for c in contexts],
        link_bandwidth_bps=1e9, link_latency_s=1e-3,
    )


def prefill_time(n: int) -> float:
    return P0 + P1 * n


def decode_time(b: int, c: int) -> float:
    return D0 + DB * b + DC * c
