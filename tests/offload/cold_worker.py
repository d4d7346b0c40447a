"""Cold side in its own process, for the cross-process tests (not a test module).

Usage: python cold_worker.py '<json>' where json has name, shm_dir, layout (the
RegionLayout fields), executor ("reference" | "vllm") and poller (bool). Prints READY
once the region exists and the receiver is alive; reads commands from stdin:
"close" closes the receiver (prints CLOSED and exits); EOF does the same.
"""

from __future__ import annotations

import json
import os
import sys

from weaver.offload.layout import HotAttentionShape, RegionLayout
from weaver.offload.protocol import OffloadTask
from weaver.offload.receiver import OffloadReceiver
from weaver.offload.reference_attention import paged_decode_attention_reference
from weaver.offload.shm import ShmRegion
from weaver.weaving.cold import ColdWeaving


def _reference_executor(task: OffloadTask) -> None:
    out = paged_decode_attention_reference(
        task.q, task.kv_layer, task.seq_lens, task.block_table, task.scale, key_layout="nd"
    )
    task.out.copy_(out)


def main() -> int:
    # Protocol lines go to the real stdout; anything a library prints (vLLM logs to
    # stdout by default) is sent to stderr so it cannot be mistaken for one.
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    spec = json.loads(sys.argv[1])
    lay = spec["layout"]
    layout = RegionLayout(
        shape=HotAttentionShape(**lay["shape"]),
        num_remote_blocks=lay["num_remote_blocks"],
        max_seqs_per_task=lay["max_seqs_per_task"],
        max_blocks_per_seq=lay["max_blocks_per_seq"],
    )
    if spec["executor"] == "vllm":
        from weaver.vllm_ext.attention.cpu_kernels import CpuPagedAttentionExecutor

        executor = CpuPagedAttentionExecutor(layout.shape)
    else:
        executor = _reference_executor
    region = ShmRegion.create(layout, spec["name"], shm_dir=spec["shm_dir"])
    receiver = OffloadReceiver(region, executor)
    cold = ColdWeaving({spec["name"]: receiver})  # the cold engine's idle poller
    if spec["poller"]:
        cold.start_idle_poller()
    print("READY", file=protocol)
    for line in sys.stdin:
        if line.strip() == "close":
            break
    served = receiver.stats.num_served
    cold.close()
    print(f"CLOSED served={served}", file=protocol)
    return 0


if __name__ == "__main__":
    sys.exit(main())
