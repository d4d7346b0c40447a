"""The hot side of one weaving pair: what a hot worker does with one cold engine's region
(Weaver §3; docs/architecture.md, "The weaving path"). weaving/hot_pairs.py splits each
step among the hot worker's pairs and drives one ``HotWeaving`` per cold side.

Per layer and step, for the rows whose KV lives on this cold side:
- their new K/V go to its remote pool (the region's KV section, or the cold device's
  unified pool when the pair's plan has one);
- remote *decode* rows are published to the cold side first (``submit``); local rows and
  remote *prefill* rows (which need the prompt's K/V just written to the remote pool,
  chunked prefill included) run here meanwhile; then the cold side's output is merged
  back in batch order (``finish_decode``);
- if the cold side times out or is gone, the pair turns degraded and the remote rows are
  computed here from the remote pool: logged once, counted every time. A pair degraded
  while its cold side still lives (a task that timed out) is tried again after a back-off
  (RESUME_FIRST_S, doubling to RESUME_MAX_S) once that side has finished the late task,
  and resumes: one slow task does not degrade it for good. On a host transport the wait
  says so at once. On CUDA the wait is a kernel on the hot stream and the fallback a
  kernel right after it that attends the rows only if the wait did not end OK (no host
  synchronisation per layer); ``settle_step`` reads their count once per step and turns
  the pair degraded.

No vLLM here: the attention backend (weaver/vllm_ext/attention/backend.py) splits the
step's metadata into ``RowGroup``s and lends the runtime, per layer call, an
``AttentionOps`` that attends a group of rows over a cache and writes K/V into one; where
the remote blocks' K/V live is a ``RemoteKV`` (the region's KV section, ``RegionKV``, or
the cold device's unified pool).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from weaver.offload.layout import COLD_INFLATION_OFFSET
from weaver.offload.protocol import (
    OffloadError,
    OffloadTicket,
    OffloadTimeout,
    TaskBatch,
    WaitStatus,
)
from weaver.offload.sender import OffloadSender
from weaver.offload.shm import ShmRegion, host_wait_policy
from weaver.weaving.placement import Ewma
from weaver.weaving.plan import PairPlan

logger = logging.getLogger(__name__)

ATTACH_TIMEOUT_S = 30.0  # how long a hot worker waits for its cold side's region
WAIT_EWMA_ALPHA = 0.05  # weight of a new wait in the recent offload wait (per task)
# A pair degraded by a late task, its cold side alive, is tried again after this long,
# the delay doubling at each failed try up to RESUME_MAX_S (a cold engine that is slow for
# good costs one timed-out task per try, so tries grow rare).
RESUME_FIRST_S = 5.0
RESUME_MAX_S = 300.0


@dataclass
class RowGroup:
    """Some requests of a step's batch and the query rows they own."""

    tokens: torch.Tensor  # int64 indices of the group's query rows in the batch
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1], rebased to the group
    seq_lens: torch.Tensor  # int32 [num_reqs]
    block_table: torch.Tensor  # int32 [num_reqs, n], ids in the pool the group's KV lives in
    metadata: Any = None  # the backend's own metadata for the group (opaque here)
    causal: bool = True

    @property
    def num_reqs(self) -> int:
        return self.seq_lens.shape[0]


@dataclass
class RemoteRows:
    """A step's requests whose KV lives on one cold engine (the `cold`-th of the hot
    engine's pairs), by phase."""

    cold: int
    prefill: RowGroup | None
    decode: RowGroup | None
    decode_batch: TaskBatch | None = None  # decode as the channel sends it, checked once


class AttentionOps(Protocol):
    """What the attention backend lends the runtime for one layer call."""

    layer_index: int
    local_kv: torch.Tensor  # the engine's own cache of this layer

    def attend(self, kv_layer: torch.Tensor, rows: RowGroup, query: torch.Tensor,
               output: torch.Tensor) -> None:
        """Attention of the rows' queries over their blocks of kv_layer (the backend's own
        kernel); writes their rows of output."""
        ...

    def write(self, kv_layer: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              slots: torch.Tensor) -> None:
        """Store new K/V [T, num_kv_heads, head_size] at slots of kv_layer."""
        ...


