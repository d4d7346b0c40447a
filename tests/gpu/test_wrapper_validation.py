"""The kernel wrappers reject bad inputs before anything touches a device (CPU/meta)."""

from __future__ import annotations

import pytest
import torch

from weaver.offload.cuda import kernels


def _inputs(device: str = "cpu", **changes: object) -> dict[str, torch.Tensor]:
    t = {
        "q": torch.empty(3, 8, 64, dtype=torch.float16, device=device),
        "kv_layer": torch.empty(10, 2, 16, 128, dtype=torch.float16, device=device),
        "seq_lens": torch.empty(3, dtype=torch.int32, device=device),
        "block_table": torch.empty(3, 4, dtype=torch.int32, device=device),
    }
    t.update(changes)  # type: ignore[arg-type]
    return t


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"q": torch.empty(3, 8, 64, dtype=torch.float64)}, "unsupported"),
        ({"q": torch.empty(3, 512, dtype=torch.float16)}, r"q must be \[num_seqs"),
        ({"kv_layer": torch.empty(10, 2, 16, 64, dtype=torch.float16)}, "2\\*head_size"),
        ({"kv_layer": torch.empty(10, 2, 16, 128, dtype=torch.bfloat16)}, "dtype"),
        (
            {"kv_layer": torch.empty(10, 3, 16, 128, dtype=torch.float16)},
            "multiple of num_kv_heads",
        ),
        ({"kv_layer": torch.empty(10, 2, 24, 128, dtype=torch.float16)}, "multiple of 16"),
        (
            {
                "q": torch.empty(3, 8, 320, dtype=torch.float16),
                "kv_layer": torch.empty(10, 2, 16, 640, dtype=torch.float16),
            },
            "head_size 320",
        ),
        ({"seq_lens": torch.empty(3, dtype=torch.int64)}, "seq_lens must be int32"),
        ({"seq_lens": torch.empty(4, dtype=torch.int32)}, "seq_lens must be int32"),
        ({"block_table": torch.empty(2, 4, dtype=torch.int32)}, "block_table must be int32"),
        ({"block_table": torch.empty(3, 8, dtype=torch.int32)[:, ::2]}, "contiguous"),
    ],
)
def test_attention_inputs_are_checked(changes: dict[str, torch.Tensor], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        kernels.validate_attention_inputs(**_inputs(**changes))


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_well_shaped_non_cuda_tensors_are_refused(device: str) -> None:
    with pytest.raises(ValueError, match="CUDA device"):
        kernels.validate_attention_inputs(**_inputs(device))
    with pytest.raises(ValueError, match="CUDA device"):
        # the library is never touched: validation fails first
        kernels.paged_decode_attention(None, scale=1.0, **_inputs(device))  # type: ignore[arg-type]


def test_out_must_match_q() -> None:
    with pytest.raises(ValueError, match="out must match q"):
        kernels.validate_attention_inputs(
            **_inputs(), out=torch.empty(3, 8, 32, dtype=torch.float16)
        )


def test_transport_kernels_check_their_arguments() -> None:
    region = torch.empty(4096, dtype=torch.uint8)
    desc = torch.empty(20, dtype=torch.int64)
    with pytest.raises(ValueError, match="desc must be on a CUDA device"):
        kernels.publish(None, region, desc, seq=1, layer=0, num_seqs=1, scale=1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="flat uint8"):
        kernels.publish(None, region.view(torch.int64), desc, seq=1, layer=0, num_seqs=1, scale=1.0)  # type: ignore[arg-type]
    meta_desc = torch.empty(20, dtype=torch.int64, device="meta")
    with pytest.raises(ValueError, match="desc must be on a CUDA device"):
        kernels.wait_done(
            None, region, meta_desc, torch.empty(2, dtype=torch.int32), seq=1, timeout_s=1
        )  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="desc must be int64"):
        kernels.poll_and_attend(
            None,  # type: ignore[arg-type]
            torch.float16,
            region,
            desc.float(),
            torch.empty(4, dtype=torch.int64),
            torch.empty(1, dtype=torch.int32),
            head_size=64,
            num_blocks=1,
        )


def test_kernel_variant_follows_dtype_and_head_size() -> None:
    assert kernels.kernel_name("k", torch.bfloat16, 128) == "k_bf16_h128"
    assert kernels.kernel_name("k", torch.float32, 129) == "k_f32_h256"
    with pytest.raises(ValueError, match="head_size 257"):
        kernels.kernel_name("k", torch.float16, 257)


def _cpu_sender():
    """A CudaOffloadSender whose checks can run on CPU: only the state they read is set."""
    from types import SimpleNamespace

    from weaver.offload.cuda.transport import CudaOffloadSender
    from weaver.offload.layout import HotAttentionShape, RegionLayout

    shape = HotAttentionShape(2, 8, 2, 64, 16, "bfloat16")
    layout = RegionLayout(shape, num_remote_blocks=32, max_seqs_per_task=4, max_blocks_per_seq=6)
    sender = object.__new__(CudaOffloadSender)
    sender._region = SimpleNamespace(layout=layout)
    sender._q = torch.empty(4, 8, 64, dtype=torch.bfloat16)
    sender._is_poisoned, sender._unwaited, sender._last_seq = False, None, 0
    return sender


def _task(num_seqs: int = 2, **changes: object) -> dict:
    task = {
        "layer": 1,
        "q": torch.empty(num_seqs, 8, 64, dtype=torch.bfloat16),
        "seq_lens": torch.ones(num_seqs, dtype=torch.int32),
        "block_table": torch.zeros(num_seqs, 3, dtype=torch.int32),
    }
    task.update(changes)
    return task


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"layer": 2}, "layer 2 out of range"),
        ({"q": torch.empty(2, 4, 64, dtype=torch.bfloat16)}, r"q must be \[num_seqs, 8, 64\]"),
        ({"q": torch.empty(2, 8, 64, dtype=torch.float16)}, "cast it first"),
        ({"seq_lens": torch.ones(2, dtype=torch.int64)}, "seq_lens must be int32"),
        ({"block_table": torch.zeros(2, 7, dtype=torch.int32)}, "n <= 6"),
        ({"block_table": torch.zeros(3, 2, dtype=torch.int32)}, r"block_table must be \[2"),
    ],
)
def test_sender_rejects_bad_tasks_before_any_device_work(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _cpu_sender().submit(scale=1.0, **_task(**changes))


def test_sender_refuses_too_many_sequences() -> None:
    with pytest.raises(ValueError, match=r"num_seqs 5 outside \[1, 4\]"):
        _cpu_sender().submit(scale=1.0, **_task(num_seqs=5))


def test_sender_keeps_one_task_in_flight_and_stops_after_a_failed_wait() -> None:
    from weaver.offload.cuda.transport import CudaTicket

    sender = _cpu_sender()
    sender._unwaited = CudaTicket(seq=1, layer=0, num_seqs=1)
    with pytest.raises(ValueError, match="submitted but not waited"):
        sender.submit(scale=1.0, **_task())
    with pytest.raises(ValueError, match="not the task in flight"):
        sender.wait(CudaTicket(seq=2, layer=0, num_seqs=1))
    sender._unwaited, sender._is_poisoned = None, True
    with pytest.raises(ValueError, match="recover"):
        sender.submit(scale=1.0, **_task())
    sender._is_poisoned, sender._last_seq = False, 2**63 - 1
    with pytest.raises(OverflowError):
        sender.submit(scale=1.0, **_task())
