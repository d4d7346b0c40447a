"""Time vLLM's own engine and CPU attention kernel on one core (`weaver profile --engine`).

The engine is `vllm.LLM` built as a deployment's engine is (float32, enforce_eager, the
deployment's block size, the API server's 2048-token step budget), with its engine core
in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so that `LLMEngine.step()` is one
scheduler + model step, timed from here; the process and vLLM's OpenMP threads are pinned
to one core, as `cpu_cores` pins a deployment's engine. Decode attention alone is timed
with the executor the cold side runs for offloaded sequences
(`cpu_paged_attention.CpuPagedAttentionExecutor`), i.e. the remote attention of weaving.
What to time and how timings become a profile is pure Python in
`weaver.sim.engine_profile`.
"""

from __future__ import annotations

import logging
import os
import platform
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from weaver.sim.engine_profile import DecodePoint, EngineGrid, EngineTimings, attention_batch
from weaver.sim.profile import ModelShape

logger = logging.getLogger(__name__)

KV_CACHE_BYTES = 512 << 20  # holds every decode point of the default grid
SERVER_MAX_NUM_BATCHED_TOKENS = 2048  # vLLM's CPU default for an API server


def pin_to_core(core: int) -> None:
    """Pin this process and vLLM's OpenMP threads to `core`; set before vLLM is imported."""
    os.sched_setaffinity(0, {core})
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(core)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def time_engine(model_dir: Path, shape: ModelShape, grid: EngineGrid, core: int,
                progress: bool = True) -> EngineTimings:
    pin_to_core(core)
    import torch
    import vllm
    from tqdm import tqdm
    from vllm import LLM

    torch.set_num_threads(1)
    llm = LLM(model=str(model_dir), dtype="float32", enforce_eager=True,
              block_size=grid.block_size, max_model_len=grid.max_seq_len,
              max_num_seqs=max(grid.batch_sizes),
              max_num_batched_tokens=SERVER_MAX_NUM_BATCHED_TOKENS,
              enable_prefix_caching=False, kv_cache_memory_bytes=KV_CACHE_BYTES, seed=0)
    engine = llm.llm_engine
    rng = random.Random(0)
    runner = _Runner(engine, rng, shape.vocab_size)
    points = grid.decode_points()
    bar = tqdm(total=len(grid.prefill_tokens) + len(points) + 1, disable=not progress,
               desc="profile engine")
    runner.decode(1, 16, 2)  # warm-up: allocator, oneDNN kernels
    prefill_s = []
    for n in grid.prefill_tokens:
        prefill_s.append(min(runner.prefill(n) for _ in range(grid.num_repeats + 1)))
        bar.update()
    decode = []
    for b, c in points:
        decode.append(runner.decode(b, c, grid.num_decode_steps))
        bar.update()
    attention_s, isa = time_attention(shape, grid)
    bar.update()
    bar.close()
    del llm
    return EngineTimings(
        prefill_s=prefill_s, decode=decode, attention_s=attention_s,
        link_bandwidth_bps=copy_bandwidth(),
        source=f"measured on {platform.processor() or platform.machine()} CPU, core {core} "
               f"only, vLLM {vllm.__version__} engine steps (LLM offline, in-process engine "
               f"core, enforce_eager, float32, block_size {grid.block_size}, "
               f"max_num_batched_tokens {SERVER_MAX_NUM_BATCHED_TOKENS}), torch "
               f"{torch.__version__}; attention: vLLM CPU_ATTN kernel via "
               f"weaver.vllm_ext.cpu_paged_attention (ISA {isa})",
        notes={"dtype": "float32", "model_dir": str(model_dir),
               "prefill": "one engine step of one prompt of n tokens (min of repeats): "
                          "scheduler, forward, sampling",
               "decode": "median of timed engine steps of b sequences decoding together",
               "attention": "one layer's CPU_ATTN decode call (min of repeats) x num_layers, "
                            f"sequences of ~{grid.attention_seq_tokens} tokens",
               "link": "memcpy bandwidth of this host (the CPU transport is shared memory)"})


