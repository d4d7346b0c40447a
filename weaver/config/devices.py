"""Where each engine runs: a model's `device` mapped to what its vLLM engine takes, and the
checks a deployment's devices must pass before any engine starts.

vLLM 0.32 has no device argument for a single-GPU engine: its worker takes ``cuda:0`` of
whatever the process sees, so a model on ``cuda:N`` gets ``CUDA_VISIBLE_DEVICES`` naming
that GPU first. A hot engine also sees the GPUs of its cold models (listed after its own):
it opens their offload regions through CUDA IPC and writes K/V into them, and a process
can only map memory of a GPU it can see.

Memory: on a GPU, vLLM's worker refuses to start unless the GPU's free memory covers
``gpu_memory_utilization`` of its total (``vllm/v1/worker/utils.py`` ``request_memory``),
whatever ``--kv-cache-memory-bytes`` says. Two engines on one GPU therefore each state
their whole budget (``gpu_memory_gib``: weights, activations, their KV and what a cold
model lends) and the engine gets it as a fraction of the GPU.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from weaver.config.deployment import Deployment, ModelSpec

logger = logging.getLogger(__name__)

GiB = 1 << 30
# What a CUDA context and vLLM's non-torch allocations (NCCL, cuBLAS workspaces) hold per
# process outside any budget: about 0.5 GiB on an H100 with CUDA 12/13 (measured by vLLM's
# own start-up log, "non-torch memory"); one engine has two processes with a context.
CONTEXT_RESERVE_GIB = 1.0
# Activations and sampler buffers of a small batch, when a budget is derived, not stated.
ACTIVATION_HEADROOM_GIB = 2.0
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")
VISIBLE_DEVICES_ENV = "CUDA_VISIBLE_DEVICES"


@dataclass(frozen=True)
class GpuInventory:
    """The GPUs this process can see, in CUDA's order (``cuda:N`` is index N)."""

    total_bytes: tuple[int, ...]
    names: tuple[str, ...] = ()

    @property
    def count(self) -> int:
        return len(self.total_bytes)


def cuda_index(device: str) -> int | None:
    """N of 'cuda:N'; None for 'cpu'."""
    return int(device.split(":", 1)[1]) if device.startswith("cuda:") else None


def probe_gpus() -> GpuInventory:
    """The GPUs visible here: through torch when it has CUDA, else nvidia-smi (a CPU build
    of torch beside a GPU), else none."""
    try:
        import torch

        if torch.cuda.is_available():
            props = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
            return GpuInventory(tuple(p.total_memory for p in props),
                                tuple(p.name for p in props))
    except ImportError:
        pass
    return _probe_with_nvidia_smi()


