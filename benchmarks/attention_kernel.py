"""The offload attention kernel alone (csrc/paged_attention.cuh), against the GPU's copy speed.

For each task shape (sequences x context, Llama-3-8B's heads by default, bf16, paged KV
with scattered blocks) it times ``weaver_paged_attention`` at each grid size (one block
per work item, one per SM, ...) with CUDA events, median of --repeats, checks the output
against the torch oracle (weaver/offload/reference_attention.py), and times a
device-to-device copy of the same K/V bytes: the kernel reads each K/V byte once, so
its bandwidth over the copy's read bandwidth says how far it is from the memory's limit.

    python3 benchmarks/attention_kernel.py --out $OUT/attention.json

The kernel sources come from $WEAVER_CSRC_DIR when set (default: csrc/), so a variant
of the kernel (say, another kTokensPerIter) is timed by pointing it at an edited copy;
--label names the variant in the output. Needs a CUDA GPU and CuPy (no vLLM).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.offload_wait import median_cuda_s  # noqa: E402

# Llama-3-8B's attention: 32 query heads over 8 KV heads of 128
NUM_Q_HEADS, NUM_KV_HEADS, HEAD_SIZE = 32, 8, 128
TOLERANCE = 1e-2  # bf16 relative error, as tests/gpu/test_attention_gpu.py allows
LAUNCHES_PER_SAMPLE = 10


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--seqs", type=int, nargs="+", default=[16, 64],
                        help="sequences per task")  # fmt: skip
    parser.add_argument("--context", type=int, nargs="+", default=[768, 4096],
                        help="tokens per sequence (every sequence this long)")  # fmt: skip
    parser.add_argument("--grids", nargs="+", default=["items", "sms"],
                        help="grid sizes: 'items' (one block per work item), 'sms' (one "
                             "per SM, the polling kernel's), '2sms', or a number")  # fmt: skip
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument("--kv-format", choices=["pages", "token"], default="pages")
    parser.add_argument("--block-order", choices=["scattered", "contiguous"],
                        default="scattered",
                        help="a sequence's blocks shuffled over the pool (as an "
                             "allocator hands them out) or in order")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=30,
                        help=f"timed samples per point ({LAUNCHES_PER_SAMPLE} launches "
                             "each)")  # fmt: skip
    parser.add_argument("--label", default="csrc", help="name of the kernel variant timed")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    return parser.parse_args(argv)


def grid_size(spec: str, num_items: int, num_sms: int) -> int:
    if spec == "items":
        return num_items
    factor = spec.removesuffix("sms")
    if spec.endswith("sms") and (factor == "" or factor.isdigit() and int(factor) > 0):
        return int(factor or 1) * num_sms
    if spec.isdigit() and int(spec) > 0:
        return int(spec)
    raise ValueError(f"grid {spec!r}: use 'items', 'sms', '<k>sms' or a positive number")


def median_us(launch: Any, repeats: int) -> float:
    """Median microseconds per launch over `repeats` samples of LAUNCHES_PER_SAMPLE launches
    back to back between two CUDA events: with one launch per sample, the host's launch
    latency (tens of us through CuPy) would sit between the start event and the kernel."""
    return median_cuda_s(launch, num_iters=repeats, reps=LAUNCHES_PER_SAMPLE) * 1e6


def task(num_seqs: int, context: int, block_size: int, block_order: str,
         seed: int) -> tuple[Any, ...]:  # fmt: skip
    """q, pool, seq_lens and block table of one task on the GPU; random (never zeros)."""
    import torch

    gen = torch.Generator(device="cuda").manual_seed(seed)
    blocks_per_seq = -(-context // block_size)
    num_blocks = num_seqs * blocks_per_seq
    pool = torch.randn(num_blocks, NUM_KV_HEADS, block_size, 2 * HEAD_SIZE, device="cuda",
                       generator=gen, dtype=torch.bfloat16)  # fmt: skip
    q = torch.randn(num_seqs, NUM_Q_HEADS, HEAD_SIZE, device="cuda", generator=gen,
                    dtype=torch.bfloat16)  # fmt: skip
    if block_order == "scattered":
        table = torch.randperm(num_blocks, device="cuda", generator=gen).to(torch.int32)
    else:
        table = torch.arange(num_blocks, device="cuda", dtype=torch.int32)
    seq_lens = torch.full((num_seqs,), context, dtype=torch.int32, device="cuda")
    return q, pool, seq_lens, table.view(num_seqs, blocks_per_seq)


def time_point(library: Any, args: argparse.Namespace, num_seqs: int, context: int,
               num_sms: int) -> dict[str, Any]:  # fmt: skip
    """One task shape: the copy of its K/V, then the kernel at each grid size."""
    import torch

    from weaver.offload.cuda import kernels
    from weaver.offload.reference_attention import (
        key_layout_of,
        paged_decode_attention_reference,
    )

    q, pool, seq_lens, table = task(num_seqs, context, args.block_size, args.block_order,
                                    args.seed)  # fmt: skip
    scale = HEAD_SIZE**-0.5
    kv_bytes = num_seqs * context * NUM_KV_HEADS * HEAD_SIZE * 2 * q.element_size()
    num_items = kernels.attention_items(num_seqs, NUM_Q_HEADS, NUM_KV_HEADS)
    expected = paged_decode_attention_reference(
        q, pool, seq_lens, table, scale, key_layout=key_layout_of(args.kv_format)
    ).float()
    copy_dst = torch.empty_like(pool)
    copy_us = median_us(lambda: copy_dst.copy_(pool), args.repeats)
    copy_read_gb_per_s = pool.nbytes / copy_us / 1e3  # a copy reads and writes each byte
    point: dict[str, Any] = {
        "seqs": num_seqs, "context": context, "items": num_items, "kv_bytes": kv_bytes,
        "copy_us": copy_us, "copy_read_gb_per_s": copy_read_gb_per_s, "grids": {},
    }  # fmt: skip
    for spec in args.grids:
        blocks = min(grid_size(spec, num_items, num_sms), num_items)
        out = torch.full_like(q, float("nan"))  # poison: every element must be written
        attend = functools.partial(
            kernels.paged_decode_attention, library, q, pool, seq_lens, table, scale,
            out=out, num_blocks=blocks, kv_format=args.kv_format)  # fmt: skip
        took_us = median_us(attend, args.repeats)
        rel = float((out.float() - expected).norm() / expected.norm())
        gb_per_s = kv_bytes / took_us / 1e3
        point["grids"][spec] = {
            "blocks": blocks, "median_us": took_us, "gb_per_s": gb_per_s,
            "of_copy_read": gb_per_s / copy_read_gb_per_s,
            "relative_error": rel, "correct": rel < TOLERANCE,
        }  # fmt: skip
        print(f"{args.label:>10} seqs {num_seqs:4d} ctx {context:6d} grid {spec:>6} "
              f"({blocks:5d} blocks): {took_us:9.1f} us {gb_per_s:7.0f} GB/s "
              f"(copy reads {copy_read_gb_per_s:5.0f} GB/s)  rel.err {rel:.1e}",
              flush=True)  # fmt: skip
    return point


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from weaver.offload.cuda.jit import KernelLibrary

    torch.cuda.set_device(0)
    props = torch.cuda.get_device_properties(0)
    library = KernelLibrary(0)
    points = [
        time_point(library, args, num_seqs, context, props.multi_processor_count)
        for num_seqs in args.seqs
        for context in args.context
    ]
    wrong = [
        (p["seqs"], p["context"], spec)
        for p in points
        for spec, g in p["grids"].items()
        if not g["correct"]
    ]
    best = max(g["of_copy_read"] for p in points for g in p["grids"].values())
    if wrong:
        verdict = f"WRONG output at {wrong}"
    else:
        verdict = f"correct everywhere; best point at {best:.0%} of the copy's read bandwidth"
    return {
        "verdict": verdict, "label": args.label, "gpu": props.name,
        "sms": props.multi_processor_count, "torch": torch.__version__,
        "dtype": "bfloat16", "heads": [NUM_Q_HEADS, NUM_KV_HEADS, HEAD_SIZE],
        "block_size": args.block_size, "kv_format": args.kv_format,
        "block_order": args.block_order,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "points": points,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import cupy  # noqa: F401
        import torch
    except ImportError as exc:
        print(f"needs torch and CuPy with a CUDA GPU: {exc}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("no CUDA device: this benchmark runs on a GPU machine "
              "(benchmarks/GPU_RUNBOOK.md)", file=sys.stderr)  # fmt: skip
        return 2
    result = measure(args)
    print(result["verdict"])
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if not result["verdict"].startswith("WRONG") else 1


if __name__ == "__main__":
    sys.exit(main())
