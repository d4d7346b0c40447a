"""vLLM's CPU attention kernels, driven by the cold side's executor (weaver/vllm_ext/attention/
cpu_kernels.py) through the channel, against the oracle."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import uuid

import pytest
import torch
from offload_helpers import spawn_cold_worker, stop_cold_worker, wait_cold_worker_ready

from weaver.offload.layout import HotAttentionShape, RegionLayout
from weaver.offload.reference_attention import (
    gather_kv_reference,
    paged_decode_attention_reference,
    write_kv_reference,
)
from weaver.offload.sender import OffloadSender
from weaver.offload.shm import ShmRegion, region_name, region_paths

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM (CPU build) is not installed", allow_module_level=True)

XPROC_SHAPE = HotAttentionShape(3, 9, 3, 64, 32, "float32")
XPROC_LAYOUT = RegionLayout(
    XPROC_SHAPE, num_remote_blocks=10, max_seqs_per_task=6, max_blocks_per_seq=4
)


@pytest.fixture(scope="module", autouse=True)
def vllm_cold_worker():
    """Spawned first, so the cold process imports vLLM while this one does too."""
    name = region_name(f"wvtest{os.getpid()}", "hot", uuid.uuid4().hex[:8])
    proc = spawn_cold_worker(name, XPROC_LAYOUT, executor="vllm", poller=True)
    yield proc, name
    stop_cold_worker(proc)
    leftovers = [p for p in region_paths(name) if os.path.exists(p)]
    for path in leftovers:
        os.unlink(path)
    assert not leftovers, f"cold worker left {leftovers}"


@pytest.fixture(scope="module")
def cpm():
    """weaver.vllm_ext.attention.cpu_kernels, imported lazily (it imports vLLM)."""
    return importlib.import_module("weaver.vllm_ext.attention.cpu_kernels")


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def make_pools(cpm, shape: HotAttentionShape, num_blocks: int, gen: torch.Generator, isa: str):
    """The same dense K/V written by vLLM's op (kernel layout) and by the oracle ('nd')."""
    dtype = DTYPES[shape.dtype]
    pool_shape = (num_blocks, shape.num_kv_heads, shape.block_size, 2 * shape.head_size)
    num_slots = num_blocks * shape.block_size
    key = torch.randn(num_slots, shape.num_kv_heads, shape.head_size, generator=gen).to(dtype)
    value = torch.randn(num_slots, shape.num_kv_heads, shape.head_size, generator=gen).to(dtype)
    slots = torch.randperm(num_slots, generator=gen)  # scattered writes, as in decode
    pool_vllm = torch.zeros(pool_shape, dtype=dtype)
    pool_ref = torch.zeros(pool_shape, dtype=dtype)
    cpm.write_kv_to_pool(pool_vllm, key, value, slots, isa=isa)
    write_kv_reference(pool_ref, key, value, slots, key_layout="nd")
    return pool_vllm, pool_ref


def ragged_batch(shape: HotAttentionShape, num_blocks: int, gen: torch.Generator):
    bs = shape.block_size
    max_blocks = 4
    lens = torch.tensor([1, bs, bs + 1, 3 * bs + 7, 4 * bs, 2], dtype=torch.int32)
    table = torch.stack([torch.randperm(num_blocks, generator=gen)[:max_blocks] for _ in lens])
    q = torch.randn(len(lens), shape.num_q_heads, shape.head_size, generator=gen)
    return q.to(DTYPES[shape.dtype]), lens, table.to(torch.int32)


SHAPES = [
    HotAttentionShape(2, 9, 3, 64, 32, "float32"),
    HotAttentionShape(2, 9, 3, 64, 128, "float32"),
    HotAttentionShape(2, 4, 2, 32, 32, "float32"),
    HotAttentionShape(2, 4, 2, 32, 128, "float32"),
]


@pytest.mark.parametrize(
    "shape",
    SHAPES,
    ids=lambda s: f"q{s.num_q_heads}kv{s.num_kv_heads}d{s.head_size}b{s.block_size}",
)
def test_executor_matches_reference(cpm, shape):
    gen = torch.Generator().manual_seed(shape.head_size + shape.block_size)
    executor = cpm.CpuPagedAttentionExecutor(shape)
    pool_vllm, pool_ref = make_pools(cpm, shape, 9, gen, executor.isa)
    q, lens, table = ragged_batch(shape, 9, gen)
    scale = shape.head_size**-0.5
    out = torch.full_like(q, float("nan"))
    executor.run(q, pool_vllm, lens, table, out, scale=scale)
    expected = paged_decode_attention_reference(q, pool_ref, lens, table, scale)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    # a sub-batch (what one task carries) gives the same rows
    sub = torch.empty_like(q[2:5])
    executor.run(q[2:5], pool_vllm, lens[2:5], table[2:5], sub, scale=scale)
    torch.testing.assert_close(sub, expected[2:5], rtol=1e-4, atol=1e-5)


