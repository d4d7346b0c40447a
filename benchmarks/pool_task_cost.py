"""What a woven hot step's attention tasks cost the cold model's core when the hot model's
remote KV lives in a pool of pages (a loan pool, or the cold's unified pool).

A hot step sends one task per layer, all over the same sequences. The cold side's pool
executor (weaver/vllm_ext/attention/pool.py) serves them two ways here, in alternating
rounds, on one core:

- **kept**: as it does now, the step's batch (every layer's page tables, vLLM's scheduler
  metadata) built at the first layer's task and kept for the others (`StepBatches`), the
  pages' K/V views kept for good;
- **rebuilt**: as it did before 2026-11-30, the batch and the views built again for every
  task.

Each task goes through a real region and channel (`OffloadSender.submit`, then
`OffloadReceiver.poll`, as a poll point serves it; weaver/profiling/task_timing.py), with a
buffer larger than the last-level cache streamed before it, as the cold model's own
operators stream its weights between two tasks in serving. The K/V are read from an
in-memory pool of scattered pages (the region's own KV section is not used). A step's time is
the least over a few repeats of its tasks' sum; the outputs of the two ways are checked
bitwise equal first. Writes JSON that opens with the verdict.

    python benchmarks/pool_task_cost.py --out benchmarks/results/pool_task_cost.json
    python benchmarks/pool_task_cost.py --batches 150 100,200,300 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--layers", type=int, default=30, help="hot layers (default: 30, "
                        "SmolLM2-135M's; its 9/3 heads of 64 are the defaults below)")
    parser.add_argument("--q-heads", type=int, default=9, help="query heads (default: 9)")
    parser.add_argument("--kv-heads", type=int, default=3, help="KV heads (default: 3)")
    parser.add_argument("--head-size", type=int, default=64, help="head size (default: 64)")
    parser.add_argument("--block-size", type=int, default=32,
                        help="tokens per block, a multiple of 32 (default: 32)")
    parser.add_argument("--batches", nargs="+", default=["150", "100,200", "100,150,200,250"],
                        metavar="LENS", help="the remote sequences of a hot step, their "
                        "context lengths comma-separated; one or more steps (default: "
                        "%(default)s)")
    parser.add_argument("--rounds", type=int, default=5,
                        help="alternating rounds of both ways (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed repeats of a step in a round, the least kept "
                        "(default: %(default)s)")
    parser.add_argument("--flush-mib", type=int, default=128,
                        help="MiB streamed before every task (default: %(default)s, more "
                        "than the benchmark machine's 32 MiB L3; 0: none)")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)
    for name in ("layers", "q_heads", "kv_heads", "head_size", "block_size", "rounds",
                 "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.flush_mib < 0:
        parser.error("--flush-mib must be >= 0")
    try:
        args.batches = [[int(n) for n in spec.split(",")] for spec in args.batches]
    except ValueError:
        parser.error(f"--batches takes comma-separated lengths, got {args.batches}")
    if any(n < 1 for lens in args.batches for n in lens):
        parser.error("every context length must be >= 1")
    return args


class ScatteredPool:
    """A pool of pages holding random K/V for `num_blocks` blocks of the hot shape, each
    head-block's page anywhere in it (as the loan pool's allocator scatters them)."""

    def __init__(self, geometry, num_layers: int, num_blocks: int) -> None:
        from weaver.vllm_ext.attention.cpu_kernels import key_value_caches
        from weaver.vllm_ext.attention.headwise import page_view

        gen = torch.Generator().manual_seed(0)
        num_pages = num_blocks * num_layers * geometry.num_kv_heads
        self.pages = page_view(torch.zeros(num_pages * geometry.page_bytes, dtype=torch.uint8),
                               geometry)
        self.pages.copy_(torch.randn(self.pages.shape, generator=gen))
        self.page_table = torch.randperm(num_pages, generator=gen).to(torch.int32).view(
            num_blocks, num_layers * geometry.num_kv_heads)
        self.caches = key_value_caches(self.pages)


class BatchPerTask:
    """The pool executor before 2026-11-30: every task checked its blocks' pages, then built
    the step's batch and the pages' K/V views for its one layer."""

    def __init__(self, pool: ScatteredPool, geometry, num_layers: int, isa: str,
                 max_seqs: int) -> None:
        self.pool, self.geometry, self.num_layers, self.isa = pool, geometry, num_layers, isa
        self.query_start_loc = torch.arange(max_seqs + 1, dtype=torch.int32)

    def __call__(self, task) -> None:
        from weaver.vllm_ext.attention.headwise import HeadwiseBatch

        block_size = self.geometry.block_size
        num_used = (task.seq_lens.to(torch.int64) + block_size - 1) // block_size
        used = task.block_table[torch.arange(task.block_table.shape[1])[None, :]
                                < num_used[:, None]].to(torch.int64)
        if bool((self.pool.page_table[used, 0] < 0).any()):
            raise ValueError("a task names blocks without pages")
        num_seqs = task.q.shape[0]
        batch = HeadwiseBatch(self.geometry, self.num_layers, self.pool.page_table,
                              self.query_start_loc[: num_seqs + 1], task.seq_lens,
                              task.block_table, sliding_window=task.sliding_window,
                              isa=self.isa)
        batch.attention(self.pool.pages, task.layer, task.q, task.out, scale=task.scale,
                        softcap=task.softcap)


class BatchPerStep:
    """The pool executor now (PoolTaskExecutor's call): its StepBatches and kept K/V views.
    Its batch is forgotten at each step's first layer, so every timed step builds one, as a
    served step whose sequences grew by a token does."""

    def __init__(self, pool: ScatteredPool, geometry, num_layers: int, isa: str,
                 max_seqs: int) -> None:
        self.pool, self.geometry, self.num_layers, self.isa = pool, geometry, num_layers, isa
        self.max_seqs = max_seqs
        self.batches = None

    def __call__(self, task) -> None:
        from weaver.vllm_ext.attention.pool import StepBatches

        if task.layer == 0 or self.batches is None:
            self.batches = StepBatches(self.geometry, self.num_layers, self.pool.page_table,
                                       self.max_seqs, "hot", self.isa)
        batch = self.batches.for_task(task.seq_lens, task.block_table, task.sliding_window)
        batch.attention_over(self.pool.caches, task.layer, task.q, task.out,
                             scale=task.scale, softcap=task.softcap)


def outputs_of(executor, shape, lens: list[int]) -> list[torch.Tensor]:
    """Each layer's output for one step of `lens`, served by `executor` directly."""
    from weaver.offload.protocol import OffloadTask

    block_size = shape.block_size
    blocks = [-(-n // block_size) for n in lens]
    table = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
    first = 0
    for i, n in enumerate(blocks):  # the blocks task_timing gives the step's sequences
        table[i, :n] = torch.arange(first, first + n, dtype=torch.int32)
        first += n
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(len(lens), shape.num_q_heads, shape.head_size, generator=gen)
    outs = []
    for layer in range(shape.num_layers):
        out = torch.full_like(q, float("nan"))
        executor(OffloadTask(seq=layer + 1, layer=layer, q=q, out=out,
                             seq_lens=torch.tensor(lens, dtype=torch.int32), block_table=table,
                             kv_layer=torch.empty(0), scale=shape.head_size ** -0.5,
                             sliding_window=-1, softcap=0.0))
        outs.append(out)
    return outs


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from weaver.offload.layout import HotAttentionShape
    from weaver.profiling.task_timing import time_offloaded_attention
    from weaver.vllm_ext.attention.cpu_kernels import select_cpu_attn_isa
    from weaver.vllm_ext.attention.headwise import HeadwiseGeometry

    torch.set_num_threads(1)  # a CPU engine runs its kernels on one pinned core
    try:
        shape = HotAttentionShape(num_layers=args.layers, num_q_heads=args.q_heads,
                                  num_kv_heads=args.kv_heads, head_size=args.head_size,
                                  block_size=args.block_size, dtype="float32")
        geometry = HeadwiseGeometry(args.q_heads, args.kv_heads, args.head_size,
                                    args.block_size, torch.float32)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    isa = select_cpu_attn_isa(torch.float32, args.block_size, args.head_size)
    num_blocks = max(sum(-(-n // args.block_size) for n in lens) for lens in args.batches)
    pool = ScatteredPool(geometry, args.layers, num_blocks)
    max_seqs = max(len(lens) for lens in args.batches)
    ways = {"rebuilt": BatchPerTask(pool, geometry, args.layers, isa, max_seqs),
            "kept": BatchPerStep(pool, geometry, args.layers, isa, max_seqs)}
    for lens in args.batches:
        rebuilt, kept = (outputs_of(ways[name], shape, lens) for name in ("rebuilt", "kept"))
        if not all(torch.equal(a, b) for a, b in zip(rebuilt, kept, strict=True)):
            print(f"error: the two ways' outputs differ for {lens}", file=sys.stderr)
            return 1
    step_s: dict[str, list[list[float]]] = {name: [] for name in ways}  # [round][batch]
    for round_index in range(args.rounds):
        order = list(ways) if round_index % 2 == 0 else list(reversed(ways))
        for name in order:
            timings = time_offloaded_attention(shape, args.batches, ways[name],
                                               num_repeats=args.repeats,
                                               flush_bytes=args.flush_mib << 20)
            step_s[name].append([timing.all_layers_s for timing in timings])
        print(f"round {round_index + 1}/{args.rounds}: " + ", ".join(
            f"{lens}: kept {1e3 * step_s['kept'][-1][i]:.2f} ms, rebuilt "
            f"{1e3 * step_s['rebuilt'][-1][i]:.2f} ms" for i, lens in
            enumerate(args.batches)), flush=True)
    rows = []
    for i, lens in enumerate(args.batches):
        kept = [rounds[i] for rounds in step_s["kept"]]
        rebuilt = [rounds[i] for rounds in step_s["rebuilt"]]
        ratios = [k / r for k, r in zip(kept, rebuilt, strict=True)]
        rows.append({"seq_lens": lens, "kept_step_ms": [1e3 * s for s in kept],
                     "rebuilt_step_ms": [1e3 * s for s in rebuilt],
                     "kept_over_rebuilt": ratios,
                     "kept_over_rebuilt_median": statistics.median(ratios)})
    all_ratios = [ratio for row in rows for ratio in row["kept_over_rebuilt"]]
    first = rows[0]
    verdict = (f"a woven hot step's {args.layers} tasks cost the cold's core "
               f"x{statistics.median(all_ratios):.2f} of what they did with the batch "
               f"rebuilt for every task (x{min(all_ratios):.2f}-{max(all_ratios):.2f} over "
               f"{args.rounds} rounds and {len(rows)} steps); at {first['seq_lens']}: "
               f"{statistics.median(first['kept_step_ms']):.1f} ms against "
               f"{statistics.median(first['rebuilt_step_ms']):.1f} ms")
    print(verdict)
    if args.out is not None:
        report = {"verdict": verdict, "command": " ".join(sys.argv),
                  "shape": {"layers": args.layers, "q_heads": args.q_heads,
                            "kv_heads": args.kv_heads, "head_size": args.head_size,
                            "block_size": args.block_size, "dtype": "float32"},
                  "flush_mib": args.flush_mib, "rounds": args.rounds,
                  "repeats": args.repeats, "steps": rows}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
