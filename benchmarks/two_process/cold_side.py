"""The cold process of a two-process decode: the region's owner, serving the hot side's
decode attention while it decodes a batch of its own with another model.

Run by benchmarks/two_process_decode.py as ``python -m benchmarks.two_process.cold_side
'<json spec>'`` (the spec is ``ColdSpec``'s fields; the pair's plan as
``PairPlan.to_dict``). It opens the region through ``ColdWeaving`` (weaver/weaving/
cold.py), puts a poll point after every operator of its model (``PollPoints``), starts
the idle poller, then decodes step after step, each under the step lock, until stdin
says "stop" or closes. Protocol lines on stdout: ``READY <region handle as hex, or
->`` once serving, then ``SERVED <json>`` with what it served. Logs go to stderr.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.two_process.decoder import PagedDecoder
from benchmarks.two_process.paged_batch import blocks_per_sequence, place_sequences
from benchmarks.two_process.tiny_llama import LlamaShape, TinyLlama
from weaver.profiling.channel_probe import noop_executor, reference_executor
from weaver.weaving.cold import ColdWeaving
from weaver.weaving.plan import PairPlan
from weaver.weaving.poll_points import PollPoints


@dataclass(frozen=True)
class ColdSpec:
    transport: str  # "shm" | "cuda"
    plan: dict[str, Any]  # PairPlan.to_dict()
    model: dict[str, Any]  # LlamaShape fields of the cold model
    seed: int
    device: str
    num_seqs: int
    prompt_len: int
    max_len: int
    block_size: int
    executor: str = "reference"  # shm: the oracle, or "noop" (a negative control)


class ColdModelLoop:
    """The cold model's own work: a batch decoded greedily, restarted with fresh prompts
    each time its sequences reach max_len."""

    def __init__(self, model: TinyLlama, spec: ColdSpec) -> None:
        self.model = model
        self.spec = spec
        self.num_steps = 0
        self._gen = torch.Generator().manual_seed(spec.seed)
        self._steps_per_batch = spec.max_len - spec.prompt_len
        self._start_batch()

    def _start_batch(self) -> None:
        spec = self.spec
        prompts = torch.randint(self.model.shape.vocab_size, (spec.num_seqs, spec.prompt_len),
                                generator=self._gen).tolist()
        sequences = place_sequences(
            prompts, [0] * spec.num_seqs, set(),
            num_blocks_each=blocks_per_sequence(spec.max_len, spec.block_size),
            seed=int(torch.randint(2**31, (1,), generator=self._gen)))
        self._decoder = PagedDecoder(self.model, sequences, block_size=spec.block_size)
        self._step_in_batch = 0

    def step(self) -> None:
        if self._step_in_batch == self._steps_per_batch:
            self._start_batch()
        self._decoder.step(self._step_in_batch)
        self._step_in_batch += 1
        self.num_steps += 1


def open_cold_weaving(plan: PairPlan, spec: ColdSpec) -> ColdWeaving:
    """The region as the plan's transport says: in shared memory, served by a host
    executor (the pure-torch oracle, or one that computes nothing), or on this process's
    current GPU, served by the polling kernel."""
    if spec.transport == "cuda":
        from weaver.offload.cuda.transport import CudaPollingExecutor

        return ColdWeaving.open([plan], lambda p: CudaPollingExecutor())
    make = noop_executor if spec.executor == "noop" else reference_executor
    return ColdWeaving.open([plan], lambda p: make(p.shape))


def served_report(cold: ColdWeaving, transport: str) -> dict[str, Any]:
    if transport == "cuda":
        # The polling kernel serves on the device without telling the host; its own
        # counter says how many (a synchronising read).
        served = sum(r.transport.num_served() for r in cold.receivers.values())
        return {"num_served": served, "num_served_at_poll_points": None,
                "num_served_by_idle_poller": None}
    stats = cold.stats()
    return {key: sum(s[key] for s in stats) for key in
            ("num_served", "num_served_at_poll_points", "num_served_by_idle_poller")}


def main(argv: list[str]) -> int:
    # Protocol lines go to the real stdout; anything a library prints goes to stderr.
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    spec = ColdSpec(**json.loads(argv[0]))
    device = torch.device(spec.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # where ColdWeaving creates the region
    else:
        # One thread: the hot process has the machine's other cores, and two torch thread
        # pools on the same cores thrash.
        torch.set_num_threads(1)
    plan = PairPlan.from_dict(spec.plan)
    model = TinyLlama(LlamaShape(**spec.model), spec.seed, device)
    loop = ColdModelLoop(model, spec)
    cold = open_cold_weaving(plan, spec)
    try:
        poll_points = PollPoints(model.operators(), cold.poll)
        with cold.step_lock:
            # Warm-up before serving: the first step pays cuBLAS set-up, and on CUDA the
            # first poll loads the polling kernel, so no task waits on either.
            loop.step()
            cold.poll()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        cold.start_idle_poller()
        # A region on a GPU is opened through its CUDA IPC handle, one in shared memory by
        # its name.
        print("READY", cold.export_handles().get(plan.region_name, "-"), file=protocol)
        stop = threading.Event()
        threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
        while not stop.is_set():
            with cold.step_lock:
                loop.step()
        report = {**served_report(cold, spec.transport), "num_cold_steps": loop.num_steps,
                  "num_poll_points": len(poll_points)}
        poll_points.remove()
    finally:
        cold.close()
    print("SERVED", json.dumps(report), file=protocol)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
