"""The CUDA transport end to end: publish -> poll kernel or armed server -> device wait, in
one process and across two processes on one device; waits time out or see a closed region,
never hang."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from weaver.offload.cuda.armed_server import ArmedServerConfig
from weaver.offload.cuda.pool import write_kv
from weaver.offload.cuda.transport import CudaPollingExecutor, CudaRegion
from weaver.offload.layout import STATUS_OFFSET, HotAttentionShape, RegionLayout, RegionStatus
from weaver.offload.protocol import (
    OffloadTaskFailed,
    OffloadTimeout,
    WaitPolicy,
    WaitStatus,
)
from weaver.offload.receiver import OffloadReceiver
from weaver.offload.reference_attention import paged_decode_attention_reference
from weaver.offload.sender import OffloadSender
from weaver.processes import shm_files_of_processes, unlink_left_over

pytestmark = pytest.mark.gpu

SHAPE = dict(
    num_layers=2, num_q_heads=8, num_kv_heads=2, head_size=64, block_size=16, dtype="bfloat16"
)
NUM_REMOTE_BLOCKS, MAX_SEQS, MAX_BLOCKS = 64, 6, 8


def _layout() -> RegionLayout:
    return RegionLayout(
        HotAttentionShape(**SHAPE),  # type: ignore[arg-type]
        num_remote_blocks=NUM_REMOTE_BLOCKS,
        max_seqs_per_task=MAX_SEQS,
        max_blocks_per_seq=MAX_BLOCKS,
    )


def _task(sender: OffloadSender, layer: int, seed: int):
    """Write random K/V of ragged sequences into the remote pool; return q, lens, table."""
    gen = torch.Generator().manual_seed(seed)
    num_seqs = int(torch.randint(1, MAX_SEQS + 1, (1,), generator=gen))
    seq_lens = torch.randint(1, MAX_BLOCKS * 16 + 1, (num_seqs,), generator=gen, dtype=torch.int32)
    blocks = torch.randperm(NUM_REMOTE_BLOCKS, generator=gen)[: num_seqs * MAX_BLOCKS]
    table = blocks.view(num_seqs, MAX_BLOCKS).to(torch.int32)
    slots = _used_slots(table, seq_lens)
    key = torch.randn(slots.numel(), 2, 64, generator=gen, dtype=torch.float32)
    value = torch.randn(slots.numel(), 2, 64, generator=gen, dtype=torch.float32)
    write_kv(sender.kv_layer(layer), key.cuda(), value.cuda(), slots.cuda())
    q = torch.randn(num_seqs, 8, 64, generator=gen).to(torch.bfloat16)
    return q.cuda(), seq_lens.cuda(), table.cuda()


def _used_slots(table: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """Every slot of every block a sequence uses (block id * 16 + offset)."""
    parts = []
    for i, n in enumerate(seq_lens.tolist()):
        used = table[i, : -(-n // 16)].long()
        parts.append((used[:, None] * 16 + torch.arange(16)).flatten())
    return torch.cat(parts)


def _expected(sender: OffloadSender, layer: int, q, seq_lens, table, **window) -> torch.Tensor:
    pool = sender.kv_layer(layer).cpu()
    return paged_decode_attention_reference(
        q.cpu(), pool, seq_lens.cpu(), table.cpu(), 0.125, key_layout="nd", **window
    ).float()


def _assert_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    rel = (got.float().cpu() - expected).norm() / expected.norm()
    assert rel < 1e-2, f"relative error {rel:.2e}"


@pytest.fixture
def pair(library):
    region = CudaRegion.create(_layout(), f"test-{uuid.uuid4().hex[:8]}", "cuda", library)
    receiver = OffloadReceiver(region, CudaPollingExecutor(num_blocks=4))
    sender = OffloadSender(region)
    yield sender, receiver, region
    receiver.close()


def test_poll_kernel_serves_tasks_in_one_process(pair) -> None:
    sender, receiver, region = pair
    receiver.poll()  # nothing pending: returns at once, serves nothing
    torch.cuda.synchronize()
    assert region.num_served() == 0
    for i in range(4):
        layer = i % 2
        q, seq_lens, table = _task(sender, layer, seed=i)
        ticket = sender.submit(layer, q, seq_lens, table, scale=0.125)
        torch.cuda.synchronize()
        assert receiver.has_pending()
        receiver.poll()
        out = sender.wait(ticket, timeout_s=2.0).clone()
        sender.settle(ticket)  # raises unless the device wait ended OK
        _assert_close(out, _expected(sender, layer, q, seq_lens, table))
    assert region.num_served() == 4 and not receiver.has_pending()


def test_wait_times_out_instead_of_hanging_then_recovers(pair) -> None:
    sender, receiver, region = pair
    q, seq_lens, table = _task(sender, 0, seed=10)
    ticket = sender.submit(0, q, seq_lens, table, scale=0.125)
    sender.wait(ticket, timeout_s=0.02)  # nobody polls
    status, num_polls = region.wait_status()
    assert status == WaitStatus.TIMEOUT and num_polls > 1
    with pytest.raises(OffloadTimeout, match="not done"):
        sender.settle(ticket)
    with pytest.raises(OffloadTimeout, match="still being served"):
        sender.submit(0, q, seq_lens, table, scale=0.125)
    assert not sender.recover()  # still pending
    receiver.poll()
    assert sender.recover()
    ticket = sender.submit(0, q, seq_lens, table, scale=0.125)
    sender.wait(ticket, timeout_s=0.02)
    receiver.poll()  # after the wait on the same stream: the wait times out first
    assert region.wait_status()[0] == WaitStatus.TIMEOUT


def test_a_failed_device_wait_is_answered_by_its_fallback_on_the_hot_stream(pair) -> None:
    """The hot side's fallback without a host synchronisation per layer: the _if_failed
    attention after a device wait does nothing when the wait ended OK and attends the task
    itself when it timed out; the host learns the count once (weaving/hot.py settle_step)."""
    sender, receiver, _ = pair
    q, seq_lens, table = _task(sender, 0, seed=13)
    expected = _expected(sender, 0, q, seq_lens, table)
    ticket = sender.submit(0, q, seq_lens, table, scale=0.125)
    receiver.poll()  # served: the fallback must do nothing and give the cold side's output
    sender.wait_with_timing(ticket, timeout_s=2.0)
    _assert_close(sender.enqueue_fallback(ticket), expected)
    assert sender.take_num_device_fallbacks() == 0
    ticket = sender.submit(0, q, seq_lens, table, scale=0.125)
    sender.wait_with_timing(ticket, timeout_s=0.02)  # nobody polls: times out
    _assert_close(sender.enqueue_fallback(ticket), expected)
    assert sender.take_num_device_fallbacks() == 1
    assert sender.take_num_device_fallbacks() == 0  # taken once
    receiver.poll()  # the cold side still serves the timed-out task; the region recovers
    assert sender.recover()


def test_wait_ends_when_the_cold_side_closes(pair) -> None:
    sender, _, region = pair
    q, seq_lens, table = _task(sender, 1, seed=11)
    ticket = sender.submit(1, q, seq_lens, table, scale=0.125)
    region.write_word(STATUS_OFFSET, int(RegionStatus.CLOSING))
    sender.wait(ticket, timeout_s=60.0)
    assert region.wait_status()[0] == WaitStatus.CLOSED


def test_bad_block_id_fails_the_task(pair) -> None:
    sender, receiver, _ = pair
    q, seq_lens, table = _task(sender, 0, seed=12)
    table[0, 0] = NUM_REMOTE_BLOCKS + 7  # a device batch: the cold kernel checks it
    ticket = sender.submit(0, q, seq_lens, table, scale=0.125)
    receiver.poll()
    sender.wait(ticket, timeout_s=2.0)
    with pytest.raises(OffloadTaskFailed):
        sender.settle(ticket)


def test_spin_server_serves_concurrently_and_stops_on_request(pair) -> None:
    sender, receiver, region = pair
    # One full round trip first: with CUDA lazy loading, the first launch of a kernel may
    # wait for the context to go idle, which never happens while the spin kernel runs.
    q, seq_lens, table = _task(sender, 0, seed=19)
    ticket = sender.submit(0, q, seq_lens, table, scale=0.125)
    receiver.poll()
    sender.wait(ticket, timeout_s=2.0).clone()
    _expected(sender, 0, q, seq_lens, table)
    sender.settle(ticket)
    spin_stream = torch.cuda.Stream(priority=-1)  # high priority (lower number = higher)
    hot_stream = torch.cuda.Stream()
    with torch.cuda.stream(spin_stream):
        region.spin(max_spin_s=120.0, num_blocks=2)
    with torch.cuda.stream(hot_stream):
        for i in range(3):
            q, seq_lens, table = _task(sender, i % 2, seed=20 + i)
            ticket = sender.submit(i % 2, q, seq_lens, table, scale=0.125)
            out = sender.wait(ticket, timeout_s=2.0).clone()
            sender.settle(ticket)
            _assert_close(out, _expected(sender, i % 2, q, seq_lens, table))
    start = time.monotonic()
    region.request_stop(torch.cuda.Stream())
    spin_stream.synchronize()
    # functional, not a timing bound: it stopped on the flag, not at its 120 s limit
    assert time.monotonic() - start < 60.0
    assert region.num_served() == 4


def _cold_worker_spec(prefix: str) -> dict:
    """gpu_cold_worker.py's argument: a region of this module's layout, named anew."""
    return {
        "name": f"{prefix}-{uuid.uuid4().hex[:8]}",
        "device": "cuda:0",
        "max_spin_s": 120.0,
        "layout": {
            "shape": SHAPE,
            "num_remote_blocks": NUM_REMOTE_BLOCKS,
            "max_seqs_per_task": MAX_SEQS,
            "max_blocks_per_seq": MAX_BLOCKS,
        },
    }


def _child_env() -> dict[str, str]:
    """A child process imports this checkout as pytest does."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}


