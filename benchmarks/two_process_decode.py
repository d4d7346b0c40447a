"""Two-process decode without vLLM: Weaver's weaving runtime end to end over an offload
transport, checked token for token.

A HOT side (this process) decodes a batch of sequences greedily with a small Llama-shaped
model (random weights, seeded) over a paged KV cache, twice: all sequences local
(offload OFF), then with --num-remote of them remote (offload ON): their KV blocks in the
offload region's KV section, their prompts' K/V written there and attended here (remote
prefill), their decode attention published to the cold side through HotWeaving
(weaver/weaving/hot.py) while the local rows are attended here. A COLD process
(benchmarks/two_process/cold_side.py) owns the region (ColdWeaving, weaver/weaving/
cold.py) and decodes a batch of its own with a model of another shape, a poll point after
each of its operators serving the tasks, an idle poller between its steps.

Transports: "shm" (POSIX shared memory, the cold side serves with the pure-torch oracle;
runs on CPU) and "cuda" (the region in the cold GPU's memory, opened through CUDA IPC;
the hot side publishes and waits with kernels on its stream, the cold side's polling
kernel serves on the device).

The run passes (exit 0) when the greedy tokens with offload ON equal those with offload
OFF, the cold side served every task the hot side published (more than none) and no task
fell back to the hot side (on CUDA: no device wait failed). Exit 1 when a check fails, 2
when it cannot run (no CUDA device for --transport cuda, bad arguments). --out writes the
figures as JSON: the checks, tasks served (at poll points / by the idle poller on shm),
the wall time of every step with offload off and on, the smallest top-1/top-2 logit gap
and the largest logit change offload made.

The hot side's attention is the pure-torch oracle (weaver/offload/reference_attention.py)
on either transport: on a GPU it synchronises the host within each layer, so the step
times there show the path's cost, not the overlap real kernels would give.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

_REPO_ROOT = Path(__file__).resolve().parents[1]
if str(_REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(_REPO_ROOT))

import torch  # noqa: E402

from benchmarks.two_process.cold_side import ColdSpec  # noqa: E402
from benchmarks.two_process.decoder import PagedDecoder  # noqa: E402
from benchmarks.two_process.paged_batch import (  # noqa: E402
    blocks_per_sequence,
    place_sequences,
)
from benchmarks.two_process.tiny_llama import LlamaShape, TinyLlama  # noqa: E402
from weaver.offload.layout import HotAttentionShape  # noqa: E402
from weaver.offload.naming import region_name  # noqa: E402
from weaver.processes import shm_files_of_processes, unlink_left_over  # noqa: E402
from weaver.weaving.hot import HotWeaving  # noqa: E402
from weaver.weaving.plan import PairPlan, default_shm_prefix  # noqa: E402

# The hot model: head size 64 and GQA (4 query heads on 2 KV heads), a shape the CUDA
# kernels serve (head sizes up to 256). The cold model differs in every dimension.
HOT_SHAPE = LlamaShape(vocab_size=256, hidden_size=256, num_layers=2, num_q_heads=4,
                       num_kv_heads=2, head_size=64, intermediate_size=512)
COLD_SHAPE = LlamaShape(vocab_size=192, hidden_size=96, num_layers=3, num_q_heads=3,
                        num_kv_heads=1, head_size=32, intermediate_size=192)
COLD_NUM_SEQS, COLD_PROMPT_LEN, COLD_MAX_LEN = 2, 4, 32
CUDA_BLOCK_MULTIPLE = 16  # weaver/offload/cuda/region_desc.py BLOCK_SIZE_MULTIPLE
# The cold process's start: imports, and on CUDA the context and its first kernel compile.
READY_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 60.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example: python benchmarks/two_process_decode.py --transport shm "
               "--num-seqs 6 --num-remote 3 --steps 12 --out /tmp/two_process.json")
    parser.add_argument("--transport", choices=("shm", "cuda"), default="shm",
                        help="offload transport (default shm)")
    parser.add_argument("--device", help="the hot side's device (default: cpu for shm, "
                        "cuda:0 for cuda)")
    parser.add_argument("--cold-device", help="the cold side's device (default: --device; "
                        "another GPU for a two-GPU run)")
    parser.add_argument("--num-seqs", type=int, default=6, help="hot batch size (default 6)")
    parser.add_argument("--num-remote", type=int, default=3,
                        help="how many of them are remote with offload ON (default 3, >= 1)")
    parser.add_argument("--steps", type=int, default=12, help="decode steps (default 12, "
                        ">= 3: odd-numbered sequences join at step 1, the rest at step 0)")
    parser.add_argument("--prompt-len", type=int, default=5,
                        help="prompt tokens of sequence 0, sequence i has prompt-len + i %% 3 "
                        "(default 5, >= 2 so a prompt is a prefill)")
    parser.add_argument("--block-size", type=int, default=16,
                        help="KV block size in tokens (default 16; cuda: a multiple of 16)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seeds the weights, prompts and block tables (default 0)")
    parser.add_argument("--timeout-s", type=float, default=10.0,
                        help="the hot side's wait for one task (default 10)")
    parser.add_argument("--cold-executor", choices=("reference", "noop"), default="reference",
                        help="shm only. noop: the cold side serves each task without "
                        "computing it, a negative control whose run must fail")
    parser.add_argument("--kill-cold-at-step", type=int, default=-1,
                        help="SIGKILL the cold process before this step of the offload-ON "
                        "run (>= 1): the hot side's waits then fail, the pair must turn "
                        "degraded and the remote rows be computed here from the remote pool "
                        "(on CUDA read through the dead owner's IPC mapping), with the tokens "
                        "of offload OFF; waits time out after --timeout-s")
    parser.add_argument("--out", type=Path, help="write the figures here as JSON")
    args = parser.parse_args(argv)
    error = argument_error(args)
    if error:
        parser.error(error)
    args.device = args.device or ("cuda:0" if args.transport == "cuda" else "cpu")
    args.cold_device = args.cold_device or args.device
    return args


def argument_error(args: argparse.Namespace) -> str | None:
    if not 1 <= args.num_remote <= args.num_seqs:
        return "--num-remote must be in [1, --num-seqs]: the check needs remote sequences"
    if args.steps < 3:
        return "--steps must be >= 3 so every remote sequence decodes at least once"
    if args.prompt_len < 2:
        return "--prompt-len must be >= 2 (a one-token prompt is classified as a decode)"
    if args.block_size < 1 or args.timeout_s <= 0:
        return "--block-size must be >= 1 and --timeout-s > 0"
    if args.transport == "cuda" and args.block_size % CUDA_BLOCK_MULTIPLE:
        return f"--block-size must be a multiple of {CUDA_BLOCK_MULTIPLE} for the CUDA kernels"
    devices = [d for d in (args.device, args.cold_device) if d]
    wanted = "cuda" if args.transport == "cuda" else "cpu"
    if any(torch.device(d).type != wanted for d in devices):
        return f"--transport {args.transport} runs on {wanted} devices, got {devices}"
    if args.cold_executor == "noop" and args.transport != "shm":
        return "--cold-executor noop is a control of the shm transport"
    if args.kill_cold_at_step != -1 and not 1 <= args.kill_cold_at_step < args.steps:
        return "--kill-cold-at-step must be in [1, --steps): some tasks are served before"
    return None


def unavailable_reason(args: argparse.Namespace) -> str | None:
    if args.transport != "cuda":
        return None
    from weaver.offload.cuda.jit import unavailable_reason as cuda_unavailable

    return cuda_unavailable()


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    join_steps: list[int]
    remote: frozenset[int]  # sequence indices placed remotely with offload ON
    num_steps: int
    block_size: int
    seed: int  # of the block tables

    @property
    def num_blocks_each(self) -> int:
        max_len = max(len(p) for p in self.prompts) + self.num_steps
        return blocks_per_sequence(max_len, self.block_size)

    @property
    def num_tasks(self) -> int:
        """Decode-attention tasks an ON run publishes: a layer's per step with a remote
        sequence past its prefill."""
        return HOT_SHAPE.num_layers * sum(
            any(self.join_steps[i] < step for i in self.remote) for step in range(self.num_steps))


def make_workload(args: argparse.Namespace) -> Workload:
    # Every seed of the run derives from --seed here.
    gen = torch.Generator().manual_seed(args.seed + 1)
    prompts = [torch.randint(HOT_SHAPE.vocab_size, (args.prompt_len + i % 3,),
                             generator=gen).tolist() for i in range(args.num_seqs)]
    # Half the batch joins a step late, so a step mixes prefills and decodes of both
    # placements: remote prefill rows are attended here while a task is on the cold side.
    join_steps = [i % 2 for i in range(args.num_seqs)]
    remote = frozenset(range(args.num_seqs - args.num_remote, args.num_seqs))
    return Workload(prompts, join_steps, remote, args.steps, args.block_size, args.seed + 2)


def make_plan(args: argparse.Namespace, workload: Workload) -> PairPlan:
    shape = HotAttentionShape(num_layers=HOT_SHAPE.num_layers, num_q_heads=HOT_SHAPE.num_q_heads,
                              num_kv_heads=HOT_SHAPE.num_kv_heads, head_size=HOT_SHAPE.head_size,
                              block_size=args.block_size, dtype="float32")
    return PairPlan(
        hot="tiny-hot", cold="tiny-cold",
        region_name=region_name(default_shm_prefix(), "tiny-hot", "tiny-cold"),
        shape=shape,
        num_remote_blocks=len(workload.remote) * workload.num_blocks_each,
        max_seqs_per_task=len(workload.remote),
        max_blocks_per_seq=workload.num_blocks_each,
        offload_ratio=len(workload.remote) / len(workload.prompts),
        timeout_s=args.timeout_s,
        transport=args.transport,
    )


# --- the cold process -------------------------------------------------------------------
def start_cold(args: argparse.Namespace, plan: PairPlan) -> subprocess.Popen:
    spec = ColdSpec(transport=args.transport, plan=plan.to_dict(), model=asdict(COLD_SHAPE),
                    seed=args.seed + 3, device=args.cold_device, num_seqs=COLD_NUM_SEQS,
                    prompt_len=COLD_PROMPT_LEN, max_len=COLD_MAX_LEN,
                    block_size=args.block_size, executor=args.cold_executor)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(_REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    return subprocess.Popen(
        [sys.executable, "-m", "benchmarks.two_process.cold_side", json.dumps(asdict(spec))],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)


def read_protocol_line(proc: subprocess.Popen, word: str, timeout_s: float) -> str:
    is_ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    line = proc.stdout.readline() if is_ready else ""  # type: ignore[union-attr]
    if not line.startswith(word + " "):
        raise RuntimeError(f"the cold process said {line!r}, not {word} (exit code "
                           f"{proc.poll()}); its log is on stderr")
    return line.split(maxsplit=1)[1].strip()


def stop_cold(proc: subprocess.Popen) -> dict[str, Any]:
    proc.stdin.close()  # type: ignore[union-attr]  # EOF: the cold side stops and reports
    report = json.loads(read_protocol_line(proc, "SERVED", STOP_TIMEOUT_S))
    proc.wait(timeout=STOP_TIMEOUT_S)
    return report


def reap_cold(proc: subprocess.Popen) -> None:
    """After a failure: let the cold side close (and unlink) its region, else kill it."""
    if proc.poll() is None:
        if not proc.stdin.closed:  # type: ignore[union-attr]
            proc.stdin.close()  # type: ignore[union-attr]
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    proc.stdout.close()  # type: ignore[union-attr]


# --- the hot side -----------------------------------------------------------------------
def attach_weaving(plan: PairPlan, handle: str) -> HotWeaving:
    """Shared memory is found by the region's name; a CUDA region is opened through the
    IPC handle the cold process exported, its kernels loaded for this process's GPU."""
    return HotWeaving.attach(plan, cuda_handle=bytes.fromhex(handle)
                             if plan.transport == "cuda" else None)