class RemoteKV(Protocol):
    """Where the remote blocks' K/V live, for the rows the hot side handles itself (new
    K/V, remote prefill, and remote decode when the cold side failed)."""

    def write(self, ops: AttentionOps, key: torch.Tensor, value: torch.Tensor,
              slots: torch.Tensor) -> None: ...

    def attend(self, ops: AttentionOps, rows: RowGroup, query: torch.Tensor,
               output: torch.Tensor) -> None: ...

    def close(self) -> None:
        """Let the mapping go (a restarted cold side's runtime replaced this one)."""


class RegionKV:
    """Remote blocks whose K/V live in the region's own KV section, in the backend's own
    cache layout, so its kernels read and write them as they do the local cache."""

    def __init__(self, sender: OffloadSender) -> None:
        self.sender = sender

    def write(self, ops: AttentionOps, key: torch.Tensor, value: torch.Tensor,
              slots: torch.Tensor) -> None:
        ops.write(self.sender.kv_layer(ops.layer_index), key, value, slots)

    def attend(self, ops: AttentionOps, rows: RowGroup, query: torch.Tensor,
               output: torch.Tensor) -> None:
        ops.attend(self.sender.kv_layer(ops.layer_index), rows, query, output)

    def close(self) -> None:
        pass  # the region is the sender's: closing it unmaps this too


@dataclass
class HotWeavingStats:
    num_offloaded_tasks: int = 0  # decode-attention tasks the cold side served
    num_offloaded_rows: int = 0  # sequence-layer rows inside them
    num_fallback_tasks: int = 0  # tasks computed here because the cold side failed
    num_remote_prefill_rows: int = 0
    num_remote_sequences: int = 0  # remote sequences seen starting their prefill
    num_resumes: int = 0  # times offloading resumed after a late task had degraded the pair
    wait_seconds: list[float] = field(default_factory=list)  # drained by the metrics scrape


