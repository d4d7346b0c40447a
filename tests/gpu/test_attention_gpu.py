"""weaver_paged_attention_* against the torch oracle (reference_attention.py, "nd" keys)."""

from __future__ import annotations

import pytest
import torch

from weaver.offload.cuda import kernels
from weaver.offload.reference_attention import key_layout_of, paged_decode_attention_reference

pytestmark = pytest.mark.gpu

# rel. error bounds: fp32 accumulation throughout, so the output rounding dominates
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1e-2}

# (num_seqs, num_q_heads, num_kv_heads, head_size, block_size, max_len, window, softcap)
CASES = [
    (1, 1, 1, 64, 16, 1, -1, 0.0),  # single token
    (4, 8, 8, 128, 16, 300, -1, 0.0),  # MHA
    (7, 32, 8, 128, 16, 1000, -1, 0.0),  # Llama-3-8B GQA, ragged
    (3, 14, 2, 64, 32, 257, -1, 0.0),  # GQA 7:1, block 32
    (5, 16, 4, 80, 64, 600, -1, 0.0),  # head size not a power of two
    (2, 8, 1, 256, 16, 130, -1, 0.0),  # MQA, largest head size
    (6, 8, 2, 96, 48, 500, 64, 0.0),  # sliding window, block size 48
    (3, 4, 2, 128, 16, 200, -1, 30.0),  # softcap (Gemma-2 style)
]


def _case(num_seqs, num_q_heads, num_kv_heads, head_size, block_size, max_len, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    seq_lens = torch.randint(1, max_len + 1, (num_seqs,), generator=gen, dtype=torch.int32)
    seq_lens[0] = max_len  # the longest length always appears
    max_blocks = -(-max_len // block_size) + 1  # one spare column: tables may be wider
    num_blocks = num_seqs * max_blocks + 3
    # distinct, shuffled blocks per sequence, as a block allocator hands them out
    table = torch.randperm(num_blocks, generator=gen)[: num_seqs * max_blocks]
    table = table.view(num_seqs, max_blocks).to(torch.int32)
    pool = torch.randn(num_blocks, num_kv_heads, block_size, 2 * head_size, generator=gen)
    q = torch.randn(num_seqs, num_q_heads, head_size, generator=gen)
    return q.to(dtype), pool.to(dtype), seq_lens, table


@pytest.mark.parametrize("kv_format", ["pages", "token"])
@pytest.mark.parametrize("dtype", list(TOLERANCE), ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
def test_matches_reference(library, case, dtype: torch.dtype, kv_format: str) -> None:
    num_seqs, hq, hkv, d, n, max_len, window, softcap = case
    q, pool, seq_lens, table = _case(
        num_seqs, hq, hkv, d, n, max_len, dtype, seed=hash(case) % 2**31
    )
    scale = d**-0.5
    expected = paged_decode_attention_reference(
        q, pool, seq_lens, table, scale, sliding_window=window, softcap=softcap,
        key_layout=key_layout_of(kv_format),
    ).float()
    dev = torch.device("cuda")
    out = torch.full_like(q, float("nan"), device=dev)  # poison: every element must be written
    error_flag = torch.zeros(1, dtype=torch.int32, device=dev)
    kernels.paged_decode_attention(
        library, q.to(dev), pool.to(dev), seq_lens.to(dev), table.to(dev), scale,
        sliding_window=window, softcap=softcap, out=out, error_flag=error_flag,
        kv_format=kv_format,
    )  # fmt: skip
    torch.cuda.synchronize()
    got = out.float().cpu()
    assert not torch.isnan(got).any(), "some outputs were not written"
    assert int(error_flag.item()) == 0
    rel = (got - expected).norm() / expected.norm()
    assert rel < TOLERANCE[dtype], f"relative error {rel:.2e}"


@pytest.mark.parametrize("num_blocks", [1, 5])
def test_any_grid_size_gives_the_same_result(library, num_blocks: int) -> None:
    q, pool, seq_lens, table = (
        t.cuda() for t in _case(3, 8, 2, 64, 16, 100, torch.float32, seed=1)
    )
    full = kernels.paged_decode_attention(library, q, pool, seq_lens, table, 0.125)
    small = kernels.paged_decode_attention(
        library, q, pool, seq_lens, table, 0.125, num_blocks=num_blocks
    )
    torch.cuda.synchronize()
    assert torch.equal(full, small)


def test_block_id_outside_the_pool_is_flagged_not_read(library) -> None:
    q, pool, seq_lens, table = (t.cuda() for t in _case(2, 4, 2, 64, 16, 40, torch.float16, seed=2))
    table[1, 0] = pool.shape[0] + 1000
    error_flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    out = kernels.paged_decode_attention(
        library, q, pool, seq_lens, table, 0.1, error_flag=error_flag
    )
    torch.cuda.synchronize()
    assert int(error_flag.item()) == 1
    assert torch.equal(out[1].float().cpu(), torch.zeros(4, 64))  # the bad sequence
    assert torch.isfinite(out[0].float()).all()


def test_length_longer_than_the_block_table_is_flagged(library) -> None:
    q, pool, seq_lens, table = (t.cuda() for t in _case(2, 4, 2, 64, 16, 40, torch.float32, seed=3))
    seq_lens[0] = table.shape[1] * 16 + 1  # one token past the table row
    error_flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    out = kernels.paged_decode_attention(
        library, q, pool, seq_lens, table, 0.1, error_flag=error_flag
    )
    torch.cuda.synchronize()
    assert int(error_flag.item()) == 1
    assert torch.equal(out[0].cpu(), torch.zeros(4, 64))