@dataclass
class DecodeRun:
    tokens: list[list[int]]  # per sequence
    logits: list[torch.Tensor]  # per step, [sequences of the step, vocab]
    step_seconds: list[float]


def decode(model: TinyLlama, workload: Workload, weaving: HotWeaving | None,
           before_step: Callable[[int], None] | None = None) -> DecodeRun:
    """before_step(step), if given, runs before each step (the kill of --kill-cold-at-step)."""
    remote = set(workload.remote) if weaving is not None else set()
    sequences = place_sequences(workload.prompts, workload.join_steps, remote,
                                num_blocks_each=workload.num_blocks_each, seed=workload.seed)
    decoder = PagedDecoder(model, sequences, block_size=workload.block_size, weaving=weaving)
    run = DecodeRun([], [], [])
    for step in range(workload.num_steps):
        if before_step is not None:
            before_step(step)
        start = time.perf_counter()
        run.logits.append(decoder.step(step).logits)
        if weaving is not None:
            # As the engine does once per step: device waits that did not end OK were
            # answered by their fallbacks on the stream; this counts them.
            weaving.settle_step()
        run.step_seconds.append(time.perf_counter() - start)
    run.tokens = [s.output for s in sequences]
    return run


def run_pair(args: argparse.Namespace, workload: Workload, plan: PairPlan) -> dict[str, Any]:
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        return decode_pair(args, workload, plan)
    # The cold process keeps one core busy with its own decode; a thread pool that counts
    # on that core stalls at every barrier (measured on 2 cores: 3 ms steps took 800 ms).
    num_threads = torch.get_num_threads()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
    try:
        return decode_pair(args, workload, plan)
    finally:
        torch.set_num_threads(num_threads)


