"""A serving instance: continuous batching with paged KV capacity, iteration by iteration.

Mirrors vLLM's scheduler at the level the simulator needs (vllm/v1/core/sched/scheduler.py):
each iteration is either a prefill of newly admitted prompts (up to a token budget) or one
decode step of the whole running batch; requests are admitted first-come-first-served
while KV blocks are free; when a decode step needs a block and none is left, the most
recently admitted sequence is preempted and recomputed later (vLLM's RECOMPUTE mode).

Per-step cost is O(1) plus the sequences that finish: a sequence's context grows by one
token per step, so whether it needs a new block at step k depends only on
(k - context) mod block_size; `SeqSet` keeps a count per residue.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from weaver.sim.adaptive_feed import ColdLoad, adaptive_feed
from weaver.sim.engine import Engine, Event
from weaver.sim.perf_model import (
    IDLE_POLL_INTERVAL_S,
    OffloadCostModel,
    PerfModel,
    PollContext,
    operator_fractions,
)
from weaver.sim.profile import blocks_for
from weaver.weaving.placement import (
    AdaptivePlacement,
    Placement,
    RatioPlacement,
    cold_order,
)
from weaver.weaving.placement_feed import PlacementFeed
from weaver.workloads.types import TraceRequest

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class SimRequest:
    trace: TraceRequest
    num_done: int = 0  # output tokens generated so far
    first_token_s: float | None = None
    finish_s: float | None = None
    num_preemptions: int = 0
    is_rejected: bool = False
    is_remote: bool = False
    has_kv: bool = False  # KV of input + num_done - 1 tokens already exists (Splitwise)
    instance: str = ""
    # Decode bookkeeping while running (see SeqSet).
    start_step: int = 0
    start_context: int = 0
    finish_step: int = 0
    seq_set: SeqSet | None = field(default=None, repr=False)

    @property
    def model(self) -> str:
        return self.trace.model

    @property
    def num_output(self) -> int:
        return self.trace.output_tokens

    @property
    def is_running(self) -> bool:
        return self.seq_set is not None


class BlockPool:
    """KV memory of one device (or a region of it), in bytes; models differ in block bytes."""

    def __init__(self, capacity_bytes: float) -> None:
        if capacity_bytes <= 0:
            raise ValueError(
                f"KV pool capacity is {capacity_bytes / 2**30:.2f} GiB: the models placed "
                "on this device leave no memory for KV; place fewer models per device"
            )
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0.0

    def can_take(self, num_bytes: float) -> bool:
        return self.used_bytes + num_bytes <= self.capacity_bytes + 1e-6


class SeqSet:
    """Running sequences of one model in one pool (local, or a remote region)."""

    def __init__(self, pool: BlockPool, block_size: int, block_bytes: int,
                 quota_blocks: int | None = None) -> None:
        self.pool = pool
        self.block_size = block_size
        self.block_bytes = block_bytes
        self.quota_blocks = quota_blocks
        self.seqs: dict[SimRequest, None] = {}  # insertion-ordered set
        self.num_context_tokens = 0
        self.num_blocks = 0
        self.num_peak_blocks = 0  # the most it held at once (a lent pool binding or not)
        self._crossing = [0] * block_size

    @property
    def num_seqs(self) -> int:
        return len(self.seqs)

    @property
    def capacity_blocks(self) -> int:
        pool_blocks = int(self.pool.capacity_bytes // self.block_bytes)
        return pool_blocks if self.quota_blocks is None else min(pool_blocks, self.quota_blocks)

    def can_take(self, num_blocks: int) -> bool:
        if self.quota_blocks is not None and self.num_blocks + num_blocks > self.quota_blocks:
            return False
        return self.pool.can_take(num_blocks * self.block_bytes)

    def allocate(self, num_blocks: int) -> None:
        """Take blocks (the caller checked `can_take`); negative numbers give them back."""
        self.num_blocks += num_blocks
        if self.num_blocks > self.num_peak_blocks:  # (not max(): every step calls this)
            self.num_peak_blocks = self.num_blocks
        self.pool.used_bytes += num_blocks * self.block_bytes

    def free(self, num_blocks: int) -> None:
        self.allocate(-num_blocks)

    def add(self, req: SimRequest, num_context: int, step: int, num_blocks_taken: int) -> None:
        """Join the batch holding `num_context` tokens of KV (blocks already taken)."""
        req.seq_set, req.start_step, req.start_context = self, step, num_context
        self.seqs[req] = None
        self.num_context_tokens += num_context
        self._crossing[(step - num_context) % self.block_size] += 1
        extra = blocks_for(num_context, self.block_size) - num_blocks_taken
        self.allocate(extra)

    def context_of(self, req: SimRequest, step: int) -> int:
        return req.start_context + step - req.start_step

    def remove(self, req: SimRequest, step: int) -> None:
        context = self.context_of(req, step)
        del self.seqs[req]
        req.seq_set = None
        self.num_context_tokens -= context
        self._crossing[(req.start_step - req.start_context) % self.block_size] -= 1
        self.free(blocks_for(context, self.block_size))

    def num_new_blocks(self, step: int) -> int:
        """Blocks the batch needs to append one token each at decode step `step`."""
        return self._crossing[step % self.block_size]

    def grow(self, step: int) -> None:
        self.allocate(self.num_new_blocks(step))

    def advance(self) -> None:
        self.num_context_tokens += self.num_seqs

    def newest(self) -> SimRequest:
        return next(reversed(self.seqs))

    @property
    def num_free_blocks(self) -> int:
        return max(0, self.capacity_blocks - self.num_blocks)


@dataclass(eq=False)
class RemotePool:
    """A hot model's remote pool on one cold device: its sequences there, the cold
    instance that serves their attention, and what that costs the hot step."""

    seqs: SeqSet
    instance: Instance
    offload: OffloadCostModel


@dataclass(eq=False)
class Prefill:
    """A prompt being prefilled, possibly over several steps (chunked prefill)."""

    req: SimRequest
    target: SeqSet
    num_blocks: int
    num_compute: int  # tokens to run through the model (0 or 1 when the KV was transferred)
    num_done: int = 0

    @property
    def num_remaining(self) -> int:
        return self.num_compute - self.num_done


@dataclass
class StepPlan:
    num_decode: int
    chunks: list[tuple[Prefill, int]]

    @property
    def num_prefill_tokens(self) -> int:
        return sum(num for _, num in self.chunks)


@dataclass
class ServerConfig:
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192  # vLLM's default for API serving on 80 GB GPUs
    # "chunked": vLLM v1's steps (decodes plus prompt chunks); "prefill_first": vLLM 0.6's
    # default without chunked prefill, the Weaver paper's engine (a step prefills whole
    # prompts while any can be admitted, else decodes every running sequence).
    scheduling: str = "chunked"


class ModelServer:
    """Scheduler state of one model inside an instance (vLLM's Scheduler, simplified)."""

    def __init__(self, name: str, perf: PerfModel, pool: BlockPool, cfg: ServerConfig,
                 phase: str = "both") -> None:
        if phase not in ("both", "prompt", "token"):
            raise ValueError(f"phase must be both, prompt or token, got {phase!r}")
        self.name = name
        self.perf = perf
        self.cfg = cfg
        self.phase = phase
        self.local = SeqSet(pool, cfg.block_size, cfg.block_size * perf.shape.kv_bytes_per_token)
        # One per cold device the model weaves into (weaver/sim/policies/weaver.py).
        self.remotes: list[RemotePool] = []
        self.offload_ratio = 0.0
        self.offload_policy = "fixed"  # or "overflow", see _choose_set
        # The hot scheduler's own placement (offload_policy "ratio"), set by weaving, and
        # under `auto` what feeds it (weaver/sim/adaptive_feed.py).
        self._placement: RatioPlacement | AdaptivePlacement | None = None
        self.feed: PlacementFeed | None = None
        self.waiting: deque[SimRequest] = deque()
        self.num_steps = 0
        self.finishing: dict[int, list[SimRequest]] = {}
        self.on_finished: Callable[[SimRequest], None] = lambda req: None
        self.on_prefilled: Callable[[SimRequest, float], list[Event]] = lambda req, t: []
        self.num_in_flight = 0  # requests on their way here (Splitwise KV transfer)
        # A token instance whose first step with a moved KV gives the client its first
        # token (SplitwiseSpec.first_token "token").
        self.first_token_here = False
        self.prefilling: list[Prefill] = []

    @property
    def placement(self) -> RatioPlacement | AdaptivePlacement | None:
        return self._placement

    @placement.setter
    def placement(self, placement: RatioPlacement | AdaptivePlacement | None) -> None:
        self._placement = placement
        self.feed = adaptive_feed(self, placement) \
            if isinstance(placement, AdaptivePlacement) else None

    # --- capacity -------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return self.local.num_seqs + self.num_remote

    @property
    def num_remote(self) -> int:
        return sum(remote.seqs.num_seqs for remote in self.remotes)

    def is_remote(self, seq_set: SeqSet) -> bool:
        return seq_set is not self.local

    @property
    def num_queued(self) -> int:
        return len(self.waiting) + len(self.prefilling) + self.num_running + \
            self.num_in_flight

    def max_blocks(self) -> int:
        # A sequence lives whole in one pool, local or one cold's.
        return max([self.local.capacity_blocks,
                    *(remote.seqs.capacity_blocks for remote in self.remotes)])

    def enqueue(self, req: SimRequest) -> bool:
        # A prompt machine only ever holds the prompt; others hold the whole sequence.
        num_tokens = req.trace.input_tokens + (0 if self.phase == "prompt" else req.num_output)
        need = blocks_for(num_tokens, self.cfg.block_size)
        if need > self.max_blocks():
            logger.warning("request %d of %s needs %d KV blocks, more than %s holds; "
                           "rejected", req.trace.request_id, self.name, need, self.name)
            req.is_rejected = True
            self.on_finished(req)
            return False
        self.waiting.append(req)
        return True

    # --- prefill --------------------------------------------------------------------
    def _context_to_build(self, req: SimRequest) -> int:
        # vLLM recomputes prompt + generated tokens; a transferred KV covers all but the
        # newest token, which the next decode step appends.
        if req.has_kv:
            return req.trace.input_tokens + req.num_done - 1
        return req.trace.input_tokens + req.num_done

    def _choose_set(self, num_blocks: int, num_remote_new: int, num_new: int) -> SeqSet | None:
        """Where a newly admitted sequence's KV goes (the hot scheduler's placement)."""
        if not self.remotes or self.phase == "prompt":
            return self.local if self.local.can_take(num_blocks) else None
        if self.offload_policy == "ratio":
            return self._choose_by_ratio(num_blocks, num_remote_new, num_new)
        cap = self.offload_ratio * (self.num_running + num_new + 1)
        remote = self._remote_for(num_blocks) if self.num_remote + num_remote_new < cap \
            else None
        if self.offload_policy == "overflow":  # local first; remote only when local is full
            if self.local.can_take(num_blocks):
                return self.local
            return remote
        if remote is not None:
            return remote
        return self.local if self.local.can_take(num_blocks) else None

    def _remote_for(self, num_blocks: int) -> SeqSet | None:
        """The cold pool a new remote sequence goes to, as the hot scheduler picks it
        (weaving/placement.py cold_order: the open cold with the most free blocks)."""
        placement = self.placement
        is_open = [placement is None or placement.cold_is_open(index)
                   for index in range(len(self.remotes))]
        for index in cold_order([r.seqs.num_free_blocks for r in self.remotes], is_open):
            if self.remotes[index].seqs.can_take(num_blocks):
                return self.remotes[index].seqs
        return None

    def _choose_by_ratio(self, num_blocks: int, num_remote_new: int,
                         num_new: int) -> SeqSet | None:
        """The hot scheduler's own rule (vllm_ext/scheduler.py RoutingKVCacheManager):
        the preferred pool by `RatioPlacement` over the placed requests (running plus being
        prefilled), spilling to the other pool when the preferred one is full."""
        placement = self.placement or RatioPlacement(self.offload_ratio)
        num_remote = self.num_remote + num_remote_new
        num_local = self.local.num_seqs + num_new - num_remote_new
        for choice in placement.order(num_local, num_remote):
            if choice is Placement.REMOTE:
                target = self._remote_for(num_blocks)
                if target is not None:
                    return target
            elif self.local.can_take(num_blocks):
                return self.local
        return None

    def step_starts(self, now: float) -> None:
        """Before a step is planned, as the hot scheduler does before schedule(): under
        `auto`, every PAIR_LOAD_INTERVAL_S the colds' TPOT factors and the policy's
        decision, and the remote sequences a cold over its budget gives back."""
        if self.feed is not None and self.remotes:
            shed = self.feed.step_starts(now, [remote.seqs.num_seqs for remote in self.remotes])
            for remote, num in zip(self.remotes, shed, strict=True):
                for _ in range(num):  # a cold over its budget gives its newest ones back
                    self._preempt(remote.seqs)

    def step_ended(self, plan: StepPlan, now: float) -> None:
        """A step ran (its sequences not yet finished): its time and batch, and whether it
        ran decodes only, for `auto`."""
        if self.feed is not None and self.remotes:
            self.feed.step_ended(self.local.num_seqs, self.num_remote, not plan.chunks, now)

    def can_admit(self) -> bool:
        if not self.waiting or self.num_running + len(self.prefilling) >= self.cfg.max_num_seqs:
            return False
        req = self.waiting[0]
        return self._choose_set(blocks_for(self._context_to_build(req), self.cfg.block_size),
                                0, 0) is not None

    def has_step(self) -> bool:
        return self.num_running > 0 or bool(self.prefilling) or self.can_admit()

    def plan_step(self) -> StepPlan:
        """One iteration as vLLM v1 schedules it: every running sequence decodes one token
        and the rest of the token budget goes to prefill chunks, in-progress prompts first,
        then new admissions FCFS while KV blocks and sequence slots last. Prefill-first
        (`ServerConfig.scheduling`): whole prompts while any can be admitted, and then
        decodes alone."""
        if self.cfg.scheduling == "prefill_first":
            chunks = self._admit([], self.cfg.max_num_batched_tokens, whole=True)
            if chunks:
                return StepPlan(0, chunks)
            self.reserve_decode()
            return StepPlan(self.num_running, [])
        self.reserve_decode()
        num_decode = self.num_running
        budget = self.cfg.max_num_batched_tokens - num_decode
        chunks: list[tuple[Prefill, int]] = []
        for entry in self.prefilling:
            if budget <= 0:
                break
            num = min(entry.num_remaining, budget)
            chunks.append((entry, num))
            budget -= num
        return StepPlan(num_decode, self._admit(chunks, budget))

    def _admit(self, chunks: list[tuple[Prefill, int]], budget: int,
               whole: bool = False) -> list[tuple[Prefill, int]]:
        """New admissions FCFS into `chunks` while KV blocks, sequence slots and the token
        budget last; `whole`: only prompts that fit the budget whole (the first always
        does: vLLM 0.6 needs max_num_batched_tokens >= max_model_len)."""
        num_remote = sum(self.is_remote(e.target) for e in self.prefilling)
        while self.waiting and self.num_running + len(self.prefilling) < self.cfg.max_num_seqs:
            req = self.waiting[0]
            context = self._context_to_build(req)
            # A moved KV is taken as is; Weaver's token engine still computes the prompt's
            # last token (its KV and the first output come from that step).
            compute = int(self.first_token_here) if req.has_kv else context
            if compute and budget <= 0:
                break
            if whole and chunks and compute > budget:
                break
            num_blocks = blocks_for(context, self.cfg.block_size)
            target = self._choose_set(num_blocks, num_remote, len(self.prefilling))
            if target is None:
                break
            self.waiting.popleft()
            target.allocate(num_blocks)
            num_remote += self.is_remote(target)
            entry = Prefill(req, target, num_blocks, compute)
            self.prefilling.append(entry)
            num = compute if whole else min(compute, budget)
            chunks.append((entry, num))
            budget -= num
        return chunks

    def step_time(self, plan: StepPlan, polls: list[PollContext]) -> float:
        """Decode part from the decode grid; a prefill chunk riding along costs the
        marginal dense time of its tokens, prefill(n + b) - prefill(b), because the batch
        reads the weights once (Sarathi-Serve's mixed batches)."""
        num_prefill = plan.num_prefill_tokens
        if plan.num_decode == 0:
            return self.perf.prefill_time(num_prefill) if num_prefill else 0.0
        dt = self.decode_time(polls)
        if num_prefill:
            b = plan.num_decode
            dt += self.perf.prefill_time(num_prefill + b) - self.perf.prefill_time(b)
        return dt

    def finish_step(self, plan: StepPlan, now: float) -> list[Event]:
        if plan.num_decode:
            self.finish_decode(now)
        events: list[Event] = []
        for entry, num in plan.chunks:
            entry.num_done += num
            if entry.num_done >= entry.num_compute:
                self.prefilling.remove(entry)
                events.extend(self._complete_prefill(entry, now))
        return events

    def _complete_prefill(self, entry: Prefill, now: float) -> list[Event]:
        req, target, num_blocks = entry.req, entry.target, entry.num_blocks
        context = self._context_to_build(req)
        if req.has_kv:
            req.has_kv = False
            if self.first_token_here:
                req.first_token_s = now
        else:
            req.num_done += 1
            if req.first_token_s is None:
                req.first_token_s = now
        if req.num_done >= req.num_output:
            target.free(num_blocks)
            self._finish(req, now)
            return []
        if self.phase == "prompt":
            target.free(num_blocks)
            return self.on_prefilled(req, now)
        req.is_remote = self.is_remote(target)
        target.add(req, context, self.num_steps, num_blocks)
        req.finish_step = self.num_steps + req.num_output - req.num_done
        self.finishing.setdefault(req.finish_step, []).append(req)
        return []

    # --- decode ---------------------------------------------------------------------
    def _preempt(self, seq_set: SeqSet) -> None:
        req = seq_set.newest()
        req.num_done += self.num_steps - req.start_step
        seq_set.remove(req, self.num_steps)
        req.num_preemptions += 1
        self.waiting.appendleft(req)

    def reserve_decode(self) -> None:
        """Take the blocks this step appends, preempting the newest sequences if needed."""
        for seq_set in (self.local, *(remote.seqs for remote in self.remotes)):
            while seq_set.num_seqs and not seq_set.can_take(
                    seq_set.num_new_blocks(self.num_steps)):
                self._preempt(seq_set)
            seq_set.grow(self.num_steps)

    def decode_time(self, polls: list[PollContext]) -> float:
        """The decode step; with remote sequences, plus the longest wait among the colds
        (each cold's task runs on its own device, all of them at once)."""
        dt = self.perf.decode_time(self.num_running, self.local.num_context_tokens)
        waits = [remote.offload.step_overhead(remote.seqs.num_seqs,
                                              remote.seqs.num_context_tokens,
                                              self.local.num_context_tokens, poll)
                 for remote, poll in zip(self.remotes, polls, strict=True)
                 if remote.seqs.num_seqs]
        return dt + max(waits, default=0.0)

    def finish_decode(self, now: float) -> None:
        self.local.advance()
        for remote in self.remotes:
            remote.seqs.advance()
        self.num_steps += 1
        for req in self.finishing.pop(self.num_steps, ()):
            if req.is_running and req.finish_step == self.num_steps:
                req.num_done = req.num_output
                req.seq_set.remove(req, self.num_steps)
                if self.feed is not None:
                    self.feed.sequence_finished(req.num_output)
                self._finish(req, now)

    def _finish(self, req: SimRequest, now: float) -> None:
        req.finish_s = now
        self.on_finished(req)


@dataclass
class Job:
    server: ModelServer
    plan: StepPlan | None = None


class Instance:
    """One device running one or more models' iterations, one at a time (temporal mux).

    Subclasses change `select_job` (which model runs the next iteration); the default
    prefers the model whose oldest waiting request arrived first (FCFS across models, as
    vLLM is within one model), else round-robins across models with running sequences."""

    def __init__(self, engine: Engine, name: str, servers: list[ModelServer]) -> None:
        self.engine = engine
        self.name = name
        self.servers = {s.name: s for s in servers}
        self.is_busy = False
        self.busy_s = 0.0
        self.num_steps = 0
        self.last_decode_s = 0.0
        self.external_loads: dict[str, float] = {}  # share of time serving others' attention
        self.poll_overhead_s = 0.0  # per step, for checking the offload channel
        self.idle_poll_interval_s = IDLE_POLL_INTERVAL_S
        # The cold model's operators as a task sees them (split chunks counted one by one);
        # None: unsplit (perf_model.operator_fractions).
        self.operator_fractions: tuple[float, ...] | None = None
        self.split_chunks: dict[str, int] = {}  # the cold model's split plan, when split
        self.cold_load = ColdLoad()  # its steps, for the TPOT factor weaving costs it
        self._rr = 0

    # --- load seen by routers and by offloaded attention ----------------------------
    @property
    def num_queued(self) -> int:
        return sum(s.num_queued for s in self.servers.values())

    def busy_fraction(self) -> float:
        return self.busy_s / self.engine.now if self.engine.now > 0 else 0.0

    def poll_context(self) -> PollContext:
        server = next(iter(self.servers.values()))
        step = self.last_decode_s or server.perf.decode_time(1, 0)
        fractions = self.operator_fractions or operator_fractions(server.perf.shape)
        return PollContext(step, fractions, self.busy_fraction(), self.idle_poll_interval_s)

    # --- event handling -------------------------------------------------------------
    def submit(self, req: SimRequest, now: float) -> list[Event]:
        req.instance = self.name
        self.servers[req.model].enqueue(req)
        return self.kick(now)

    def kick(self, now: float) -> list[Event]:
        if self.is_busy:
            return []
        return self._start_step(now)

    def select_job(self, exclude: set[str]) -> Job | None:
        """The model to run next, among those not in `exclude`."""
        servers = [s for s in self.servers.values() if s.name not in exclude]
        admitting = [s for s in servers if s.can_admit()]
        if admitting:
            return Job(min(admitting, key=lambda s: s.waiting[0].trace.arrival_s))
        ready = [s for s in servers if s.has_step()]
        if not ready:
            return None
        self._rr = (self._rr + 1) % len(ready)
        return Job(ready[self._rr])

    def _start_step(self, now: float) -> list[Event]:
        tried: set[str] = set()
        while True:
            job = self.select_job(tried)
            if job is None:  # idle until an arrival, a transfer or a re-balance kicks it
                self.is_busy = False
                return []
            job.server.step_starts(now)
            job.plan = job.server.plan_step()
            if job.plan.num_decode or job.plan.chunks:
                break
            tried.add(job.server.name)  # e.g. its quota shrank: let another model run
        dt = self._begin(job)
        self.is_busy = True
        return [self.engine.event(now + dt, f"{self.name}.step",
                                  lambda t, job=job: self._end_step(job, t))]

    def _begin(self, job: Job) -> float:
        """Account for a planned step that starts now; returns how long it takes alone."""
        server = job.server
        polls = [remote.instance.poll_context() for remote in server.remotes]
        own_s = server.step_time(job.plan, polls)
        dt = self._inflate(own_s)
        self.cold_load.record(dt, self._task_s(own_s))
        if job.plan.num_decode:
            self.last_decode_s = dt
            self._report_remote_load(server, dt)
        self.busy_s += dt
        self.num_steps += 1
        return dt

    def _external_share(self) -> float:
        # Offloaded attention steals a share of this device's time (Weaver §5: cold TPOT
        # grows by the attention it serves plus polling), capped so a step still ends.
        return min(sum(self.external_loads.values()), 0.9)

    def _inflate(self, dt: float) -> float:
        return dt / (1.0 - self._external_share()) + (
            self.poll_overhead_s if self.external_loads else 0.0)

    def _task_s(self, own_s: float) -> float:
        """What `_inflate` adds to a step of `own_s` for the offloaded attention alone."""
        share = self._external_share()
        return own_s * share / (1.0 - share)

    def tpot_factor(self) -> float:
        """How much longer the offloaded attention makes this device's own steps, as the
        cold side measures it (weaver/weaving/cold_load.py): over its last WINDOW_S of
        steps, 1.0 while it steps too little to have a TPOT to hurt."""
        return self.cold_load.factor(self.engine.now)

    def _report_remote_load(self, server: ModelServer, dt: float) -> None:
        if dt <= 0:
            return
        for remote in server.remotes:
            busy = remote.offload.remote_busy_time(remote.seqs.num_context_tokens)
            remote.instance.external_loads[f"{self.name}/{server.name}"] = busy / dt

    def _end_step(self, job: Job, now: float) -> list[Event]:
        job.server.step_ended(job.plan, now)
        events = job.server.finish_step(job.plan, now)
        return events + self._start_step(now)
