"""Which /dev/shm files processes hold (weaver/processes.py): what the server harness and
the gateway unlink after a process that could not is found this way."""

from __future__ import annotations

import mmap
import multiprocessing
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


def test_a_semaphore_is_found_by_its_name_though_mapped_under_another():
    # sem_open maps a temporary file, since unlinked, linked to the semaphore's name.
    lock = multiprocessing.get_context("spawn").Lock()
    path = f"/dev/shm/sem.{lock._semlock.name.lstrip('/')}"  # noqa: SLF001
    assert os.path.exists(path)
    assert path in shm_files_of(os.getpid()) and path in shm_in_use()


def test_what_a_process_keeps_is_what_it_maps_and_the_pipes_it_holds():
    """A regular file it has open without mapping it (a weaving pair's JSON being read)
    is not among what it would leave behind: the harness once unlinked a cold engine's
    answer that a stopping hot engine happened to be reading."""
    mapped, fifo, read = (Path(f"/dev/shm/weaver-test-{os.getpid()}-{kind}")
                          for kind in ("mapped", "fifo", "read"))
    try:
        mapped.write_bytes(b"\0" * 4096)
        read.write_text("{}")
        os.mkfifo(fifo, 0o600)
        doorbell = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)
        with open(mapped, "r+b") as backing, mmap.mmap(backing.fileno(), 4096), open(read):
            kept = shm_files_of(os.getpid(), kept_only=True)
            assert {str(mapped), str(fifo)} <= kept and str(read) not in kept
            assert str(read) in shm_files_of(os.getpid())  # held now: not to be unlinked
        os.close(doorbell)
    finally:
        for path in (mapped, fifo, read):
            path.unlink(missing_ok=True)
