"""The cold side of weaving: the regions a cold worker owns and how their tasks are served
(Weaver §3; docs/architecture.md, "The weaving path").

A cold worker creates and owns one region per hot model weaving into it. On a GPU its
tasks are served by the region's armed server (weaver/offload/cuda/armed_server.py), from
a high-priority stream, concurrently with the cold model's kernels; poll points and the
idle poller do nothing for such a region but stamp its heartbeat. In shared memory tasks
are served
- at poll points, right after each of the cold model's own operators (poll_points.py) and
  between the chunks of a split operator, on the model's thread, inside its step;
- between steps, by the one idle poller thread over all the regions, which sleeps on their
  doorbells, so an idle cold engine still answers within a bounded delay (the only idle
  poller: `weaver offload-probe` and the tests drive this one too).

The cold model's own steps and the offloaded tasks never run at the same time: vLLM's CPU
kernels share scratch buffers across threads (running both at once crashed the worker),
and on a GPU the poll kernel is likewise serialised on the cold stream. The worker holds
``step_lock`` around each of its steps (patches/worker_step_lock.py); the idle
poller takes it to serve. No vLLM here: the worker extension opens the regions with the
executor its backend provides and installs the poll points.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from weaver.offload.layout import COLD_INFLATION_OFFSET
from weaver.offload.protocol import Transport
from weaver.offload.receiver import OffloadReceiver
from weaver.offload.shm import ShmRegion
from weaver.weaving.cold_load import ColdInflation, StepMeter
from weaver.weaving.plan import PairPlan

logger = logging.getLogger(__name__)

# The idle poller's longest sleep over all regions (its heartbeat period); a task's
# doorbell wakes it at once.
IDLE_WAIT_S = 0.05
LOAD_PUBLISH_S = 0.25  # how often the cold TPOT factor is written to the regions


def create_shm_region(plan: PairPlan) -> Transport:
    """The region of one pair in shared memory (the CPU transport), owned by this process."""
    return ShmRegion.create(plan.layout(), plan.region_name)


def create_cuda_region(plan: PairPlan) -> Transport:
    """The region of one pair in this process's GPU memory (its cuda:0, the engine's own
    GPU), outside vLLM's KV pool, served by its armed server from now on."""
    from weaver.offload.cuda.jit import KernelLibrary
    from weaver.offload.cuda.transport import CudaRegion

    library = KernelLibrary()
    region = CudaRegion.create(plan.layout(), plan.region_name, f"cuda:{library.device_index}",
                               library)
    region.load_kernels()  # at start-up, not at the first task
    region.arm()
    return region


def region_factory(plan: PairPlan) -> Callable[[PairPlan], Transport]:
    """How a pair's region is made, by its plan's transport."""
    return create_cuda_region if plan.transport == "cuda" else create_shm_region


