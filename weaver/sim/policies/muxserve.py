"""MuxServe (Duan et al., ICML'24, §4.2-4.3) on top of a placement from the planner.

The models of a shared GPU take turns by the rule a deployment's mux group runs
(`weaver.mux.turns.next_turn`, MuxServe's ADBS): steps holding prompt tokens first, decode
steps to the model with the least service per unit of weight (its request rate), and no
step passed over more than `skip_limit` times. KV memory is one pool divided into per-model
quotas, re-balanced periodically from each model's use and backlog; a GPU whose plan says
`own_kv` keeps each model's own blocks instead, as a deployment's engines do.

A GPU runs one step at a time (`temporal`, the default: the planner's simplification, no
SM partitioning), or, in `spatial-temporal` mode, a prefill beside another model's decode;
overlapping steps share the device, each running at `muxserve.overlap_speed` of its speed
alone (processor sharing: a step's end moves when the other starts or ends). While another
model of the group has work too, a step runs at `muxserve.contended_speed` besides (what
the other engine's processes cost it on shared cores; 1 by default).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import partial

from weaver.mux.turns import Kind, Member, Mode, next_turn
from weaver.sim.engine import Engine, Event
from weaver.sim.instance import Instance, Job, ModelServer
from weaver.sim.plan import MuxPlan
from weaver.sim.policies.base import Policy
from weaver.sim.profile import blocks_for

MIN_QUOTA_SHARE = 0.05  # no model's quota falls below this share of the pool


@dataclass(eq=False)
class _Running:
    """A step in progress; `done_s` counts its work in seconds of running alone."""

    job: Job
    kind: Kind
    work_s: float
    started_s: float
    since_s: float
    done_s: float = 0.0
    speed: float = 1.0
    generation: int = 0  # its end event's (0: none yet); any other is stale


class MuxServeInstance(Instance):
    def __init__(self, engine: Engine, name: str, servers: list[ModelServer],
                 weights: dict[str, float], mux: MuxPlan | None = None,
                 overlap_speed: float = 0.5, contended_speed: float = 1.0) -> None:
        super().__init__(engine, name, servers)
        mux = mux or MuxPlan()
        self.mode = Mode(mux.mode)
        self.skip_limit = mux.skip_limit
        self.own_kv = mux.own_kv
        self.overlap_speed = overlap_speed
        self.contended_speed = contended_speed
        self.weights = {m: max(mux.weights.get(m, weights[m]), 1e-9) for m in self.servers}
        self.served_s = dict.fromkeys(self.servers, 0.0)
        self.skips = dict.fromkeys(self.servers, 0)
        self.wait_since: dict[str, float] = {}
        self.running: dict[str, _Running] = {}
        self._generations = itertools.count(1)
        self.num_overlapped = 0
        if not self.own_kv:
            self.set_quotas(self.weights)

    def set_quotas(self, shares: dict[str, float]) -> None:
        if len(self.servers) == 1:
            return
        total = sum(shares.values())
        spare = 1 - MIN_QUOTA_SHARE * len(shares)
        for name, server in self.servers.items():
            share = MIN_QUOTA_SHARE + spare * shares[name] / total
            pool_bytes = server.local.pool.capacity_bytes
            server.local.quota_blocks = int(share * pool_bytes // server.local.block_bytes)

    def rebalance(self) -> None:
        """ADBS: divide memory by each model's current use plus queued demand (bytes)."""
        if self.own_kv:
            return
        demand = {}
        for name, server in self.servers.items():
            waiting = sum(blocks_for(r.trace.input_tokens + r.num_done, server.cfg.block_size)
                          for r in server.waiting)
            demand[name] = (server.local.num_blocks + waiting) * server.local.block_bytes
        if sum(demand.values()) > 0:
            self.set_quotas({m: d + 1.0 for m, d in demand.items()})

    # --- whose step runs ------------------------------------------------------------
    def _members(self, names: list[str], exclude: set[str], now: float) -> list[Member]:
        members = []
        for i, name in enumerate(names):
            server, running = self.servers[name], self.running.get(name)
            waiting = None
            if running is None and name not in exclude and server.has_step():
                waiting = Kind.PREFILL if server.prefilling or server.can_admit() \
                    else Kind.DECODE
                self.wait_since.setdefault(name, now)
            members.append(Member(i, self.weights[name], self.served_s[name], waiting,
                                  running.kind if running else None, self.skips[name],
                                  round(self.wait_since.get(name, now) * 1e9)))
        return members

    def select_job(self, exclude: set[str], now: float = 0.0) -> Job | None:
        names = list(self.servers)
        members = self._members(names, exclude, now)
        index = next_turn(members, self.mode, self.skip_limit)
        if index is None:
            return None
        for member in members:  # as the turn table counts them
            if member.waiting is not None and member.index != index:
                self.skips[names[member.index]] += 1
        self.skips[names[index]] = 0
        self.wait_since.pop(names[index], None)
        return Job(self.servers[names[index]])

    # --- steps, possibly overlapping ------------------------------------------------
    def kick(self, now: float) -> list[Event]:
        return self._start_step(now)

    def _start_step(self, now: float, exclude: set[str] = frozenset()) -> list[Event]:
        tried = set(exclude)
        while True:
            job = self.select_job(tried, now)
            if job is None:
                break
            job.plan = job.server.plan_step()
            if not (job.plan.num_decode or job.plan.chunks):
                tried.add(job.server.name)  # e.g. its quota shrank: let another model run
                continue
            dt = self._begin(job)
            self._settle(now)
            self.num_overlapped += bool(self.running)
            kind = Kind.PREFILL if job.plan.num_prefill_tokens else Kind.DECODE
            self.running[job.server.name] = _Running(job, kind, dt, now, now)
        self.is_busy = bool(self.running)
        return self._reschedule(now)  # the new steps, and new waiters may slow what runs

    def _settle(self, now: float) -> None:
        for run in self.running.values():
            run.done_s += (now - run.since_s) * run.speed
            run.since_s = now

    def _reschedule(self, now: float) -> list[Event]:
        """New end events for the running steps at the speed their number, and the other
        models' work, allow."""
        self._settle(now)
        speed = 1.0 if len(self.running) == 1 else self.overlap_speed
        events = []
        for name, run in self.running.items():
            others_busy = any(other in self.running or server.has_step()
                              for other, server in self.servers.items() if other != name)
            new_speed = speed * (self.contended_speed if others_busy else 1.0)
            if run.generation and new_speed == run.speed:
                continue  # its end event stands
            run.speed = new_speed
            # Unique across runs: a stale event of this model's previous step never
            # matches its next one.
            run.generation = next(self._generations)
            end = now + max(run.work_s - run.done_s, 0.0) / run.speed
            events.append(self.engine.event(
                end, f"{self.name}.step",
                partial(self._end_running, name, run.generation)))
        return events

    def _end_running(self, name: str, generation: int, now: float) -> list[Event]:
        run = self.running.get(name)
        if run is None or run.generation != generation:
            return []  # rescheduled since
        self._settle(now)
        del self.running[name]
        self.served_s[name] += now - run.started_s
        events = run.job.server.finish_step(run.job.plan, now)
        # The engine that just stepped is not asking yet (it handles its step's output
        # first), so a waiting engine takes the turn; then it asks again.
        return (events + self._reschedule(now) + self._start_step(now, exclude={name})
                + self._start_step(now))


