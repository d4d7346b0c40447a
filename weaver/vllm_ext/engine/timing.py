"""Time vLLM's own engine and CPU attention kernel on given cores (`weaver profile --engine`).

The engine is `vllm.LLM` built as a deployment's engine is (float32, enforce_eager, the
deployment's block size, the API server's 2048-token step budget), with its engine core
in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so that `LLMEngine.step()` is one
scheduler + model step, timed from here; the process and vLLM's OpenMP threads (one per
core) are pinned to the cores given, as `cpu_cores` pins a deployment's engine. Decode
attention alone is timed as the cold side serves offloaded tasks: through a real region,
with the executor it runs (`attention.cpu_kernels.CpuPagedAttentionExecutor`) and the K/V
read from memory (`weaver.profiling.task_timing`), i.e. the remote attention of weaving.
What to time and how timings become a profile is pure Python in
`weaver.profiling.engine_profile`.
"""

from __future__ import annotations

import logging
import os
import platform
import random
import statistics
import time
from pathlib import Path

from weaver.config.cpu_cores import parse_cpu_cores
from weaver.profiling.engine_profile import DecodePoint, EngineGrid, EngineTimings, attention_batch
from weaver.profiling.timer import copy_bandwidth
from weaver.sim.profile import ModelShape

logger = logging.getLogger(__name__)

KV_CACHE_BYTES = 512 << 20  # holds every decode point of the default grid
SERVER_MAX_NUM_BATCHED_TOKENS = 2048  # vLLM's CPU default for an API server


def pin_to_cores(cpu_cores: str) -> int:
    """Pin this process and vLLM's OpenMP threads to `cpu_cores` (a deployment's syntax:
    '0', '0-1'), as a deployment's engine is; set before vLLM is imported. Returns the
    number of cores, which is the number of compute threads vLLM starts."""
    cores = parse_cpu_cores(cpu_cores)
    if not cores:
        raise ValueError(f"cpu cores {cpu_cores!r}: name the cores to time on, e.g. '0'")
    os.sched_setaffinity(0, cores)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_cores
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return len(cores)


def time_engine(model_dir: Path, shape: ModelShape, grid: EngineGrid, cpu_cores: str,
                progress: bool = True) -> EngineTimings:
    num_threads = pin_to_cores(cpu_cores)
    import torch
    import vllm
    from tqdm import tqdm
    from vllm import LLM

    torch.set_num_threads(num_threads)
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
        source=f"measured on {platform.processor() or platform.machine()} CPU, cores "
               f"{cpu_cores} only ({num_threads} threads), vLLM {vllm.__version__} engine "
               f"steps (LLM offline, in-process engine core, enforce_eager, float32, "
               f"block_size {grid.block_size}, max_num_batched_tokens "
               f"{SERVER_MAX_NUM_BATCHED_TOKENS}), torch "
               f"{torch.__version__}; attention: offloaded tasks through a shared-memory "
               f"region, vLLM CPU_ATTN kernel via weaver.vllm_ext.attention.cpu_kernels "
               f"(ISA {isa}), cache flushed before each task",
        notes={"dtype": "float32", "model_dir": str(model_dir),
               "prefill": "one engine step of one prompt of n tokens (min of repeats): "
                          "scheduler, forward, sampling",
               "decode": "median of timed engine steps of b sequences decoding together",
               "attention": attention_note(grid, isa),
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


def attention_note(grid: EngineGrid, isa: str) -> str:
    """How `time_attention` timed the table (the profile's notes.attention)."""
    return ("one offloaded task per layer through a real shared-memory region "
            f"(OffloadReceiver.poll with the vLLM CPU_ATTN executor, ISA {isa}), each layer's "
            "own pool, the last-level cache flushed before every task; sum over the layers, "
            f"min of repeats; sequences of ~{grid.attention_seq_tokens} tokens")


def retime_attention(shape: ModelShape, grid: EngineGrid,
                     cpu_cores: str) -> tuple[list[float], str]:
    """`time_attention` alone, pinned to `cpu_cores` as `time_engine` is."""
    num_threads = pin_to_cores(cpu_cores)
    import torch

    torch.set_num_threads(num_threads)
    return time_attention(shape, grid)


def time_attention(shape: ModelShape, grid: EngineGrid,
                   num_repeats: int = 5) -> tuple[list[float], str]:
    """All-layer decode attention at each total context, as the cold side serves it:
    one offloaded task per layer through a real region, with the cold side's executor
    and the K/V read from memory (`weaver.profiling.task_timing`)."""
    from weaver.offload.layout import HotAttentionShape
    from weaver.profiling.task_timing import time_offloaded_attention
    from weaver.vllm_ext.attention.cpu_kernels import CpuPagedAttentionExecutor

    hot = HotAttentionShape(num_layers=shape.num_layers, num_q_heads=shape.num_heads,
                            num_kv_heads=shape.num_kv_heads, head_size=shape.head_size,
                            block_size=grid.block_size, dtype="float32")
    executor = CpuPagedAttentionExecutor(hot)
    batches = [attention_batch(total, grid.attention_seq_tokens)
               for total in grid.attention_context_tokens]
    timings = time_offloaded_attention(hot, batches, executor, num_repeats=num_repeats)
    return [t.all_layers_s for t in timings], executor.isa