def _probe_with_nvidia_smi() -> GpuInventory:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return GpuInventory(())
    try:
        out = subprocess.run([smi, "--query-gpu=index,memory.total,name",
                              "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("nvidia-smi is installed but failed (%s): treating this machine as "
                       "having no GPU", exc)
        return GpuInventory(())
    rows = [[field.strip() for field in line.split(",", 2)] for line in out.splitlines()
            if line.strip()]
    by_index = {int(index): (int(float(mib)) << 20, name) for index, mib, name in rows}
    # nvidia-smi numbers every GPU of the machine; CUDA only the visible ones, in this order.
    order = _visible_order(os.environ.get(VISIBLE_DEVICES_ENV), len(by_index))
    picked = [by_index[i] for i in order if i in by_index]
    return GpuInventory(tuple(b for b, _ in picked), tuple(n for _, n in picked))


def _visible_order(visible: str | None, num_gpus: int) -> list[int]:
    if visible is None:
        return list(range(num_gpus))
    return [int(entry) for entry in _visible_entries(visible) if entry.isdigit()]


def _visible_entries(visible: str) -> list[str]:
    """The entries (GPU numbers or UUIDs) of a CUDA_VISIBLE_DEVICES value, in order."""
    return [item.strip() for item in visible.split(",") if item.strip()]


def physical_gpu_ids(indices: list[int], visible: str | None) -> str:
    """CUDA_VISIBLE_DEVICES for a child that must see this process's `cuda:N` for each N
    of `indices` (in that order): this process's own CUDA_VISIBLE_DEVICES, if set, already
    renumbered the GPUs, so its entries (numbers or UUIDs) are passed through."""
    if visible is None:
        return ",".join(str(i) for i in indices)
    entries = _visible_entries(visible)
    missing = [i for i in indices if i >= len(entries)]
    if missing:
        raise ValueError(f"cuda:{missing[0]} is not visible: {VISIBLE_DEVICES_ENV}="
                         f"{visible!r} shows {len(entries)} GPU(s) to Weaver")
    return ",".join(entries[i] for i in indices)


def engine_gpus(spec: ModelSpec, deployment: Deployment) -> list[int]:
    """The GPUs (this process's numbering) the engine of `spec` must see: its own first,
    then, for a hot model, its cold models' (their regions are mapped into it)."""
    own = cuda_index(spec.device)
    if own is None:
        return []
    gpus = [own]
    for pair in deployment.weaving:
        if pair.hot == spec.name:
            for cold in pair.cold:
                index = cuda_index(deployment.model(cold).device)
                if index is not None and index not in gpus:
                    gpus.append(index)
    return gpus


@dataclass(frozen=True)
class EnginePlacement:
    """What the device of one model turns into for its vLLM engine."""

    environment: dict[str, str]  # inherited by the engine's processes
    cli_args: tuple[str, ...] = ()  # `vllm serve` arguments that follow from the device

    @classmethod
    def on_cpu(cls, spec: ModelSpec) -> EnginePlacement:
        return cls({"VLLM_CPU_OMP_THREADS_BIND": spec.cpu_cores} if spec.cpu_cores else {})


def _place_engine(spec: ModelSpec, deployment: Deployment, gpus: GpuInventory,
                  weights: int) -> EnginePlacement:
    """The environment and vLLM arguments of `spec`'s engine, on a device check_devices
    accepted; `weights`: bytes of its weights (for a budget that is not stated)."""
    if spec.device == "cpu":
        return EnginePlacement.on_cpu(spec)
    index = cuda_index(spec.device)
    visible = physical_gpu_ids(engine_gpus(spec, deployment),
                               os.environ.get(VISIBLE_DEVICES_ENV))
    utilization = gpu_memory_utilization(spec, weights, gpus.total_bytes[index])
    return EnginePlacement({VISIBLE_DEVICES_ENV: visible},
                           ("--gpu-memory-utilization", str(utilization)))


def weight_bytes(model_dir: Path) -> int:
    """Bytes of the weight files of a Hugging Face model directory (what the GPU holds of
    them at the checkpoint's dtype; an estimate when the engine casts to another)."""
    return sum(f.stat().st_size for f in model_dir.iterdir()
               if f.is_file() and f.name.endswith(WEIGHT_SUFFIXES))


def budget_gib(spec: ModelSpec, weights: int) -> float:
    """The engine's whole budget on its GPU: stated, or weights + KV + lent + headroom."""
    if spec.gpu_memory_gib is not None:
        return spec.gpu_memory_gib
    return weights / GiB + spec.kv_cache_gib + spec.lend_kv_gib + ACTIVATION_HEADROOM_GIB


def gpu_memory_utilization(spec: ModelSpec, weights: int, gpu_total_bytes: int) -> float:
    """vLLM's --gpu-memory-utilization for this engine: its budget without what Weaver lends
    (the region is allocated outside vLLM, after its KV cache) as a share of the GPU."""
    vllm_gib = budget_gib(spec, weights) - spec.lend_kv_gib
    return round(vllm_gib * GiB / gpu_total_bytes, 4)


def check_devices(deployment: Deployment, gpus: GpuInventory,
                  weights: dict[str, int]) -> list[str]:
    """Every reason the deployment's devices cannot work on this machine, each saying the
    fix; empty when they can. `weights`: bytes of each model's weights (by model name),
    where known."""
    problems: list[str] = []
    on_gpu = [spec for spec in deployment.models if spec.device != "cpu"]
    if on_gpu and gpus.count == 0:
        names = ", ".join(f"{s.name} ({s.device})" for s in on_gpu)
        return [f"{names}: this machine has no visible GPU (no CUDA device, no nvidia-smi); "
                "set device: cpu, or run on a machine with a GPU"]
    by_gpu: dict[int, list[ModelSpec]] = {}
    for spec in on_gpu:
        index = cuda_index(spec.device)
        if index >= gpus.count:
            problems.append(f"model {spec.name!r}: device {spec.device} does not exist here "
                            f"(visible GPUs: cuda:0-cuda:{gpus.count - 1})")
            continue
        by_gpu.setdefault(index, []).append(spec)
        need = weights.get(spec.name, 0) / GiB + spec.kv_cache_gib + spec.lend_kv_gib
        if spec.gpu_memory_gib is not None and spec.gpu_memory_gib < need:
            problems.append(
                f"model {spec.name!r}: gpu_memory_gib {spec.gpu_memory_gib} is less than its "
                f"weights + kv_cache_gib + lend_kv_gib ({need:.2f} GiB) before activations; "
                "raise gpu_memory_gib or lower kv_cache_gib")
    for index, specs in sorted(by_gpu.items()):
        total_gib = gpus.total_bytes[index] / GiB
        budgets = {s.name: budget_gib(s, weights.get(s.name, 0)) for s in specs}
        reserve = CONTEXT_RESERVE_GIB * len(specs)
        if sum(budgets.values()) + reserve > total_gib:
            parts = " + ".join(f"{name} {gib:.2f}" for name, gib in budgets.items())
            problems.append(
                f"cuda:{index} has {total_gib:.1f} GiB; its engines' budgets ({parts} GiB) "
                f"and {reserve:.1f} GiB of CUDA contexts do not fit; lower gpu_memory_gib, "
                "kv_cache_gib or lend_kv_gib, or move a model to another GPU")
    return problems


def place_engines(deployment: Deployment, model_dirs: dict[str, Path],
                  gpus: GpuInventory | None = None) -> dict[str, EnginePlacement]:
    """Every engine's placement, by model name, after check_devices against `gpus` (this
    machine's, probed, when None); ValueError listing every problem. A deployment of cpu
    engines probes nothing."""
    if all(spec.device == "cpu" for spec in deployment.models):
        return {spec.name: EnginePlacement.on_cpu(spec) for spec in deployment.models}
    gpus = probe_gpus() if gpus is None else gpus
    weights = {name: weight_bytes(path) for name, path in model_dirs.items()}
    problems = check_devices(deployment, gpus, weights)
    if problems:
        raise ValueError("the deployment's devices cannot work here:\n"
                         + "\n".join(f"  - {p}" for p in problems))
    return {spec.name: _place_engine(spec, deployment, gpus, weights.get(spec.name, 0))
            for spec in deployment.models}