def test_cross_process_round_trip_on_one_device(library) -> None:
    layout = _layout()
    spec = _cold_worker_spec("xproc")
    worker = Path(__file__).with_name("gpu_cold_worker.py")
    env = _child_env()
    proc = subprocess.Popen(
        [sys.executable, str(worker), json.dumps(spec)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert line.startswith("HANDLE "), f"cold worker said {line!r}"
        mapped = shm_files_of_processes([proc.pid])  # torch's CUDA IPC files among them
        region = CudaRegion.attach(layout, spec["name"], bytes.fromhex(line.split()[1]),
                                   library)
        sender = OffloadSender(region, policy=WaitPolicy())
        for i in range(5):
            q, seq_lens, table = _task(sender, i % 2, seed=30 + i)
            ticket = sender.submit(i % 2, q, seq_lens, table, scale=0.125)
            out = sender.wait(ticket, timeout_s=5.0).clone()
            sender.settle(ticket)
            _assert_close(out, _expected(sender, i % 2, q, seq_lens, table))
        del sender, region, out
        torch.cuda.synchronize()
        stdout, _ = proc.communicate("stop\n", timeout=120)
        assert "SERVED 5" in stdout
        assert proc.returncode == 0
        unlink_left_over(mapped)  # a file the exporter could not unlink while this side held it
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_killed_cold_process_leaves_its_region_to_the_fallback(library) -> None:
    """A cold engine that dies on a GPU: its region, opened here through CUDA IPC, stays
    readable after the owner is gone, the device wait times out instead of hanging, and
    the hot side's fallback attends the task over that memory, counted once. Run in its
    own process (gpu_owner_death.py): a read of freed memory would poison this one.
    (`library` only skips it where CUDA is absent.)"""
    spec = _cold_worker_spec("death")
    script = Path(__file__).with_name("gpu_owner_death.py")
    env = _child_env()
    done = subprocess.run([sys.executable, str(script), json.dumps(spec)], capture_output=True,
                          text=True, env=env, timeout=300)  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, f"stdout {done.stdout!r} stderr {done.stderr[-2000:]!r}"
    result = json.loads(lines[-1].removeprefix("RESULT "))
    assert "error" not in result, result
    assert result["cold_exit_code"] == -9
    assert result["pool_readable_after_death"], result
    assert result["wait_status"] == "TIMEOUT" and result["num_device_fallbacks"] == 1, result
    assert result["fallback_rel_error"] < 1e-2, result


# --- the armed server (weaver/offload/cuda/armed_server.py) ------------------------------
@pytest.mark.parametrize(
    ("num_blocks", "span_tokens"),
    [(None, 16), (2, 64)],
    ids=["context-split", "whole-items"],
)
def test_armed_server_serves_tasks_against_the_oracle(pair, num_blocks, span_tokens) -> None:
    """One block per SM and 16-token spans split every task of this layout along the
    context (items of 1-6 sequences x 2 KV heads, far fewer than the blocks); two blocks
    serve whole items. No poll point runs: the server alone serves, and the device count
    reaches the host."""
    sender, receiver, region = pair
    server = region.arm(ArmedServerConfig(num_blocks=num_blocks, span_tokens=span_tokens))
    for i in range(6):
        layer = i % 2
        # every other task with a sliding window: spans before it hold no token
        window = {"sliding_window": 40} if i % 2 else {}
        q, seq_lens, table = _task(sender, layer, seed=40 + i)
        ticket = sender.submit(layer, q, seq_lens, table, scale=0.125, **window)
        out = sender.wait(ticket, timeout_s=5.0).clone()
        sender.settle(ticket)
        _assert_close(out, _expected(sender, layer, q, seq_lens, table, **window))
    assert receiver.poll() is False  # a poll point on an armed region does nothing
    assert region.num_served() == 6
    region.disarm()
    assert server.num_pairs > 0 and not server.is_running


def test_armed_server_fails_a_bad_block_id_and_serves_on(pair) -> None:
    sender, _, region = pair
    region.arm(ArmedServerConfig(span_tokens=16))
    q, seq_lens, table = _task(sender, 0, seed=50)
    bad = table.clone()
    bad[0, 0] = NUM_REMOTE_BLOCKS + 7
    ticket = sender.submit(0, q, seq_lens, bad, scale=0.125)
    sender.wait(ticket, timeout_s=5.0)
    with pytest.raises(OffloadTaskFailed):
        sender.settle(ticket)
    ticket = sender.submit(0, q, seq_lens, table, scale=0.125)
    out = sender.wait(ticket, timeout_s=5.0).clone()
    sender.settle(ticket)
    _assert_close(out, _expected(sender, 0, q, seq_lens, table))


def test_armed_region_refuses_poll_kernels_and_hands_back_when_disarmed(pair) -> None:
    """One server per region (two would split one task's claims); disarming ends the queued
    watches through the stop flag, within their bound, and poll points serve again."""
    sender, receiver, region = pair
    region.arm()
    with pytest.raises(ValueError, match="armed server"):
        region.poll()
    start = time.monotonic()
    region.disarm()
    assert time.monotonic() - start < 5.0  # functional: it did not hang on a watch
    q, seq_lens, table = _task(sender, 1, seed=51)
    ticket = sender.submit(1, q, seq_lens, table, scale=0.125)
    receiver.poll()
    out = sender.wait(ticket, timeout_s=5.0).clone()
    sender.settle(ticket)
    _assert_close(out, _expected(sender, 1, q, seq_lens, table))
