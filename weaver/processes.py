"""Whether a process still runs: for the owners of shared regions (weaver.offload.shm) and of
half-built model folders (weaver.models.store), whose leftovers may be reclaimed once they
are gone. Pure Python."""

from __future__ import annotations

import os


def is_process_alive(pid: int) -> bool:
    """True if pid runs and is not a zombie (a dead child not yet reaped still has a pid)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            # the state letter follows the ")" that closes the command name
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (OSError, IndexError):
        return True  # no procfs: trust kill(0)