class ColdWeaving:
    """One cold worker's regions: their receivers, the poll a poll point runs, the step
    lock and the idle poller."""

    def __init__(self, receivers: dict[str, OffloadReceiver]) -> None:
        self.receivers = receivers  # by region name
        self.step_lock = threading.Lock()
        # The step lock as the worker's steps take it: timed, for the cold TPOT factor.
        self.step_meter = StepMeter(self.step_lock)
        self.inflation = ColdInflation(self.step_meter, self._task_s_in_steps)
        self._next_publish = 0.0
        self.num_idle_wakeups = 0  # doorbells that woke the idle poller
        self._stop = threading.Event()
        self._receivers_changed = threading.Event()  # the idle poller re-reads the set
        self._idle_pass = threading.Lock()  # held by the idle poller over one pass
        self._idle_thread: threading.Thread | None = None
        self._close_first_at_exit()

    def _close_first_at_exit(self) -> None:
        # A region created here closes itself at exit too (a safety net, weaver/offload/
        # shm.py), and atexit runs the last registered first: registered again after every
        # region, this close runs before theirs, stops the idle poller while its regions
        # are open and tells each hot side it is going. The other way round, the poller
        # rang closed doorbells (EBADF) and the receivers could not close.
        atexit.unregister(self.close)
        atexit.register(self.close)

    @classmethod
    def open(cls, plans: list[PairPlan], make_executor: Callable[[PairPlan], Any],
             make_transport: Callable[[PairPlan], Transport] | None = None) -> ColdWeaving:
        """Create and own each plan's region (in shared memory or on this GPU, as the plan
        says, unless make_transport is given), served by the executor made for it."""
        receivers: dict[str, OffloadReceiver] = {}
        try:
            for plan in plans:
                executor = make_executor(plan)
                make = make_transport or region_factory(plan)
                receivers[plan.region_name] = OffloadReceiver(make(plan), executor)
        except BaseException:
            for receiver in receivers.values():
                receiver.close()
            raise
        return cls(receivers)

    def poll(self) -> None:
        """A poll point: serve whatever is pending, now (cheap when nothing is)."""
        for receiver in self.receivers.values():
            receiver.poll()

    def add(self, plan: PairPlan, make_executor: Callable[[PairPlan], Any],
            make_transport: Callable[[PairPlan], Transport] | None = None) -> None:
        """Create and own one more region while the engine runs (a hot engine met under
        plain `vllm serve`, weaver/weaving/pair_link.py). The receivers are replaced as a
        whole, under the step lock, so a poll point or the idle poller sees either the old
        set or the new one."""
        make = make_transport or region_factory(plan)
        receiver = OffloadReceiver(make(plan), make_executor(plan))
        with self.step_lock:
            self.receivers = {**self.receivers, plan.region_name: receiver}
        self._close_first_at_exit()
        self._wake_idle_poller()

    def remove(self, region_name: str) -> None:
        """Close (and unlink) one region; its hot engine has gone with a different plan."""
        with self.step_lock:
            receivers = dict(self.receivers)
            receiver = receivers.pop(region_name, None)
            self.receivers = receivers
        if receiver is None:
            return
        self._wake_idle_poller()
        receiver.transport.wake_waiters()
        with self._idle_pass:  # the idle poller has left the pass that may still wait on it
            receiver.close()

    def _wake_idle_poller(self) -> None:
        self._receivers_changed.set()

    def start_idle_poller(self) -> None:
        if self._idle_thread is not None:
            return
        self._stop.clear()
        self._idle_thread = threading.Thread(target=self._idle_loop,
                                             name="weaver-idle-poller", daemon=True)
        self._idle_thread.start()

    def _task_s_in_steps(self) -> float:
        return sum(r.stats.busy_at_poll_points_s for r in self.receivers.values())

    def publish_load(self, now: float) -> None:
        """Write the cold TPOT factor into every region, at most every LOAD_PUBLISH_S."""
        if now < self._next_publish:
            return
        self._next_publish = now + LOAD_PUBLISH_S
        value = self.inflation.sample(now)
        for receiver in self.receivers.values():
            receiver.transport.write_word(COLD_INFLATION_OFFSET, value, "d")

    def _idle_loop(self) -> None:
        while not self._stop.is_set():
            self.publish_load(time.monotonic())
            self._receivers_changed.clear()
            receivers = list(self.receivers.values())
            if not receivers:  # no hot engine yet: wait for one to be added
                self._receivers_changed.wait(IDLE_WAIT_S)
                continue
            with self._idle_pass:
                self._idle_pass_over(receivers)

    def _idle_pass_over(self, receivers: list[OffloadReceiver]) -> None:
        wait_s = IDLE_WAIT_S / len(receivers)
        for receiver in receivers:
            if self._receivers_changed.is_set():
                return
            # Sleeps on the region's doorbell (no busy-wait: the machine's other engine
            # needs the core); a published task wakes it at once.
            woke = receiver.wait_for_task(wait_s)
            receiver.heartbeat()
            self.num_idle_wakeups += woke
            # may_have_task, not has_pending: the same read in shared memory, and no
            # synchronising read of a CUDA region (an armed one answers False at once)
            if not woke and not receiver.transport.may_have_task():
                continue
            with self.step_lock:
                receiver.poll(by_idle_poller=True)

    def export_handles(self) -> dict[str, str]:
        """CUDA IPC handles (hex) of the regions on this GPU, by region name, for the hot
        workers to open once; regions in shared memory are found by name instead."""
        return {name: receiver.transport.export_handle().hex()
                for name, receiver in self.receivers.items()
                if hasattr(receiver.transport, "export_handle")}

    def stats(self) -> list[dict[str, Any]]:
        out = []
        for name, receiver in self.receivers.items():
            stats = dict(vars(receiver.stats))
            count_on_device = getattr(receiver.transport, "num_served", None)
            if count_on_device is not None:
                # Kernels serve a CUDA region's tasks and tell the host nothing; the device
                # counts them (a synchronising read, once per stats publication).
                stats["num_served"] = count_on_device()
            out.append({"region": name, **stats})
        return out

    def stop_idle_poller(self) -> None:
        """Stop the idle poller (poll points keep working); its counters are final then."""
        self._stop.set()
        self._receivers_changed.set()
        if self._idle_thread is not None:
            for receiver in self.receivers.values():
                receiver.transport.wake_waiters()
            self._idle_thread.join(timeout=5)
            self._idle_thread = None

    def close(self) -> None:
        """Stop the idle poller, then close (and unlink) every region; safe to call twice."""
        atexit.unregister(self.close)
        self.stop_idle_poller()
        for receiver in self.receivers.values():
            receiver.close()
        self.receivers = {}
