"""CPU parts of the CUDA transport: the IPC handle codec and the device-side K/V writer."""

from __future__ import annotations

import json

import pytest
import torch

from weaver.offload.cuda import ipc
from weaver.offload.cuda.pool import write_kv
from weaver.offload.reference_attention import paged_decode_attention_reference, write_kv_reference


def test_handle_fields_round_trip_through_json() -> None:
    fields = {
        "tensor_size": torch.Size([4096]),
        "dtype": torch.uint8,
        "storage_handle": b"\x00\xffhandle",
        "event_handle": None,
        "requires_grad": False,
        "storage_offset_bytes": 512,
    }
    encoded = json.loads(json.dumps({k: ipc._encode(v, torch) for k, v in fields.items()}))
    decoded = {k: ipc._decode(v, torch) for k, v in encoded.items()}
    assert decoded == {**fields, "tensor_size": (4096,)}


@pytest.mark.parametrize(
    "handle",
    [b"\xff\xfe", b"{}", json.dumps({"format": "other"}).encode(), b"[1, 2]"],
)
def test_open_tensor_rejects_foreign_handles(handle: bytes) -> None:
    with pytest.raises(ValueError, match="not a Weaver CUDA IPC handle"):
        ipc.open_tensor(handle)


def test_the_region_gpu_is_found_by_uuid_in_the_openers_numbering() -> None:
    # The cold engine sees its GPU as cuda:0; a hot engine started with
    # CUDA_VISIBLE_DEVICES=<its own>,<the cold one> sees it as cuda:1.
    assert ipc.local_device_index("GPU-cold", ["GPU-hot", "GPU-cold"]) == 1
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES must include that GPU"):
        ipc.local_device_index("GPU-cold", ["GPU-hot"])


def test_export_refuses_cpu_tensors() -> None:
    with pytest.raises(ValueError, match="only CUDA tensors"):
        ipc.export_tensor(torch.zeros(4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_matches_the_reference_writer(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    pool = torch.randn(6, 2, 16, 2 * 32, generator=gen).to(dtype)
    expected = pool.clone()
    key, value = torch.randn(2, 9, 2, 32, generator=gen).to(dtype)
    slots = torch.randperm(6 * 16, generator=gen)[:9]
    write_kv(pool, key, value, slots)
    write_kv_reference(expected, key, value, slots, key_layout="nd")
    assert torch.equal(pool, expected)
    # and the oracle reads back what was written
    q = torch.randn(1, 4, 32, generator=gen).to(dtype)
    table = torch.tensor([[int(slots[0]) // 16]], dtype=torch.int32)
    out = paged_decode_attention_reference(q, pool, torch.tensor([16]), table, 0.2, key_layout="nd")
    assert torch.isfinite(out.float()).all()


def test_write_kv_checks_shapes() -> None:
    pool = torch.zeros(2, 2, 16, 64)
    with pytest.raises(ValueError, match="key and value"):
        write_kv(pool, torch.zeros(3, 1, 32), torch.zeros(3, 1, 32), torch.arange(3))
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv(pool, torch.zeros(3, 2, 32), torch.zeros(3, 2, 32), torch.arange(4))
