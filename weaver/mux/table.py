"""The turn table of one colocated group: a small shared file that the group's engines,
each in its own process, read and write under an exclusive ``flock`` to take turns
(weaver/mux/turns.py says whose turn it is).

Why a file lock: the engines are separate vLLM processes started independently (by the
gateway or by plain ``vllm serve``), and the lock must go away with a process that dies
holding it: the kernel drops a dead process's ``flock``. A member that died *running* (its
turn taken, never given back) is found by its pid and its turn reclaimed, counted in
``num_reclaimed``; nobody waits behind a dead engine.

Layout (native byte order, fixed size): a header, then one record per member in the
group's order. Counters live here too, so the gateway's /metrics reads them without asking
the engines.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from weaver.mux.turns import DEFAULT_SKIP_LIMIT, Kind, Member, Mode, next_turn
from weaver.processes import is_process_alive
from weaver.runtime_dirs import create_in, remove_default_if_empty, shared_dir

logger = logging.getLogger(__name__)

MAGIC = 0x57584D31  # "WXM1"
MAX_MEMBERS = 16
NAME_BYTES = 96
# magic, num_members, mode (0 temporal, 1 spatial-temporal), skip_limit, num_grants
_HEADER = struct.Struct("=IIIIQ")
# One member's record, the fields of _Record in order.
_RECORD = struct.Struct("=qIIIxxxxddQQQQdQQ")
_KINDS = (None, Kind.DECODE, Kind.PREFILL)
_MODES = (Mode.TEMPORAL, Mode.SPATIAL_TEMPORAL)
# How long a waiter sleeps between looks: well under a CPU engine's step (10-100 ms), and
# a look costs one flock and a few struct reads.
POLL_S = 0.0002


def default_runtime_dir() -> Path:
    return shared_dir("mux")


def table_path(group: str, runtime_dir: Path | None = None) -> Path:
    return (runtime_dir or default_runtime_dir()) / f"{group}.turns"


def remove_table(group: str) -> None:
    """Unlink the group's table, and the default runtime directory once it is empty (one a
    user named in WEAVER_RUNTIME_DIR stays)."""
    with contextlib.suppress(FileNotFoundError):
        table_path(group).unlink()
    remove_default_if_empty("mux")


@dataclass(frozen=True)
class GroupLayout:
    """What every member of a group must agree on to share its table."""

    group: str
    members: tuple[str, ...]
    weights: tuple[float, ...]
    mode: Mode
    skip_limit: int = DEFAULT_SKIP_LIMIT

    def __post_init__(self) -> None:
        if not 1 <= len(self.members) <= MAX_MEMBERS:
            raise ValueError(f"mux group {self.group!r}: {len(self.members)} members; a group "
                             f"has 1-{MAX_MEMBERS}")
        if len(self.weights) != len(self.members) or min(self.weights) <= 0:
            raise ValueError(f"mux group {self.group!r}: one positive weight per member")
        if self.skip_limit < 1:
            raise ValueError(f"mux group {self.group!r}: skip_limit must be >= 1")

    def index(self, member: str) -> int:
        try:
            return self.members.index(member)
        except ValueError:
            raise ValueError(f"{member!r} is not a member of mux group {self.group!r} "
                             f"({list(self.members)})") from None

    def _names_block(self) -> bytes:
        text = "\n".join(self.members).encode()
        if len(text) > NAME_BYTES * MAX_MEMBERS:
            raise ValueError(f"mux group {self.group!r}: member names too long")
        return text.ljust(NAME_BYTES * MAX_MEMBERS, b"\0")


class _Record(NamedTuple):
    pid: int  # the process that asks or runs
    waiting: int  # the kind of step it asks for: an index of _KINDS (0: not asking)
    running: int  # the kind of step it runs: an index of _KINDS (0: not running)
    skips: int  # turns given to others while it waited
    weight: float
    served_s: float  # time its steps held their turn
    wait_since_ns: int
    num_prefill_steps: int
    num_decode_steps: int
    num_overlapped: int
    wait_s: float
    num_reclaimed: int
    running_since_ns: int


@dataclass(frozen=True)
class MemberCounters:
    """One member's counters, as the gateway's /metrics reports them."""

    name: str
    num_prefill_steps: int
    num_decode_steps: int
    num_overlapped: int  # steps started beside another model's (spatial-temporal)
    wait_s: float  # total time its steps waited for their turn
    served_s: float
    num_reclaimed: int  # turns taken back from this member after it died running


class TurnTable:
    """One process's view of a group's table; open with ``TurnTable.open``."""

    def __init__(self, path: Path, layout: GroupLayout, fd: int, view: mmap.mmap) -> None:
        self.path, self.layout, self._fd, self._view = path, layout, fd, view
        self._names_at = _HEADER.size
        self._records_at = self._names_at + NAME_BYTES * MAX_MEMBERS

    @classmethod
    def open(cls, layout: GroupLayout, runtime_dir: Path | None = None) -> TurnTable:
        """Open (or create) the group's table. A table left by earlier engines is reset when
        none of its members is alive; one whose live members disagree on the group is
        refused (ValueError saying which file)."""
        path = table_path(layout.group, runtime_dir)
        size = _HEADER.size + NAME_BYTES * MAX_MEMBERS + _RECORD.size * MAX_MEMBERS
        fd = create_in(path.parent, lambda: os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                if os.fstat(fd).st_size != size:
                    os.ftruncate(fd, size)
                view = mmap.mmap(fd, size)
                table = cls(path, layout, fd, view)
                table._adopt_or_reset()
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        except BaseException:
            os.close(fd)
            raise
        return table

    def close(self) -> None:
        with contextlib.suppress(ValueError, OSError):
            self._view.close()
        with contextlib.suppress(OSError):
            os.close(self._fd)

    # --- the header and records ----------------------------------------------------
    def _adopt_or_reset(self) -> None:
        magic, num, _, _, _ = _HEADER.unpack_from(self._view, 0)
        same = (magic == MAGIC and num == len(self.layout.members)
                and bytes(self._view[self._names_at:self._records_at])
                == self.layout._names_block())
        live = [pid for pid in (self._get(i).pid for i in range(num if magic == MAGIC else 0))
                if is_process_alive(pid)]
        if same:
            self._write_settings()
            return
        if live:
            raise ValueError(f"{self.path}: live engines (pids {live}) use this mux group "
                             "with other members; give the group another name or stop them")
        self._view[:] = b"\0" * len(self._view)
        self._view[self._names_at:self._records_at] = self.layout._names_block()
        self._write_settings()
        logger.info("mux group %s: new turn table %s for %s (%s)", self.layout.group,
                    self.path, list(self.layout.members), self.layout.mode.value)

    def _write_settings(self) -> None:
        _, _, _, _, grants = _HEADER.unpack_from(self._view, 0)
        _HEADER.pack_into(self._view, 0, MAGIC, len(self.layout.members),
                          _MODES.index(self.layout.mode), self.layout.skip_limit, grants)
        for i, weight in enumerate(self.layout.weights):
            self._put(i, self._get(i)._replace(weight=weight))

    def _get(self, index: int) -> _Record:
        return _Record._make(_RECORD.unpack_from(self._view,
                                                 self._records_at + index * _RECORD.size))

    def _put(self, index: int, record: _Record) -> None:
        _RECORD.pack_into(self._view, self._records_at + index * _RECORD.size, *record)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _members(self) -> list[Member]:
        out = []
        for i in range(len(self.layout.members)):
            r = self._get(i)
            out.append(Member(i, r.weight, r.served_s, _KINDS[r.waiting], _KINDS[r.running],
                              r.skips, r.wait_since_ns))
        return out

    def _reclaim_dead(self) -> None:
        for i in range(len(self.layout.members)):
            record = self._get(i)
            if (record.waiting or record.running) and not is_process_alive(record.pid):
                if record.running:
                    logger.warning("mux group %s: %s died during its step; its turn is "
                                   "taken back", self.layout.group, self.layout.members[i])
                self._put(i, record._replace(
                    waiting=0, running=0,
                    num_reclaimed=record.num_reclaimed + int(bool(record.running))))

    # --- taking turns --------------------------------------------------------------
    def try_start(self, index: int, kind: Kind) -> bool:
        """Ask for a turn (or go on asking); True when the step of member `index` may run
        now: the caller then runs it and calls ``finish``."""
        now = time.monotonic_ns()
        with self._locked():
            record = self._get(index)
            if not record.waiting:
                self._put(index, record._replace(pid=os.getpid(), waiting=_KINDS.index(kind),
                                                 wait_since_ns=now))
            self._reclaim_dead()
            _, num, mode, skip_limit, grants = _HEADER.unpack_from(self._view, 0)
            members = self._members()
            if next_turn(members, _MODES[mode], skip_limit) != index:
                return False
            beside = any(m.running is not None for m in members)
            for other in members:
                if other.waiting is not None and other.index != index:
                    self._put(other.index, self._get(other.index)._replace(skips=other.skips + 1))
            record = self._get(index)
            is_prefill = kind is Kind.PREFILL
            self._put(index, record._replace(
                waiting=0, running=_KINDS.index(kind), skips=0,
                num_prefill_steps=record.num_prefill_steps + int(is_prefill),
                num_decode_steps=record.num_decode_steps + int(not is_prefill),
                num_overlapped=record.num_overlapped + int(beside),
                wait_s=record.wait_s + (now - record.wait_since_ns) / 1e9,
                running_since_ns=now))
            _HEADER.pack_into(self._view, 0, MAGIC, num, mode, skip_limit, grants + 1)
            return True

    def start(self, index: int, kind: Kind) -> None:
        """Wait for the member's turn."""
        while not self.try_start(index, kind):
            time.sleep(POLL_S)

    def finish(self, index: int) -> None:
        """The member's step is over: its time counts as service, the turn is free."""
        now = time.monotonic_ns()
        with self._locked():
            record = self._get(index)
            if record.running:
                self._put(index, record._replace(
                    running=0,
                    served_s=record.served_s + (now - record.running_since_ns) / 1e9))

    # --- reading -------------------------------------------------------------------
    def counters(self) -> list[MemberCounters]:
        with self._locked():
            records = [self._get(i) for i in range(len(self.layout.members))]
        return [MemberCounters(name, r.num_prefill_steps, r.num_decode_steps, r.num_overlapped,
                               r.wait_s, r.served_s, r.num_reclaimed)
                for name, r in zip(self.layout.members, records, strict=True)]

    def running(self) -> list[tuple[int, Kind]]:
        """Who runs now (index, kind): what the invariant tests check."""
        with self._locked():
            return [(m.index, m.running) for m in self._members() if m.running is not None]