class _Runner:
    """Requests into the in-process engine, one engine step at a time."""

    def __init__(self, engine, rng: random.Random, vocab_size: int) -> None:
        self.engine = engine
        self.rng = rng
        self.vocab_size = vocab_size
        self.num_added = 0

    def _add(self, num_prompt: int, max_tokens: int) -> str:
        from vllm import SamplingParams

        request_id = f"profile-{self.num_added}"
        self.num_added += 1
        # Random ids: no two prompts share a prefix, so nothing is cached between points.
        ids = [self.rng.randrange(10, self.vocab_size - 10) for _ in range(num_prompt)]
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        self.engine.add_request(request_id, {"prompt_token_ids": ids}, params)
        return request_id

    def _timed_step(self) -> tuple[float, list]:
        start = time.perf_counter()
        outputs = self.engine.step()
        return time.perf_counter() - start, outputs

    def _drain(self) -> None:
        while self.engine.has_unfinished_requests():
            self.engine.step()

    def prefill(self, num_tokens: int) -> float:
        self._add(num_tokens, 1)
        seconds, _ = self._timed_step()  # the whole prompt fits one step's token budget
        self._drain()
        return seconds

    def decode(self, batch: int, per_seq: int, num_steps: int) -> DecodePoint:
        for _ in range(batch):
            self._add(per_seq, num_steps + 2)
        started: set[str] = set()
        while len(started) < batch:  # prefill every prompt (chunked if over the budget)
            _, outputs = self._timed_step()
            started |= {o.request_id for o in outputs if o.outputs and o.outputs[0].token_ids}
        times, contexts = [], []
        for step in range(num_steps):
            seconds, _ = self._timed_step()
            times.append(seconds)
            contexts.append(batch * (per_seq + 1 + step))  # tokens attended this step
        self._drain()
        return DecodePoint(batch, statistics.fmean(contexts), statistics.median(times))


def time_attention(shape: ModelShape, grid: EngineGrid,
                   num_repeats: int = 10) -> tuple[list[float], str]:
    """All-layer decode attention at each total context, with the cold side's executor."""
    import torch

    from weaver.offload.layout import HotAttentionShape
    from weaver.vllm_ext.cpu_paged_attention import CpuPagedAttentionExecutor

    hot = HotAttentionShape(num_layers=shape.num_layers, num_q_heads=shape.num_heads,
                            num_kv_heads=shape.num_kv_heads, head_size=shape.head_size,
                            block_size=grid.block_size, dtype="float32")
    executor = CpuPagedAttentionExecutor(hot)
    out = []
    for total in grid.attention_context_tokens:
        lens = attention_batch(total, grid.attention_seq_tokens)
        blocks = [-(-n // grid.block_size) for n in lens]
        kv_layer = torch.randn(sum(blocks), shape.num_kv_heads, grid.block_size,
                               2 * shape.head_size)
        table = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
        first = 0
        for i, n in enumerate(blocks):
            table[i, :n] = torch.arange(first, first + n, dtype=torch.int32)
            first += n
        q = torch.randn(len(lens), shape.num_heads, shape.head_size)
        result = torch.empty_like(q)
        seq_lens = torch.tensor(lens, dtype=torch.int32)

        def call(q=q, kv_layer=kv_layer, seq_lens=seq_lens, table=table, result=result):
            executor.run(q, kv_layer, seq_lens, table, result, scale=shape.head_size ** -0.5)

        out.append(_best_time(call, num_repeats) * shape.num_layers)
    return out, executor.isa


def _best_time(fn: Callable[[], object], num_repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(num_repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def copy_bandwidth(num_bytes: int = 64 << 20) -> float:
    import torch

    src = torch.empty(num_bytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    return num_bytes / _best_time(lambda: dst.copy_(src), 3)