def test_reused_executor_equals_a_fresh_one_bit_for_bit(cpm):
    """The executor keeps the scheduler metadata and the K/V views between tasks; a task
    must come out exactly as from a fresh executor whatever ran before it: another layer
    with the same lengths (what a hot step sends), other lengths of the same count, another
    batch size, another window, and after release()."""
    shape = HotAttentionShape(2, 9, 3, 64, 32, "float32")
    gen = torch.Generator().manual_seed(21)
    reused = cpm.CpuPagedAttentionExecutor(shape)
    pools = [make_pools(cpm, shape, 9, gen, reused.isa)[0] for _ in range(2)]
    q, lens, table = ragged_batch(shape, 9, gen)
    longer = torch.tensor([4 * shape.block_size] * len(lens), dtype=torch.int32)
    tasks = [  # (pool, rows, seq_lens, sliding_window)
        (0, slice(None), lens, -1),
        (1, slice(None), lens, -1),  # next layer, same lengths: cached metadata and views
        (0, slice(None), longer, -1),  # same count, other lengths
        (1, slice(0, 3), lens[:3], -1),  # fewer sequences
        (1, slice(0, 3), lens[:3], 40),  # a sliding window
        (0, slice(None), lens, -1),  # back to the first task
    ]
    for step, (pool, rows, seq_lens, window) in enumerate(tasks):
        if step == 5:
            reused.release()
        got = torch.full_like(q[rows], float("nan"))
        reused.run(q[rows], pools[pool], seq_lens, table[rows], got, scale=0.125,
                   sliding_window=window)
        fresh = torch.full_like(q[rows], float("nan"))
        cpm.CpuPagedAttentionExecutor(shape).run(q[rows], pools[pool], seq_lens, table[rows],
                                                 fresh, scale=0.125, sliding_window=window)
        assert torch.equal(got, fresh), f"task {step} differs from a fresh executor's"


def test_executor_bfloat16_matches_reference_loosely(cpm):
    shape = HotAttentionShape(1, 8, 2, 64, 32, "bfloat16")
    gen = torch.Generator().manual_seed(11)
    executor = cpm.CpuPagedAttentionExecutor(shape)
    pool_vllm, pool_ref = make_pools(cpm, shape, 9, gen, executor.isa)
    q, lens, table = ragged_batch(shape, 9, gen)
    out = torch.empty_like(q)
    executor.run(q, pool_vllm, lens, table, out, scale=0.125)
    expected = paged_decode_attention_reference(q, pool_ref, lens, table, 0.125)
    torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("window, softcap", [(40, 0.0), (-1, 5.0)])
def test_executor_sliding_window_and_softcap(cpm, window, softcap):
    shape = HotAttentionShape(1, 4, 2, 32, 32, "float32")
    gen = torch.Generator().manual_seed(12)
    executor = cpm.CpuPagedAttentionExecutor(shape)
    pool_vllm, pool_ref = make_pools(cpm, shape, 9, gen, executor.isa)
    q, lens, table = ragged_batch(shape, 9, gen)
    out = torch.empty_like(q)
    kwargs = dict(sliding_window=window, softcap=softcap)
    executor.run(q, pool_vllm, lens, table, out, scale=0.3, **kwargs)
    expected = paged_decode_attention_reference(q, pool_ref, lens, table, 0.3, **kwargs)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


def test_vllm_write_uses_the_documented_key_layout(cpm):
    shape = HotAttentionShape(1, 4, 2, 32, 32, "float32")
    isa = cpm.select_cpu_attn_isa(shape.torch_dtype, shape.block_size, shape.head_size)
    if isa not in ("vec", "vec16"):
        pytest.skip(f"key layout of ISA {isa} is kernel-specific; the oracle covers vec/vec16")
    gen = torch.Generator().manual_seed(13)
    num_slots = 3 * shape.block_size
    key = torch.randn(num_slots, 2, 32, generator=gen)
    value = torch.randn(num_slots, 2, 32, generator=gen)
    slots = torch.randperm(num_slots, generator=gen)
    pool_vllm = torch.zeros(3, 2, 32, 64)
    cpm.write_kv_to_pool(pool_vllm, key, value, slots, isa=isa)
    pool_dn, pool_nd = torch.zeros_like(pool_vllm), torch.zeros_like(pool_vllm)
    write_kv_reference(pool_dn, key, value, slots, key_layout="dn")
    write_kv_reference(pool_nd, key, value, slots, key_layout="nd")
    assert torch.equal(pool_vllm, pool_dn)  # K pages are [D, N] for vec/vec16
    assert not torch.equal(pool_vllm, pool_nd)
    # V pages are token-major [N, D] in both layouts
    _, v_vllm = gather_kv_reference(pool_vllm, torch.arange(3), num_slots, key_layout="nd")
    _, v_nd = gather_kv_reference(pool_nd, torch.arange(3), num_slots, key_layout="nd")
    assert torch.equal(v_vllm, v_nd)


@pytest.mark.parametrize(
    "shape, match",
    [
        (HotAttentionShape(1, 4, 2, 48, 32, "float32"), "head_size 48"),
        (HotAttentionShape(1, 4, 2, 32, 16, "float32"), "multiple of 32"),
    ],
)
def test_executor_rejects_shapes_cpu_attn_cannot_run(cpm, shape, match):
    with pytest.raises(ValueError, match=match):
        cpm.CpuPagedAttentionExecutor(shape)


