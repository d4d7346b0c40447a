"""Export/open a CUDA tensor through CUDA IPC as plain bytes (no pickle).

torch's own reducer (``torch.multiprocessing.reductions.reduce_tensor``) makes the IPC
memory handle, the refcount block and the event; its arguments are serialised here as
JSON (bytes as hex) with the two class arguments fixed, so opening a handle never
unpickles data from another process. The parameter names are probed with
``inspect.signature`` (LMCache style) instead of relying on positions, which differ
between torch versions.

The exporter's device index means nothing in another process, which numbers the GPUs it
sees from 0 (weaver serve starts each engine with its own CUDA_VISIBLE_DEVICES), so the
handle names the GPU by UUID and the opener finds it among its own.
"""

from __future__ import annotations

import inspect
import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

HANDLE_FORMAT = "weaver-cuda-ipc-v2"  # v2: the device's UUID
_CLASS_PARAMS = ("tensor_cls", "storage_cls")
_DEVICE_PARAM = "storage_device"


def export_tensor(tensor: torch.Tensor) -> bytes:
    """Bytes another process passes to open_tensor; the exporter must keep `tensor` alive."""
    import torch
    from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

    if tensor.device.type != "cuda":
        raise ValueError(f"only CUDA tensors can be exported, got {tensor.device}")
    rebuild, args = reduce_tensor(tensor)
    if rebuild is not rebuild_cuda_tensor:
        raise ValueError("torch did not export this tensor through CUDA IPC")
    names = list(inspect.signature(rebuild_cuda_tensor).parameters)
    fields: dict[str, Any] = {}
    for name, value in zip(names, args, strict=True):
        if name in _CLASS_PARAMS:
            continue
        fields[name] = _encode(value, torch)
    uuid = str(torch.cuda.get_device_properties(tensor.device).uuid)
    return json.dumps({"format": HANDLE_FORMAT, "device_uuid": uuid,
                       "fields": fields}).encode()


def local_device_index(device_uuid: str, local_uuids: list[str]) -> int:
    """This process's index of the GPU with `device_uuid` (local_uuids in CUDA's order)."""
    if device_uuid not in local_uuids:
        raise ValueError(
            f"the GPU holding this CUDA IPC region ({device_uuid}) is not visible in this "
            f"process (it sees {len(local_uuids)} GPU(s)); its CUDA_VISIBLE_DEVICES must "
            "include that GPU (weaver serve gives a hot engine its cold models' GPUs)")
    return local_uuids.index(device_uuid)


def open_tensor(handle: bytes) -> torch.Tensor:
    """Open a tensor exported by export_tensor in another process (once; keep it)."""
    import torch
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    try:
        payload = json.loads(handle.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError("not a Weaver CUDA IPC handle (bad encoding)") from exc
    if not isinstance(payload, dict) or payload.get("format") != HANDLE_FORMAT:
        raise ValueError(f"not a Weaver CUDA IPC handle (expected format {HANDLE_FORMAT!r})")
    fields = {name: _decode(value, torch) for name, value in payload["fields"].items()}
    local_uuids = [str(torch.cuda.get_device_properties(i).uuid)
                   for i in range(torch.cuda.device_count())]
    fields[_DEVICE_PARAM] = local_device_index(str(payload.get("device_uuid")), local_uuids)
    fields["tensor_cls"] = torch.Tensor
    fields["storage_cls"] = torch.UntypedStorage
    names = list(inspect.signature(rebuild_cuda_tensor).parameters)
    missing = set(names) - set(fields)
    if missing:
        raise ValueError(f"CUDA IPC handle lacks {sorted(missing)}; was it made by another torch?")
    return rebuild_cuda_tensor(*(fields[name] for name in names))


def _encode(value: Any, torch: Any) -> Any:
    if isinstance(value, bytes):
        return {"bytes": value.hex()}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.Size | tuple):
        return {"tuple": [_encode(v, torch) for v in value]}
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise ValueError(f"cannot serialise CUDA IPC field of type {type(value).__name__}")


def _decode(value: Any, torch: Any) -> Any:
    if isinstance(value, dict):
        if "bytes" in value:
            return bytes.fromhex(value["bytes"])
        if "dtype" in value:
            dtype = getattr(torch, value["dtype"], None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"bad dtype {value['dtype']!r} in CUDA IPC handle")
            return dtype
        if "tuple" in value:
            return tuple(_decode(v, torch) for v in value["tuple"])
        raise ValueError(f"bad CUDA IPC handle field {value!r}")
    return value
