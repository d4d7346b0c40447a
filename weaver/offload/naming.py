"""Names of offload regions, derived from configuration (never hard-coded).

Pure Python: the deployment spec and the scheduler can compute the names without torch.
"""

from __future__ import annotations

import hashlib
import os
import re

DEFAULT_SHM_DIR = "/dev/shm"  # where Linux shm_open puts POSIX shared memory
TASK_FIFO_SUFFIX = ".task"  # hot -> cold doorbell
DONE_FIFO_SUFFIX = ".done"  # cold -> hot doorbell
_MAX_NAME_CHARS = 200  # NAME_MAX is 255; leave room for the FIFO suffixes
_UNSAFE_CHARS = re.compile(r"[^A-Za-z0-9_.-]+")


# What a process puts in /dev/shm is named after its pid, so that a server starting later
# tells a dead owner's leftovers from a living one's (weaver/vllm_ext/engine/leftovers.py):
# a cold worker's regions, a gateway's own files (its pairs' directory, the unified pools
# it plans) and a gateway's KV staging segments.
def cold_region_prefix(pid: int, index: int) -> str:
    return f"wv{pid}r{index}"


def gateway_prefix(pid: int) -> str:
    return f"weaver{pid}"


def staging_prefix(pid: int) -> str:
    return f"wvkv_{pid}_"


_OWNED_NAME = re.compile(r"^(?:wv(\d+)r\d+-|weaver(\d+)-|wvkv_(\d+)_)")


def owner_pid(name: str) -> int | None:
    """The pid a /dev/shm name of one of the families above carries; None for others."""
    match = _OWNED_NAME.match(name)
    return None if match is None else int(next(g for g in match.groups() if g))


def region_name(prefix: str, hot_model: str, cold_model: str) -> str:
    """A file-safe region name from configuration: ``<prefix>-<hot>-<cold>-<hash8>``.

    Model names like ``meta-llama/Llama-3-8B`` are sanitised; the hash of the raw names
    keeps two pairs apart when sanitising makes them look the same.
    """
    for label, value in (("prefix", prefix), ("hot_model", hot_model), ("cold_model", cold_model)):
        if not value or not value.strip():
            raise ValueError(f"region_name: {label} must be a non-empty string")
    digest = hashlib.sha256(f"{prefix}\0{hot_model}\0{cold_model}".encode()).hexdigest()[:8]
    parts = [
        _UNSAFE_CHARS.sub("_", part).strip("._") or "x" for part in (prefix, hot_model, cold_model)
    ]
    name = "-".join(parts)[: _MAX_NAME_CHARS - 9]
    return f"{name}-{digest}"


def validate_region_name(name: str) -> None:
    is_unsafe = _UNSAFE_CHARS.search(name) or name.startswith(".")
    if not name or is_unsafe or len(name) > _MAX_NAME_CHARS:
        raise ValueError(
            f"invalid shared-memory region name {name!r}: use region_name(prefix, hot, cold) "
            f"or at most {_MAX_NAME_CHARS} characters from [A-Za-z0-9_.-]"
        )


def region_paths(name: str, shm_dir: str = DEFAULT_SHM_DIR) -> list[str]:
    """Every filesystem entry a region of this name uses (for cleanup checks)."""
    path = os.path.join(shm_dir, name)
    return [path, path + TASK_FIFO_SUFFIX, path + DONE_FIFO_SUFFIX]
