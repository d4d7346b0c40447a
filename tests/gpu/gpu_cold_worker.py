"""Cold side in its own process for the cross-process GPU test (not a test module).

Usage: python gpu_cold_worker.py '<json>' with json = {"name", "device", "layout": {...},
"max_spin_s"}. Creates the CUDA region and a receiver, prints "HANDLE <hex>", runs the
spin server on a high-priority stream, and on "stop" (or EOF) from stdin stops it and
prints "SERVED <n>".
"""

from __future__ import annotations

import json
import sys

import torch

from weaver.offload.cuda.jit import KernelLibrary
from weaver.offload.cuda.transport import CudaPollingExecutor, CudaRegion
from weaver.offload.layout import HotAttentionShape, RegionLayout
from weaver.offload.receiver import OffloadReceiver


def main() -> int:
    spec = json.loads(sys.argv[1])
    lay = spec["layout"]
    layout = RegionLayout(
        HotAttentionShape(**lay["shape"]),
        num_remote_blocks=lay["num_remote_blocks"],
        max_seqs_per_task=lay["max_seqs_per_task"],
        max_blocks_per_seq=lay["max_blocks_per_seq"],
    )
    device = torch.device(spec["device"])
    torch.cuda.set_device(device)
    library = KernelLibrary(device.index)
    region = CudaRegion.create(layout, spec["name"], device, library)
    receiver = OffloadReceiver(region, CudaPollingExecutor(num_blocks=8))
    print("HANDLE", region.export_handle().hex(), flush=True)
    spin_stream = torch.cuda.Stream(device, priority=-1)  # high priority
    with torch.cuda.stream(spin_stream):
        region.spin(spec["max_spin_s"], num_blocks=8)
    sys.stdin.readline()  # "stop" or EOF
    region.request_stop(torch.cuda.Stream(device))
    spin_stream.synchronize()
    print("SERVED", region.num_served(), flush=True)
    receiver.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
