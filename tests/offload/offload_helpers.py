"""Shared helpers for the offload tests (not a test module)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict

import torch

from weaver.offload.layout import RegionLayout
from weaver.offload.protocol import OffloadTask
from weaver.offload.reference_attention import paged_decode_attention_reference

COLD_WORKER = os.path.join(os.path.dirname(__file__), "cold_worker.py")


def reference_executor(task: OffloadTask) -> None:
    out = paged_decode_attention_reference(
        task.q, task.kv_layer, task.seq_lens, task.block_table, task.scale, key_layout="nd"
    )
    task.out.copy_(out)


def random_batch(
    layout: RegionLayout, num_seqs: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged seq_lens (1 and a full multi-block row included) and random block rows."""
    max_len = layout.max_tokens_per_seq
    lens = torch.randint(1, max_len + 1, (num_seqs,), generator=gen, dtype=torch.int32)
    lens[0] = 1
    if num_seqs > 1:
        lens[1] = max_len
    rows = [
        torch.randperm(layout.num_remote_blocks, generator=gen)[: layout.max_blocks_per_seq]
        for _ in range(num_seqs)
    ]
    return lens, torch.stack(rows).to(torch.int32)


def spawn_cold_worker(
    name: str, layout: RegionLayout, *, executor: str, poller: bool
) -> subprocess.Popen:
    """Start the cold process without waiting for it (its imports overlap ours)."""
    spec = {
        "name": name,
        "shm_dir": "/dev/shm",
        "executor": executor,
        "poller": poller,
        "layout": {
            "shape": asdict(layout.shape),
            "num_remote_blocks": layout.num_remote_blocks,
            "max_seqs_per_task": layout.max_seqs_per_task,
            "max_blocks_per_seq": layout.max_blocks_per_seq,
        },
    }
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.Popen(
        [sys.executable, COLD_WORKER, json.dumps(spec)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )


def wait_cold_worker_ready(proc: subprocess.Popen) -> None:
    line = proc.stdout.readline()
    if line.strip() != "READY":
        proc.kill()
        raise RuntimeError(f"cold worker failed to start: {line!r}")


def start_cold_worker(
    name: str, layout: RegionLayout, *, executor: str, poller: bool
) -> subprocess.Popen:
    proc = spawn_cold_worker(name, layout, executor=executor, poller=poller)
    wait_cold_worker_ready(proc)
    return proc


def stop_cold_worker(proc: subprocess.Popen) -> None:
    """Kill (if still running) and reap a cold worker this test started."""
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    proc.stdout.close()
    proc.stdin.close()