def decode_pair(args: argparse.Namespace, workload: Workload, plan: PairPlan) -> dict[str, Any]:
    device = torch.device(args.device)
    model = TinyLlama(HOT_SHAPE, args.seed, device)
    proc = start_cold(args, plan)
    mapped: set[str] = set()
    try:
        handle = read_protocol_line(proc, "READY", READY_TIMEOUT_S)
        # What the cold process maps or holds open once serving: what a kill leaves behind
        # (its region and doorbells; on a GPU torch's CUDA IPC reference-count file and
        # the driver's cuda.shm.*).
        mapped = shm_files_of_processes([proc.pid])
        off, on, hot_stats = decode_off_and_on(args, model, workload, plan, handle, proc)
        if args.kill_cold_at_step == -1:
            cold_report = stop_cold(proc)
        else:  # it said nothing: what it served before dying is not known
            cold_report = {"num_served": None, "killed_before_step": args.kill_cold_at_step,
                           "exit_code": proc.returncode}
    finally:
        reap_cold(proc)
        # the hot side's views of the region went with decode_off_and_on
        unlink_left_over(mapped)
    return summarize(args, workload, plan, off, on, hot_stats, cold_report)


def decode_off_and_on(args: argparse.Namespace, model: TinyLlama, workload: Workload,
                      plan: PairPlan, handle: str,
                      proc: subprocess.Popen) -> tuple[DecodeRun, DecodeRun, dict[str, Any]]:
    """Both runs while the cold side decodes its own batch (the same load on the machine,
    offload on or off); the hot side lets go of the region before returning."""
    device = torch.device(args.device)
    weaving = attach_weaving(plan, handle)
    off = decode(model, workload, None)

    def kill_cold(step: int) -> None:
        if step == args.kill_cold_at_step:
            proc.kill()  # SIGKILL: no close, no unlink, nothing said to the hot side
            proc.wait(timeout=STOP_TIMEOUT_S)

    on = decode(model, workload, weaving, kill_cold)
    hot_stats = weaving.drain_stats()
    weaving.sender.close()  # the hot side lets go of the region before its owner frees it
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return off, on, hot_stats


