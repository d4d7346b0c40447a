"""Node-local directories that independent processes share: a weaving pair's rendezvous
files (weaver/weaving/rendezvous.py) and a mux group's turn tables (weaver/mux/table.py)
under plain `vllm serve`, where no gateway owns them.

The first process that writes makes its directory; the last one out removes it once it is
empty (weaver/vllm_ext/plain_serve.py, at a server's exit). Removing is `rmdir`, which
takes only an empty directory and is atomic, so it never takes another process's file;
a writer that finds its directory gone between making it and creating its file makes it
again (`create_in`). A directory the user named in WEAVER_RUNTIME_DIR is theirs and stays.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

RUNTIME_DIR_ENV = "WEAVER_RUNTIME_DIR"
# A directory removed between mkdir and the create is one race; several in a row would
# take as many servers stopping within microseconds of each other.
CREATE_ATTEMPTS = 5

T = TypeVar("T")


def shared_dir(kind: str) -> Path:
    """The user's WEAVER_RUNTIME_DIR, else `/dev/shm/weaver-<kind>-<uid>` (memory: the
    files are small and read on every turn or link)."""
    configured = os.environ.get(RUNTIME_DIR_ENV)
    return Path(configured) if configured else Path(f"/dev/shm/weaver-{kind}-{os.getuid()}")


def create_in(directory: Path, create: Callable[[], T]) -> T:
    """`create()` (which makes a file in `directory`) once the directory exists, making
    it again when another process removed it, empty, in between."""
    for attempt in range(CREATE_ATTEMPTS):
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            return create()
        except FileNotFoundError:
            if directory.exists() or attempt == CREATE_ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable")


def remove_if_empty(directory: Path) -> bool:
    """rmdir `directory` when it is empty; False when it holds something or is gone."""
    try:
        directory.rmdir()
    except OSError:
        return False
    return True


def remove_default_if_empty(kind: str) -> bool:
    """Remove Weaver's default directory of `kind` once it is empty; one the user named in
    WEAVER_RUNTIME_DIR stays."""
    return not os.environ.get(RUNTIME_DIR_ENV) and remove_if_empty(shared_dir(kind))
