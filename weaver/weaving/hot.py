"""The hot side of weaving: one decode step's attention split by where each sequence's KV
lives (Weaver §3; docs/architecture.md, "The weaving path").

Per layer and step:
- new K/V of remote sequences go to the remote pool (slots at or above the local cache's
  ``num_local_slots`` belong to it: the region's KV section, or the cold device's unified
  pool when the pair's plan has one), the rest to the engine's own cache;
- remote *decode* rows are published to the cold side first; local rows and remote
  *prefill* rows (which need the prompt's K/V just written to the remote pool, chunked
  prefill included) run here meanwhile; then the cold side's output is merged back in
  batch order;
- if the cold side times out or is gone, the pair turns degraded and the remote rows are
  computed here from the remote pool: logged once, counted every time. A pair degraded
  while its cold side still lives (a task that timed out) is tried again after a back-off
  (RESUME_FIRST_S, doubling to RESUME_MAX_S) once that side has finished the late task,
  and resumes: one slow task does not degrade it for good. On a host
  transport the wait says so at once. On CUDA the wait is a kernel on the hot stream and
  the fallback a kernel right after it that attends the rows only if the wait did not end
  OK (no host synchronisation per layer); ``settle_step`` reads their count once per step
  and turns the pair degraded from then on.

No vLLM here: the attention backend (weaver/vllm_ext/attention/backend.py) splits the
step's metadata into ``RowGroup``s and lends this runtime, per layer call, an
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
class StepRows:
    """How one step's batch divides by where each sequence's KV lives. Every layer of the
    step shares it (the backend builds it once per step)."""

    local: RowGroup | None
    remote_prefill: RowGroup | None
    remote_decode: RowGroup | None
    num_new_remote: int  # remote sequences starting their prefill in this step
    decode_batch: TaskBatch | None = None  # remote_decode as the channel sends it, checked once


@dataclass(frozen=True)
class RequestSplit:
    """Request indices of a step by placement and phase (each ascending)."""

    local: torch.Tensor
    remote_prefill: torch.Tensor
    remote_decode: torch.Tensor
    num_new_remote: int

    @property
    def has_remote(self) -> bool:
        return bool(self.remote_prefill.numel() or self.remote_decode.numel())


def classify_requests(first_block_ids: torch.Tensor, query_lens: torch.Tensor,
                      seq_lens: torch.Tensor, num_local_blocks: int) -> RequestSplit:
    """Classify a step's requests: a request is remote when its first block id is at or
    above the local cache's block count (the hot scheduler hands remote requests ids past
    the local range, so no side channel is needed), a decode when it has one query token,
    new when its first prefill chunk is its whole context so far."""
    is_remote = first_block_ids >= num_local_blocks
    is_decode = query_lens == 1
    is_new = seq_lens == query_lens
    return RequestSplit(
        local=torch.nonzero(~is_remote).flatten(),
        remote_prefill=torch.nonzero(is_remote & ~is_decode).flatten(),
        remote_decode=torch.nonzero(is_remote & is_decode).flatten(),
        num_new_remote=int((is_remote & is_new).sum()),
    )


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


@dataclass
class HotWeavingStats:
    num_offloaded_tasks: int = 0  # decode-attention tasks the cold side served
    num_offloaded_rows: int = 0  # sequence-layer rows inside them
    num_fallback_tasks: int = 0  # tasks computed here because the cold side failed
    num_remote_prefill_rows: int = 0
    num_remote_sequences: int = 0  # remote sequences seen starting their prefill
    num_resumes: int = 0  # times offloading resumed after a late task had degraded the pair
    wait_seconds: list[float] = field(default_factory=list)  # drained by the metrics scrape


@dataclass
class _SlotSplit:
    """Which new tokens' K/V go to the local cache and which to the remote pool (slot ids
    rebased to it). Every layer of a step gets the same slot_mapping tensor, so this is
    computed once per step."""

    slot_mapping: torch.Tensor  # held: the cache key is this very tensor (and its version)
    version: int
    boundary: int
    local_tokens: torch.Tensor | None
    local_slots: torch.Tensor | None
    remote_tokens: torch.Tensor | None
    remote_slots: torch.Tensor | None

    @classmethod
    def of(cls, slot_mapping: torch.Tensor, boundary: int) -> _SlotSplit:
        is_remote = slot_mapping >= boundary
        remote = torch.nonzero(is_remote).flatten()
        local = torch.nonzero(~is_remote).flatten()
        return cls(slot_mapping, slot_mapping._version, boundary,
                   local if local.numel() else None,
                   slot_mapping[local] if local.numel() else None,
                   remote if remote.numel() else None,
                   slot_mapping[remote] - boundary if remote.numel() else None)

    def is_for(self, slot_mapping: torch.Tensor, boundary: int) -> bool:
        # The version counter moves with any in-place write to the tensor or the
        # persistent buffer it views, so a reused buffer never matches a stale split.
        return (self.slot_mapping is slot_mapping and self.version == slot_mapping._version
                and self.boundary == boundary)


class HotWeaving:
    """One hot worker's weaving: the pair's plan, the sender of its region, where the
    remote blocks' K/V live and the pair's health (degraded once the cold side failed)."""

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
        self._slot_split: _SlotSplit | None = None
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
        one the new cold worker created, `previous` the dead one's (still mapped here). The
        remote sequences still running keep their block ids, so their K/V are copied into
        the new region, and the counters carry on. Called between steps (an RPC)."""
        if self.plan.pool is not None:
            raise ValueError(
                f"weaving {self.plan.hot} -> {self.plan.cold} keeps remote KV in the cold "
                "engine's unified pool, which died with it: the pair stays degraded until "
                "the hot engine restarts too")
        if previous.sender.layout != self.sender.layout:
            raise ValueError(f"the restarted cold side's region {self.plan.region_name} has "
                             "another layout; the pair stays degraded")
        for layer in range(self.plan.shape.num_layers):
            self.sender.kv_layer(layer).copy_(previous.sender.kv_layer(layer))
        self.stats = previous.stats
        previous.sender.close()
        logger.info("weaving %s -> %s resumed on the restarted cold side's region (remote "
                    "K/V carried over)", self.plan.hot, self.plan.cold)

    # --- K/V --------------------------------------------------------------------------
    def write_kv(self, ops: AttentionOps, key: torch.Tensor, value: torch.Tensor,
                 slot_mapping: torch.Tensor, num_local_slots: int) -> None:
        split = self._slot_split
        if split is None or not split.is_for(slot_mapping, num_local_slots):
            split = self._slot_split = _SlotSplit.of(slot_mapping, num_local_slots)
        if split.remote_tokens is None:
            ops.write(ops.local_kv, key, value, slot_mapping)
            return
        if split.local_tokens is not None:
            ops.write(ops.local_kv, key[split.local_tokens], value[split.local_tokens],
                      split.local_slots)
        self.remote_kv.write(ops, key[split.remote_tokens], value[split.remote_tokens],
                             split.remote_slots)

    # --- attention ----------------------------------------------------------------------
    def attend(self, ops: AttentionOps, layer_index: int, step: StepRows, query: torch.Tensor,
               output: torch.Tensor, *, scale: float, sliding_window: int,
               softcap: float) -> torch.Tensor:
        """Attention of every row of the step: remote decode rows on the cold side while
        the rest runs here."""
        decode = step.remote_decode
        ticket = None
        if decode is not None and self.degraded_reason is None:
            ticket = self._submit(layer_index, query, step, scale, sliding_window, softcap)
        if step.local is not None:
            ops.attend(ops.local_kv, step.local, query, output)
        if step.remote_prefill is not None:
            self.stats.num_remote_prefill_rows += step.remote_prefill.num_reqs
            self.remote_kv.attend(ops, step.remote_prefill, query, output)
        if decode is not None and (ticket is None or not self._collect(ticket, output, decode)):
            self.stats.num_fallback_tasks += 1
            self.remote_kv.attend(ops, decode, query, output)
        return output

    def _submit(self, layer_index: int, query: torch.Tensor, step: StepRows, scale: float,
                sliding_window: int, softcap: float) -> OffloadTicket | None:
        rows = step.remote_decode
        try:
            if step.decode_batch is None:
                step.decode_batch = self.sender.prepare_batch(rows.seq_lens, rows.block_table)
            return self.sender.submit_batch(layer_index, query[rows.tokens], step.decode_batch,
                                            scale=scale, sliding_window=sliding_window,
                                            softcap=softcap)
        except OffloadError as exc:
            self.mark_degraded(f"submit failed: {exc}", may_resume=_is_late(exc))
            return None

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
