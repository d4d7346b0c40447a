"""Hot side of the GPU owner-death test (not a test module): run in its own process
because a read of freed peer memory could leave a sticky CUDA error in the process that
made it, which would break every later test of a pytest run.

Usage: python gpu_owner_death.py '<json>' with the cold worker's spec (gpu_cold_worker.py).
Starts that cold worker, attaches its region through CUDA IPC, does one round trip,
writes a second task's K/V into the remote pool and computes its expected output from a
copy of the pool, then kills the cold worker with SIGKILL and, with the owner gone:
reads the remote pool back through the mapping, publishes the task, waits on the device
with a short timeout and enqueues the hot side's fallback attention (weaving/hot.py's
path when a cold engine dies). Prints one JSON line: "RESULT {...}".
"""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

from weaver.offload.cuda.jit import KernelLibrary
from weaver.offload.cuda.pool import write_kv
from weaver.offload.cuda.transport import CudaRegion
from weaver.offload.layout import HotAttentionShape, RegionLayout
from weaver.offload.reference_attention import paged_decode_attention_reference
from weaver.offload.sender import OffloadSender
from weaver.processes import shm_files_of_processes, unlink_left_over


def _layout(spec: dict) -> RegionLayout:
    lay = spec["layout"]
    return RegionLayout(HotAttentionShape(**lay["shape"]),
                        num_remote_blocks=lay["num_remote_blocks"],
                        max_seqs_per_task=lay["max_seqs_per_task"],
                        max_blocks_per_seq=lay["max_blocks_per_seq"])  # fmt: skip


def _task(sender: OffloadSender, layout: RegionLayout, seed: int):
    """Random K/V of two full-length sequences written into layer 0 of the remote pool."""
    s = layout.shape
    gen = torch.Generator().manual_seed(seed)
    num_seqs, max_blocks = 2, layout.max_blocks_per_seq
    seq_lens = torch.full((num_seqs,), max_blocks * s.block_size, dtype=torch.int32)
    blocks = torch.randperm(layout.num_remote_blocks, generator=gen)[: num_seqs * max_blocks]
    table = blocks.view(num_seqs, max_blocks).to(torch.int32)
    slots = (table.long().flatten()[:, None] * s.block_size + torch.arange(s.block_size)).flatten()
    key = torch.randn(slots.numel(), s.num_kv_heads, s.head_size, generator=gen)
    value = torch.randn(slots.numel(), s.num_kv_heads, s.head_size, generator=gen)
    write_kv(sender.kv_layer(0), key.cuda(), value.cuda(), slots.cuda())
    q = torch.randn(num_seqs, s.num_q_heads, s.head_size, generator=gen).to(torch.bfloat16)
    return q.cuda(), seq_lens.cuda(), table.cuda()


def _rel(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.float().cpu() - expected).norm() / expected.norm())


def main() -> int:
    spec = json.loads(sys.argv[1])
    layout = _layout(spec)
    scale = layout.shape.head_size**-0.5
    worker = Path(__file__).with_name("gpu_cold_worker.py")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen(
        [sys.executable, str(worker), json.dumps(spec)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    result: dict = {}
    mapped: set[str] = set()
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        if not line.startswith("HANDLE "):
            raise RuntimeError(f"cold worker said {line!r}")
        # what the killed worker leaves (torch's CUDA IPC reference-count file, the
        # driver's cuda.shm.*), unlinked below once this side let go
        mapped = shm_files_of_processes([proc.pid])
        region = CudaRegion.attach(layout, spec["name"], bytes.fromhex(line.split()[1]),
                                   KernelLibrary(0))
        sender = OffloadSender(region)
        q, lens, table = _task(sender, layout, seed=1)
        ticket = sender.submit(0, q, lens, table, scale=scale)
        sender.wait(ticket, timeout_s=5.0)
        sender.settle(ticket)  # the live cold side served it
        q, lens, table = _task(sender, layout, seed=2)
        pool_before = sender.kv_layer(0).cpu()
        expected = paged_decode_attention_reference(q.cpu(), pool_before, lens.cpu(), table.cpu(),
                                                    scale, key_layout="nd").float()  # fmt: skip
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        result["cold_exit_code"] = proc.returncode
        try:
            pool_after = sender.kv_layer(0).cpu()
            result["pool_readable_after_death"] = bool(torch.equal(pool_after, pool_before))
            ticket = sender.submit(0, q, lens, table, scale=scale)
            timing = sender.wait_with_timing(ticket, timeout_s=0.2)
            out = sender.enqueue_fallback(ticket).clone()
            result["num_device_fallbacks"] = sender.take_num_device_fallbacks()
            result["wait_status"] = region.wait_status()[0].name
            result["fallback_rel_error"] = _rel(out, expected)
            result["wait_status_before_settle"] = timing.status.name
        except Exception as exc:  # what the driver does with a dead exporter's memory
            result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        sender = region = None  # let go of the dead owner's memory and files
        gc.collect()
        torch.cuda.synchronize()
        unlink_left_over(mapped)
    print("RESULT", json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
