"""Decode attention over head-wise pool pages vs vLLM's own cache layout, side by side.

The unified KV pool stores each (block, layer, KV head) in a page of its own
anywhere in the pool; `weaver.vllm_ext.attention.headwise` runs vLLM's CPU_ATTN kernel over
it by making every (sequence, KV head) a sequence of its own. This script times one decode
step's attention, all layers, both ways on the same numbers, in alternating rounds on one
core (as a CPU engine runs it), and prints the per-layer medians and their ratio. The
outputs are checked bitwise equal before timing.

    python benchmarks/headwise_attention.py                       # SmolLM2-135M shape
    python benchmarks/headwise_attention.py --seqs 32 --context 400 --in-order
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--layers", type=int, default=30, help="layers (default: 30)")
    parser.add_argument("--q-heads", type=int, default=9, help="query heads (default: 9)")
    parser.add_argument("--kv-heads", type=int, default=3, help="KV heads (default: 3)")
    parser.add_argument("--head-size", type=int, default=64, help="head size (default: 64)")
    parser.add_argument("--block-size", type=int, default=32,
                        help="tokens per block, a multiple of 32 (default: 32)")
    parser.add_argument("--seqs", type=int, default=16, help="decoding sequences (default: 16)")
    parser.add_argument("--context", type=int, default=160,
                        help="context tokens per sequence (default: 160)")
    parser.add_argument("--rounds", type=int, default=15,
                        help="alternating timed rounds (default: 15)")
    parser.add_argument("--in-order", action="store_true",
                        help="give the pages in order instead of scattered through the pool")
    args = parser.parse_args(argv)
    for name in ("layers", "q_heads", "kv_heads", "head_size", "block_size", "seqs", "context",
                 "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from weaver.vllm_ext.attention.cpu_kernels import key_value_caches
    from weaver.vllm_ext.attention.headwise import HeadwiseBatch, HeadwiseGeometry, page_view

    torch.set_num_threads(1)  # a CPU engine runs its kernels on one pinned core
    try:
        geo = HeadwiseGeometry(args.q_heads, args.kv_heads, args.head_size, args.block_size,
                               torch.float32)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    num_layers, num_heads, block_size = args.layers, args.kv_heads, args.block_size
    isa = _get_attn_isa(geo.dtype, block_size, args.head_size, "auto")
    blocks_per_seq = -(-args.context // block_size)
    num_blocks = args.seqs * blocks_per_seq
    gen = torch.Generator().manual_seed(0)
    own = [torch.randn(num_blocks, num_heads, block_size, 2 * args.head_size, generator=gen)
           for _ in range(num_layers)]
    num_pages = num_blocks * num_layers * num_heads
    pool = torch.zeros(num_pages * geo.page_bytes, dtype=torch.uint8)
    pages = page_view(pool, geo)
    order = torch.arange(num_pages) if args.in_order else torch.randperm(num_pages, generator=gen)
    page_table = order.view(num_blocks, num_layers * num_heads).to(torch.int32)
    per_layer = page_table.view(num_blocks, num_layers, num_heads).long()
    for layer in range(num_layers):
        pages[per_layer[:, layer, :].flatten(), 0] = own[layer].flatten(0, 1)
    block_table = torch.arange(num_blocks, dtype=torch.int32).view(args.seqs, blocks_per_seq)
    seq_lens = torch.full((args.seqs,), args.context, dtype=torch.int32)
    query_start_loc = torch.arange(args.seqs + 1, dtype=torch.int32)
    query = torch.randn(args.seqs, args.q_heads, args.head_size, generator=gen)
    scale = args.head_size ** -0.5

    def vllm_layout() -> list[torch.Tensor]:
        metadata = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=args.seqs, num_heads=args.q_heads, num_kv_heads=num_heads,
            head_dim=args.head_size, seq_lens=seq_lens, dtype=geo.dtype,
            query_start_loc=query_start_loc, causal=True, sliding_window_size=-1, isa=isa,
            enable_kv_split=True)
        outs = []
        for layer in range(num_layers):
            key_cache, value_cache = key_value_caches(own[layer])
            out = torch.empty_like(query)
            ops.cpu_attention_with_kv_cache(
                query=query, key_cache=key_cache, value_cache=value_cache, output=out,
                query_start_loc=query_start_loc, seq_lens=seq_lens, scale=scale, causal=True,
                alibi_slopes=None, sliding_window=-1, block_table=block_table, softcap=0.0,
                scheduler_metadata=metadata, s_aux=None)
            outs.append(out)
        return outs

    def headwise() -> list[torch.Tensor]:
        batch = HeadwiseBatch(geo, num_layers, page_table, query_start_loc, seq_lens,
                              block_table, isa=isa, enable_kv_split=True)
        outs = []
        for layer in range(num_layers):
            out = torch.empty_like(query)
            batch.attention(pages, layer, query, out, scale=scale)
            outs.append(out)
        return outs

    if not all(torch.equal(a, b) for a, b in zip(vllm_layout(), headwise(), strict=True)):
        print("error: head-wise attention differs from vLLM's layout", file=sys.stderr)
        return 1
    times: dict[str, list[float]] = {"vllm_layout": [], "headwise": []}
    for _ in range(args.rounds):
        for name, step in (("vllm_layout", vllm_layout), ("headwise", headwise)):
            start = time.perf_counter()
            step()
            times[name].append((time.perf_counter() - start) / num_layers)
    medians = {name: statistics.median(values) for name, values in times.items()}
    print(f"{args.seqs} sequences x {args.context} tokens, {num_layers} layers, "
          f"{args.q_heads}/{num_heads} heads of {args.head_size}, block {block_size}, pages "
          f"{'in order' if args.in_order else 'scattered'}; bitwise equal outputs")
    for name, value in medians.items():
        print(f"  {name:<12} {value * 1e6:8.1f} us per layer (median of {args.rounds})")
    print(f"  headwise / vllm_layout = {medians['headwise'] / medians['vllm_layout']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
