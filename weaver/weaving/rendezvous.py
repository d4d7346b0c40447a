"""How the two engines of a weaving pair find each other.

Under either launcher a hot and a cold engine on one node meet by the pair name they were
both given, through small JSON files in a runtime directory (under plain `vllm serve`, with
Weaver's plugin: $WEAVER_RUNTIME_DIR, default /dev/shm/weaver-pairs-<uid>; under `weaver
serve`, a directory of the gateway's own, weaver/server/weaving.py):
- `<pair>.hot.json`: the hot engine's plan (weaver/weaving/plan.py) and its process id;
- `<pair>.cold.json`: the cold engine's answer: the region it created for that plan (or
  why it refused it) and its process id;
- `<pair>.<side>.stats.json`: each side's counters, for /metrics and /health.
Each file is written whole (a temporary file renamed over it), so a reader never sees half
of one; a file whose process is gone is treated as absent, so either engine may start first,
die or restart. Pure Python: no vLLM, no torch.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from weaver.processes import is_process_alive
from weaver.runtime_dirs import create_in, shared_dir

logger = logging.getLogger(__name__)

SIDES = ("hot", "cold")
_PAIR_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def check_pair_name(name: Any) -> str:
    if not isinstance(name, str) or not _PAIR_NAME_RE.match(name):
        raise ValueError(f"weaving pair name {name!r} must be 1-64 letters, digits, '.', "
                         "'_' or '-', starting with a letter or digit (both engines of the "
                         "pair give the same one)")
    return name


def runtime_dir() -> Path:
    """Where the pairs' files live under plain `vllm serve`: one node-local directory per
    user, removed once empty by the last server out (weaver/runtime_dirs.py)."""
    return shared_dir("pairs")


def is_alive(pid: Any) -> bool:
    """Whether a file's writer, by the process id it wrote (any JSON value), still runs."""
    return isinstance(pid, int) and is_process_alive(pid)


@dataclass(frozen=True)
class PairFiles:
    """The pairs' files in one directory: `runtime_dir()` under plain `vllm serve`, a
    directory of its own under each `weaver serve` (its pairs' names are its own)."""

    root: Path

    def path(self, pair: str, name: str) -> Path:
        return self.root / f"{check_pair_name(pair)}.{name}.json"

    def publish(self, pair: str, name: str, data: dict[str, Any]) -> None:
        """Write `<pair>.<name>.json` whole, with this process's id."""
        path = self.path(pair, name)
        temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        # The directory is made by the first writer (and again if the last server out
        # removed it meanwhile).
        text = json.dumps({**data, "pid": os.getpid()})
        create_in(path.parent, lambda: temporary.write_text(text))
        os.replace(temporary, path)

    def read(self, pair: str, name: str) -> dict[str, Any] | None:
        """`<pair>.<name>.json`, or None when it is missing, unreadable or its process is
        gone."""
        data = self.read_even_if_dead(pair, name)
        return data if data is not None and is_alive(data.get("pid")) else None

    def read_even_if_dead(self, pair: str, name: str) -> dict[str, Any] | None:
        """The file whatever became of its writer (a successor cleans up after a dead one)."""
        try:
            data = json.loads(self.path(pair, name).read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def remove_dead_writers_files(self) -> list[Path]:
        """Remove every pair's file whose writer is gone (a worker killed before it could
        withdraw it: vLLM's default --shutdown-timeout 0 kills it on SIGTERM); a successor
        writes its own. Returns what was removed."""
        removed = []
        for path in sorted(self.root.glob("*.json")):
            try:
                data = json.loads(path.read_text())
            except (OSError, ValueError):
                continue  # removed meanwhile, or not one of ours
            if isinstance(data, dict) and not is_alive(data.get("pid")):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                    removed.append(path)
        return removed

    def withdraw(self, pair: str, name: str) -> None:
        """Remove `<pair>.<name>.json` if this process wrote it (a successor's stays)."""
        data = self.read_even_if_dead(pair, name)
        if data is not None and data.get("pid") == os.getpid():
            with contextlib.suppress(FileNotFoundError):
                self.path(pair, name).unlink()