class MuxServePolicy(Policy):
    name = "muxserve"

    def build(self) -> None:
        config = self.cluster.config
        for i, gpu in enumerate(self.plan.gpus):
            weights = {m: config.model(m).rate / len(self.plan.gpus_of(m)) for m in gpu.models}
            if gpu.mux is not None and gpu.mux.own_kv:
                missing = [m for m in gpu.models if config.model(m).num_blocks is None]
                if missing:
                    raise ValueError(f"GPU {i}: mux.own_kv needs num_blocks for {missing}")
            # A GPU of one model has nobody to take turns with: a plain instance (faster).
            factory = Instance if len(gpu.models) == 1 else partial(
                MuxServeInstance, weights=weights, mux=gpu.mux,
                overlap_speed=config.muxserve.overlap_speed,
                contended_speed=config.muxserve.contended_speed)
            instance = self.cluster.make_instance(f"gpu{i}", gpu.models, factory=factory,
                                                  tp=gpu.tp)
            if gpu.mux is not None and gpu.mux.own_kv:
                for name, server in instance.servers.items():
                    server.local.quota_blocks = config.model(name).num_blocks
            self.add_instance(instance)
        interval = config.muxserve.rebalance_interval_s
        self.cluster.engine.schedule(interval, "muxserve.rebalance", self._rebalance)

    def _rebalance(self, now: float) -> list[Event]:
        events: list[Event] = []
        for inst in self.instances:
            if isinstance(inst, MuxServeInstance):
                inst.rebalance()
                events.extend(inst.kick(now))  # a grown quota may admit what was waiting
        if now > self.cluster.config.duration_s and not any(i.num_queued
                                                             for i in self.instances):
            return events
        interval = self.cluster.config.muxserve.rebalance_interval_s
        return events + [self.cluster.engine.event(now + interval, "muxserve.rebalance",
                                                   self._rebalance)]
