"""Which /dev/shm files processes hold (weaver/processes.py): what the server harness and
the gateway unlink after a process that could not is found this way."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

from weaver.processes import shm_files_of, shm_in_use


def test_a_mapped_segment_and_an_open_file_are_held_and_then_not():
    mapped, opened = (Path(f"/dev/shm/weaver-test-{os.getpid()}-{kind}")
                      for kind in ("mapped", "open"))
    try:
        mapped.write_bytes(b"\0" * 4096)
        with open(mapped, "r+b") as backing:
            view = mmap.mmap(backing.fileno(), 4096)
        with open(opened, "wb") as held:
            mine = shm_files_of(os.getpid())
            assert {str(mapped), str(opened)} <= mine
            assert {str(mapped), str(opened)} <= shm_in_use()
        view.close()
        assert not {str(mapped), str(opened)} & shm_files_of(os.getpid())
        assert held.closed
    finally:
        mapped.unlink(missing_ok=True)
        opened.unlink(missing_ok=True)