# --- figures ----------------------------------------------------------------------------
def summarize(args: argparse.Namespace, workload: Workload, plan: PairPlan, off: DecodeRun,
              on: DecodeRun, hot_stats: dict[str, Any], cold: dict[str, Any]) -> dict[str, Any]:
    num_offloaded = hot_stats["offloaded_tasks"]
    num_fallbacks = hot_stats["fallback_tasks"]
    failures = []
    if on.tokens != off.tokens:
        failures.append("greedy tokens differ with offload on")
    if args.kill_cold_at_step != -1:
        # The cold side dies mid-run: the pair must degrade and the hot side take over.
        if not num_fallbacks:
            failures.append("no remote row was computed by the hot side after the kill")
        if not hot_stats["degraded_reason"]:
            failures.append("the pair did not turn degraded after its cold side died")
        if not num_offloaded:
            failures.append("no task was served before the kill")
    else:
        if cold["num_served"] == 0:
            failures.append("the cold side served no task: nothing was offloaded")
        if cold["num_served"] != workload.num_tasks or num_offloaded != workload.num_tasks:
            failures.append(f"{workload.num_tasks} tasks published, the hot side collected "
                            f"{num_offloaded}, the cold side served {cold['num_served']}")
        if num_fallbacks or hot_stats["degraded_reason"]:
            failures.append(f"{num_fallbacks} tasks fell back to the hot side "
                            f"({hot_stats['degraded_reason']})")
    margins = [top2[:, 0] - top2[:, 1] for top2 in (x.topk(2).values for x in off.logits)]
    return {
        "ok": not failures, "failures": failures,
        "tokens_equal": on.tokens == off.tokens,
        "num_tasks_expected": workload.num_tasks,
        "num_tasks_served": cold["num_served"],
        "num_tasks_collected": num_offloaded,
        "num_fallbacks": num_fallbacks,
        "num_remote_prefill_rows": hot_stats["remote_prefill_rows"],
        "cold": cold,
        # How close the greedy picks were, and how far offload moved the logits.
        "min_logit_margin": float(torch.cat(margins).min()),
        "max_logit_abs_diff": max(float((a - b).abs().max())
                                  for a, b in zip(off.logits, on.logits, strict=True)),
        "step_ms": {"off": [s * 1e3 for s in off.step_seconds],
                    "on": [s * 1e3 for s in on.step_seconds]},
        "median_step_ms": {"off": statistics.median(off.step_seconds) * 1e3,
                           "on": statistics.median(on.step_seconds) * 1e3},
        "mean_wait_us": statistics.fmean(hot_stats["wait_seconds"]) * 1e6
        if hot_stats["wait_seconds"] else None,
        "tokens_off": off.tokens, "tokens_on": on.tokens,
        "config": {**{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                   "hot_shape": asdict(HOT_SHAPE), "cold_shape": asdict(COLD_SHAPE),
                   "region_name": plan.region_name, "remote": sorted(workload.remote),
                   "torch": torch.__version__,
                   "gpu": torch.cuda.get_device_name(torch.device(args.device))
                   if args.transport == "cuda" else None},
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    reason = unavailable_reason(args)
    if reason:
        print(f"cannot run: {reason}", file=sys.stderr)
        return 2
    workload = make_workload(args)
    figures = run_pair(args, workload, make_plan(args, workload))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(figures, indent=1))
    median = figures["median_step_ms"]
    served = figures["num_tasks_served"]
    served_text = (f"{served} of {figures['num_tasks_expected']}" if served is not None else
                   f"unknown, killed before step {args.kill_cold_at_step} "
                   f"({figures['num_tasks_collected']} collected)")  # fmt: skip
    print(f"tokens equal (offload on vs off): {figures['tokens_equal']}; tasks served by the "
          f"cold side: {served_text}; "
          f"fallbacks: {figures['num_fallbacks']}; median step ms off {median['off']:.2f} / "
          f"on {median['on']:.2f}")
    for failure in figures["failures"]:
        print(f"FAILED: {failure}", file=sys.stderr)
    return 0 if figures["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