def test_write_kv_to_pool_rejects_bad_input(cpm):
    pool = torch.zeros(2, 2, 32, 64)
    kv = torch.zeros(3, 2, 32)
    with pytest.raises(ValueError, match="must both be"):
        cpm.write_kv_to_pool(
            pool, torch.zeros(3, 1, 32), torch.zeros(3, 1, 32), torch.arange(3), isa="vec"
        )
    with pytest.raises(ValueError, match="dtype"):
        cpm.write_kv_to_pool(pool, kv.bfloat16(), kv.bfloat16(), torch.arange(3), isa="vec")
    with pytest.raises(ValueError, match="slots must be in"):
        cpm.write_kv_to_pool(pool, kv, kv, torch.tensor([0, 1, 64]), isa="vec")
    with pytest.raises(ValueError, match="slot_mapping must be"):
        cpm.write_kv_to_pool(pool, kv, kv, torch.arange(2), isa="vec")
    # -1 is vLLM's padding slot: skipped, nothing written
    cpm.write_kv_to_pool(pool, kv + 1, kv + 1, torch.tensor([-1, 0, 63]), isa="vec")
    assert int((pool != 0).sum()) == 2 * 2 * 2 * 32


def test_vllm_kernel_signatures_have_not_drifted(cpm):
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends import cpu_attn

    params = inspect.signature(ops.cpu_attention_with_kv_cache).parameters
    assert list(params)[:14] == [
        "query",
        "key_cache",
        "value_cache",
        "output",
        "query_start_loc",
        "seq_lens",
        "scale",
        "causal",
        "alibi_slopes",
        "sliding_window",
        "block_table",
        "softcap",
        "scheduler_metadata",
        "s_aux",
    ]
    params = inspect.signature(ops.cpu_attn_get_scheduler_metadata).parameters
    assert {
        "num_reqs",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "seq_lens",
        "dtype",
        "query_start_loc",
        "causal",
        "sliding_window_size",
        "isa",
        "enable_kv_split",
    } <= set(params)
    assert list(inspect.signature(cpu_attn._get_attn_isa).parameters) == [
        "dtype",
        "block_size",
        "head_size",
        "kv_cache_dtype",
    ]


def test_cross_process_round_trip_with_vllm_kernel(cpm, vllm_cold_worker):
    """Cold process owns the region and serves from its idle poller with vLLM's kernel."""
    proc, name = vllm_cold_worker
    shape, layout = XPROC_SHAPE, XPROC_LAYOUT
    isa = cpm.select_cpu_attn_isa(shape.torch_dtype, shape.block_size, shape.head_size)
    gen = torch.Generator().manual_seed(21)
    wait_cold_worker_ready(proc)
    sender = OffloadSender(ShmRegion.attach(layout, name, wait_s=30))
    ref_pools = []
    for layer in range(shape.num_layers):
        pool_vllm, pool_ref = make_pools(cpm, shape, 10, gen, isa)
        sender.kv_layer(layer).copy_(pool_vllm)  # the hot side's K/V live in the region
        ref_pools.append(pool_ref)
    for step in range(2):
        for layer in range(shape.num_layers):
            q, lens, table = ragged_batch(shape, 10, gen)
            scale = 0.1 + 0.01 * layer
            ticket = sender.submit(layer, q, lens, table, scale=scale)
            out = sender.wait(ticket, timeout_s=30).clone()
            expected = paged_decode_attention_reference(q, ref_pools[layer], lens, table, scale)
            torch.testing.assert_close(
                out, expected, rtol=1e-4, atol=1e-5, msg=f"step {step} layer {layer}"
            )
    # New K/V the hot side writes straight into the region are seen by the cold side.
    new_k = torch.randn(1, 3, 64, generator=gen)
    new_v = torch.randn(1, 3, 64, generator=gen)
    slot = torch.tensor([int(table[0, 1]) * shape.block_size])  # block 2 of seq 0, offset 0
    cpm.write_kv_to_pool(sender.kv_layer(0), new_k, new_v, slot, isa=isa)
    write_kv_reference(ref_pools[0], new_k, new_v, slot)
    lens1 = torch.tensor([shape.block_size + 1], dtype=torch.int32)
    ticket = sender.submit(0, q[:1], lens1, table[:1], scale=0.1)
    out = sender.wait(ticket, timeout_s=30)
    expected = paged_decode_attention_reference(q[:1], ref_pools[0], lens1, table[:1], 0.1)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    num_tasks = 2 * shape.num_layers + 1
    assert sender.stats.num_completed == num_tasks
    sender.close()
    proc.stdin.write("close\n")
    proc.stdin.flush()
    assert proc.stdout.readline().strip() == f"CLOSED served={num_tasks}"
    assert proc.wait(timeout=30) == 0
    assert not any(os.path.exists(p) for p in region_paths(name))