class HotWeaving:
    """One pair of a hot worker's weaving (one cold side): the pair's plan, the sender of
    its region, where the remote blocks' K/V live and the pair's health (degraded once the
    cold side failed). A hot worker over several colds has one per cold, driven together
    each step by its HotPairs (weaving/hot_pairs.py)."""

    def __init__(self, plan: PairPlan, sender: OffloadSender,
                 remote_kv: RemoteKV | None = None) -> None:
        self.plan = plan
        self.sender = sender
        self.remote_kv = remote_kv if remote_kv is not None else RegionKV(sender)
        self.stats = HotWeavingStats()
        self.degraded_reason: str | None = None
        # When to try the cold side again (monotonic seconds); None: not degraded, or
        # degraded for good (the cold side closed or died: its restart brings a new runtime).
        self.resume_at: float | None = None
        self._resume_delay_s = RESUME_FIRST_S
        self.clock = time.monotonic
        self.recent_wait = Ewma(WAIT_EWMA_ALPHA)  # the wait for a remote task, recently
        self._lock = threading.Lock()

    @classmethod
    def attach(cls, plan: PairPlan, remote_kv: RemoteKV | None = None,
               cuda_handle: bytes | None = None) -> HotWeaving:
        """Attach the region the cold worker created: in shared memory (waiting for it), or
        on the cold GPU through the CUDA IPC handle it exported (opened once, here)."""
        if plan.transport == "cuda":
            from weaver.offload.cuda.jit import KernelLibrary
            from weaver.offload.cuda.transport import CudaRegion

            if cuda_handle is None:
                raise ValueError(f"weaving {plan.hot} -> {plan.cold} shares a CUDA region: "
                                 "the cold worker's exported handle is needed to attach it")
            # The kernels (publish, wait, fallback) run on this engine's GPU, its cuda:0.
            region = CudaRegion.attach(plan.layout(), plan.region_name, cuda_handle,
                                       KernelLibrary())
            region.load_kernels()  # at start-up, not on the first woven step
            return cls(plan, OffloadSender(region), remote_kv)
        region = ShmRegion.attach(plan.layout(), plan.region_name, wait_s=ATTACH_TIMEOUT_S)
        return cls(plan, OffloadSender(region, policy=host_wait_policy(region)), remote_kv)

    def take_over_from(self, previous: HotWeaving) -> None:
        """Carry the pair on after its cold engine restarted: this runtime's region is the
        one the new cold worker created, `previous` the dead one's (still mapped here); the
        counters carry on. Called between steps (an RPC).

        Remote K/V in the region: the remote sequences still running keep their block ids,
        so their K/V are copied into the new region. Remote K/V in the cold engine's unified
        pool: nothing to carry, the pool died with that engine and its successor made a new
        one; the hot scheduler preempted every request holding the old pool's blocks before
        this attach (weaver/vllm_ext/scheduler.py HotRouting.cold_restarted), and the old
        pool's mapping is let go. Remote K/V in a loan pool: nothing to carry either, the
        gateway's pool outlived the cold engine and the new mapping is of the same pages."""
        if self.plan.pool is None:
            if previous.sender.layout != self.sender.layout:
                raise ValueError(f"the restarted cold side's region {self.plan.region_name} "
                                 "has another layout; the pair stays degraded")
            for layer in range(self.plan.shape.num_layers):
                self.sender.kv_layer(layer).copy_(previous.sender.kv_layer(layer))
        previous.remote_kv.close()
        self.stats = previous.stats
        previous.sender.close()
        logger.info("weaving %s -> %s resumed on the restarted cold side's region (%s)",
                    self.plan.hot, self.plan.cold,
                    "remote K/V carried over" if self.plan.pool is None
                    else "a new unified pool" if self.plan.pool.owner is not None
                    else "remote K/V kept in the loan pool")

    # --- a step's rows on this cold side (weaving/hot_pairs.py drives them) -------------
    def submit(self, layer_index: int, query: torch.Tensor, rows: RemoteRows, *, scale: float,
               sliding_window: int, softcap: float) -> OffloadTicket | None:
        """Publish the rows' decode attention to the cold side; None when the pair is
        degraded or the publish failed (then the rows are attended here)."""
        decode = rows.decode
        if decode is None or self.degraded_reason is not None:
            return None
        try:
            if rows.decode_batch is None:
                rows.decode_batch = self.sender.prepare_batch(decode.seq_lens,
                                                              decode.block_table)
            return self.sender.submit_batch(layer_index, query[decode.tokens],
                                            rows.decode_batch, scale=scale,
                                            sliding_window=sliding_window, softcap=softcap)
        except OffloadError as exc:
            self.mark_degraded(f"submit failed: {exc}", may_resume=_is_late(exc))
            return None

    def attend_prefill(self, ops: AttentionOps, rows: RowGroup, query: torch.Tensor,
                       output: torch.Tensor) -> None:
        """Remote prefill rows run here, over the K/V just written to the remote pool."""
        self.stats.num_remote_prefill_rows += rows.num_reqs
        self.remote_kv.attend(ops, rows, query, output)

    def finish_decode(self, ops: AttentionOps, ticket: OffloadTicket | None, rows: RowGroup,
                      query: torch.Tensor, output: torch.Tensor) -> None:
        """The cold side's output of a submitted task into place, or, when there was no
        task or its wait failed, the rows attended here (counted as a fallback)."""
        if ticket is None or not self._collect(ticket, output, rows):
            self.stats.num_fallback_tasks += 1
            self.remote_kv.attend(ops, rows, query, output)

    def _collect(self, ticket: OffloadTicket, output: torch.Tensor, rows: RowGroup) -> bool:
        try:
            result = self.sender.wait_with_timing(ticket, self.plan.timeout_s)
            task_output = result.output
            if result.status is WaitStatus.PENDING:
                # A device wait: its fallback follows it on the stream and the output is
                # the cold side's or the fallback's, as the wait ended (settle_step counts).
                task_output = self.sender.enqueue_fallback(ticket)
        except OffloadError as exc:
            self.mark_degraded(f"wait failed: {exc}", may_resume=_is_late(exc))
            return False
        # Both [rows, num_heads, head_size]; the staging lives on the cold GPU when the
        # pair spans two (a peer copy in stream order; nothing moves on one device).
        output[rows.tokens] = task_output.to(output.device, non_blocking=True)
        self.stats.num_offloaded_tasks += 1
        self.stats.num_offloaded_rows += len(rows.tokens)
        if result.status is not WaitStatus.PENDING:  # a device wait's host time is no wait
            self.stats.wait_seconds.append(result.wait_s)
            self.recent_wait.add(result.wait_s)
        return True

    def settle_step(self) -> None:
        """Once per step, before the next one: device waits of the last step that did not
        end OK were answered by their fallbacks on the device; count them and stop
        offloading (a no-op costing nothing on a host transport). A pair degraded by a late
        task is tried again when its back-off is over."""
        num_failed = self.sender.take_num_device_fallbacks()
        if num_failed:
            self.stats.num_fallback_tasks += num_failed
            self.stats.num_offloaded_tasks -= num_failed
            # The device does not say whether it timed out or the cold side closed; the
            # try after the back-off reads the cold side's status and tells.
            self.mark_degraded(f"{num_failed} device wait(s) did not end OK (the cold side "
                               "timed out or closed); their rows were attended here",
                               may_resume=True)
        if self.resume_at is not None and self.clock() >= self.resume_at:
            self._try_resume()

    def _try_resume(self) -> None:
        """Resume offloading if the cold side is open and has finished every task sent to
        it (a host read; on CUDA a synchronisation, once per back-off); otherwise back off
        longer."""
        if self.sender.is_idle_and_open():
            logger.info("weaving %s -> %s resumed: the cold side answers again (it was "
                        "degraded: %s)", self.plan.hot, self.plan.cold, self.degraded_reason)
            self.degraded_reason = None
            self.resume_at = None
            self._resume_delay_s = RESUME_FIRST_S
            self.stats.num_resumes += 1
            return
        self._resume_delay_s = min(2 * self._resume_delay_s, RESUME_MAX_S)
        self.resume_at = self.clock() + self._resume_delay_s

    # --- health and stats ---------------------------------------------------------------
    def mark_degraded(self, reason: str, *, may_resume: bool = False) -> None:
        """Stop offloading: remote rows are attended here from the remote pool. With
        `may_resume` (a late task, its cold side alive) the cold side is tried again after
        the back-off; otherwise the pair stays degraded until a new runtime takes over."""
        if self.degraded_reason is not None:
            return
        self.degraded_reason = reason
        self.resume_at = self.clock() + self._resume_delay_s if may_resume else None
        logger.error(
            "weaving %s -> %s degraded (%s): remote sequences' attention is now computed "
            "on the hot side from the remote pool%s", self.plan.hot, self.plan.cold, reason,
            f"; trying the cold side again in {self._resume_delay_s:.0f} s" if may_resume
            else "")

    def pair_load(self) -> dict[str, float | None]:
        """What the adaptive placement weighs (weaving/placement.py PairLoad): the cold
        TPOT factor its side publishes, and the recent offload wait."""
        inflation = float(self.sender.transport.read_word(COLD_INFLATION_OFFSET, "d"))
        return {"cold_inflation": inflation if inflation > 0 else None,
                "offload_wait_s": self.recent_wait.value}

    def drain_stats(self) -> dict[str, Any]:
        with self._lock:
            waits, self.stats.wait_seconds = self.stats.wait_seconds, []
        return {
            "hot": self.plan.hot, "cold": self.plan.cold,
            "offloaded_tasks": self.stats.num_offloaded_tasks,
            "offloaded_rows": self.stats.num_offloaded_rows,
            "fallback_tasks": self.stats.num_fallback_tasks,
            "remote_prefill_rows": self.stats.num_remote_prefill_rows,
            "remote_sequences": self.stats.num_remote_sequences,
            "resumes": self.stats.num_resumes,
            "degraded_reason": self.degraded_reason,
            "wait_seconds": waits,
        }


def _is_late(exc: OffloadError) -> bool:
    """A task that was late or is still being served (its cold side alive), not one the
    cold side failed or a side that closed or died."""
    return isinstance(exc, OffloadTimeout) and exc.reason in ("timeout", "busy")
