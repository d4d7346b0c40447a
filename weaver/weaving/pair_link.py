"""A weaving pair's two sides connecting themselves, under both launchers.

Each engine does its part through the rendezvous files (weaver/weaving/rendezvous.py), so no
process in front has to be up, and either side may start first, die or restart. `weaver
serve` only plans the pairs, hands each engine its part (weaver/server/weaving.py) and
reads the same files as a plain `vllm serve` does (weaver/weaving/pair_metrics.py):
- `ColdLink` (a thread in the cold worker): for each pair it serves, waits for the hot
  engine's plan, creates the region for it (within the memory it lends), and answers with
  the region's name. A plan that changes (the hot engine restarted differently) gets a new
  region; a dead predecessor's regions are unlinked when the cold engine starts.
- `HotLink` (in the hot engine's scheduler process, ticked by its scheduler every step):
  publishes the plan, attaches each new region the cold side answers with (a restarted cold
  engine's too: the running remote sequences' K/V is carried over by
  HotWeaving.take_over_from), and says whether the pair is connected, so that sequences are
  placed remotely only then.
Both publish their counters. Pure Python: vLLM is reached through the callables the engine
hook hands in (weaver/vllm_ext/pair_links.py).
"""

from __future__ import annotations

import bisect
import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from weaver.offload.naming import cold_region_prefix, region_name, region_paths
from weaver.weaving import rendezvous
from weaver.weaving.cold import ColdWeaving
from weaver.weaving.plan import PairPlan, region_bytes_of
from weaver.weaving.rendezvous import PairFiles
from weaver.weaving.series import WAIT_BUCKETS

logger = logging.getLogger(__name__)

LINK_INTERVAL_S = 0.2  # how often each side looks at the other's file
STATS_INTERVAL_S = 1.0  # how often each side publishes its counters
RETRY_AFTER_FAILURE_S = 5.0


def _unnamed(plan_data: dict) -> dict:
    """A plan as data, without its region's name, as it reads back from a pair's file
    (tuples become lists there)."""
    return json.loads(json.dumps({**plan_data, "region_name": ""}))


def remove_dead_cold_region(pair: str, answer: dict[str, Any] | None) -> list[str]:
    """Unlink the region files named in the pair's cold answer (its `<pair>.cold.json`, as
    read) if the cold engine died without doing so (killed; `vllm serve` also force-kills
    its worker on SIGTERM unless given a --shutdown-timeout): a mapping that is still open
    stays valid, a name is all that goes. Returns the paths removed."""
    if answer is None or rendezvous.is_alive(answer.get("pid")) \
            or not answer.get("region_name"):
        return []
    removed = []
    for path in region_paths(answer["region_name"]):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            removed.append(path)
    if removed:
        logger.warning("weaving pair %s: removed the region a dead cold engine left: %s",
                       pair, removed)
    return removed


class ColdLink:
    def __init__(self, files: PairFiles, pairs: list[str], lend_bytes: int, cold_model: str,
                 cold: ColdWeaving, make_executor: Callable[[PairPlan], Any]) -> None:
        self.files = files
        self.pairs = [rendezvous.check_pair_name(p) for p in pairs]
        self.lend_bytes = lend_bytes
        self.cold_model = cold_model
        self.cold = cold
        self.make_executor = make_executor
        self.served: dict[str, PairPlan] = {}  # pair -> the plan its region was made for
        self.refused: dict[str, str] = {}  # pair -> why its plan was refused
        self._num_regions = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_stats = 0.0

    def start(self) -> None:
        for pair in self.pairs:
            remove_dead_cold_region(pair, self.files.read_even_if_dead(pair, "cold"))
            self.files.publish(pair, "cold", {"status": "waiting", "model": self.cold_model})
        self._thread = threading.Thread(target=self._loop, name="weaver-cold-link",
                                        daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(LINK_INTERVAL_S):
            for pair in self.pairs:
                try:
                    self.step(pair)
                except Exception:  # one bad plan must not stop the other pairs
                    logger.exception("weaving pair %s: could not serve the hot plan", pair)
            if time.monotonic() - self._last_stats >= STATS_INTERVAL_S:
                self.publish_stats()

    def step(self, pair: str) -> None:
        """Serve the pair's hot plan if it is new or changed."""
        hot = self.files.read(pair, "hot")
        if hot is None:
            return  # no hot engine (yet, or any more): a region already made stays
        plan = PairPlan.from_dict(_unnamed(hot["plan"]))
        served = self.served.get(pair)
        if served is not None and replace(served, region_name="") == plan:
            return
        if self.refused.get(pair) == repr(plan):
            return
        if served is not None:
            self.cold.remove(served.region_name)
            del self.served[pair]
            logger.info("weaving pair %s: the hot engine's plan changed; region %s closed",
                        pair, served.region_name)
        # Remote KV in a pool of pages (this engine's unified pool, or the loan pool of
        # its hot models, which holds exactly what it lends) is bounded by the pool's
        # quotas; in a region, by what this engine lends.
        wanted = region_bytes_of(plan.shape, plan.num_remote_blocks) if plan.pool is None else 0
        in_use = sum(region_bytes_of(p.shape, p.num_remote_blocks)
                     for p in self.served.values() if p.pool is None)
        if in_use + wanted > self.lend_bytes:
            reason = (f"the hot engine {plan.hot!r} wants {wanted / 2**30:.3f} GiB of KV, "
                      f"more than this cold engine's lend_kv_gib leaves "
                      f"({(self.lend_bytes - in_use) / 2**30:.3f} GiB); lower its "
                      "remote_kv_gib or raise this engine's lend_kv_gib")
            logger.error("weaving pair %s refused: %s", pair, reason)
            self.refused[pair] = repr(plan)
            self.files.publish(pair, "cold", {"status": "refused", "reason": reason,
                                              "model": self.cold_model})
            return
        self.refused.pop(pair, None)
        self._num_regions += 1
        named = replace(plan, region_name=region_name(
            cold_region_prefix(os.getpid(), self._num_regions), plan.hot, pair))
        self.cold.add(named, self.make_executor)
        self.served[pair] = named
        self.files.publish(pair, "cold", {
            "status": "ready", "model": self.cold_model, "region_name": named.region_name,
            "plan": named.to_dict(),
            "cuda_handle": self.cold.export_handles().get(named.region_name)})
        logger.info("weaving pair %s: region %s made for hot engine %r (%d remote blocks)",
                    pair, named.region_name, plan.hot, plan.num_remote_blocks)

    def publish_stats(self) -> None:
        self._last_stats = time.monotonic()
        by_region = {s["region"]: s for s in self.cold.stats()}
        for pair, plan in self.served.items():
            stats = by_region.get(plan.region_name, {})
            self.files.publish(pair, "cold.stats", {"hot": plan.hot, "cold": self.cold_model,
                                                    **stats})

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        for pair in self.pairs:
            self.files.withdraw(pair, "cold")
            self.files.withdraw(pair, "cold.stats")


class HotLink:
    def __init__(self, files: PairFiles, pair: str, plan: PairPlan,
                 attach: Callable[[dict, str | None], Any],
                 read_stats: Callable[[], dict],
                 before_reattach: Callable[[], None] | None = None) -> None:
        self.files = files
        self.pair = rendezvous.check_pair_name(pair)
        self.plan = plan
        self.attach = attach
        self.read_stats = read_stats
        # Runs before a restarted cold engine's new region is attached, when something the
        # hot side keeps of the old one must be let go first (blocks of a unified pool that
        # died with it: weaver/vllm_ext/scheduler.py HotRouting.cold_restarted).
        self.before_reattach = before_reattach
        self.attached_region: str | None = None
        self.connected = False
        self.num_attaches = 0
        self.num_attach_failures = 0
        self.last_attach_error: str | None = None
        # The offload waits so far, cumulative per bucket of WAIT_BUCKETS (+Inf last), and
        # their sum: a histogram any reader can export.
        self.wait_counts = [0] * (len(WAIT_BUCKETS) + 1)
        self.wait_sum_s = 0.0
        self._next_look = 0.0
        self._next_stats = 0.0
        self._said_gone = False
        self._said_refused: str | None = None
        files.publish(pair, "hot", {"plan": plan.to_dict(), "model": plan.hot})

    def tick(self, now: float | None = None) -> None:
        """Called by the scheduler before each step; looks at the cold side's file at most
        every LINK_INTERVAL_S, so a step costs a clock read otherwise."""
        now = time.monotonic() if now is None else now
        if now >= self._next_look:
            self._next_look = now + LINK_INTERVAL_S
            self._look(now)
        if now >= self._next_stats:
            self._next_stats = now + STATS_INTERVAL_S
            self.publish_stats()

    def _look(self, now: float) -> None:
        # One read of the cold side's file: alive, it is the answer; dead, its region's
        # names are removed (nothing left to remove after the first time).
        cold = self.files.read_even_if_dead(self.pair, "cold")
        if cold is not None and not rendezvous.is_alive(cold.get("pid")):
            remove_dead_cold_region(self.pair, cold)
            cold = None
        if cold is not None and cold.get("status") == "refused" \
                and cold.get("reason") != self._said_refused:
            self._said_refused = cold.get("reason")
            logger.error("weaving pair %s: the cold engine refused this engine's plan: %s; "
                         "every sequence stays local", self.pair, self._said_refused)
        if cold is None or cold.get("status") != "ready":
            if self.connected and not self._said_gone:
                logger.warning("weaving pair %s: the cold engine is gone; new sequences stay "
                               "local until it is back (running remote ones fall back)",
                               self.pair)
                self._said_gone = True
            self.connected = False
            return
        if cold["region_name"] == self.attached_region:
            self.connected = True
            return
        if _unnamed(cold["plan"]) != _unnamed(self.plan.to_dict()):
            return  # the cold side has not seen this engine's plan yet
        if self.attached_region is not None and self.before_reattach is not None:
            self.before_reattach()
        try:
            self.attach(cold["plan"], cold.get("cuda_handle"))
        except Exception as exc:  # the pair stays local; tried again later
            self.num_attach_failures += 1
            self.last_attach_error = repr(exc)
            self._next_look = now + RETRY_AFTER_FAILURE_S
            self.connected = False
            logger.error("weaving pair %s: attaching region %s failed (%r); retrying in "
                         "%.0f s", self.pair, cold["region_name"], exc, RETRY_AFTER_FAILURE_S)
            return
        self.attached_region = cold["region_name"]
        self.connected = True
        self._said_gone = False
        self.num_attaches += 1
        logger.info("weaving pair %s: attached region %s of cold engine %r (attach %d)",
                    self.pair, cold["region_name"], cold.get("model"), self.num_attaches)

    def publish_stats(self) -> None:
        try:
            stats = self.read_stats()
        except Exception as exc:  # a scrape shows the last counters; the pair goes on
            logger.warning("weaving pair %s: counters unavailable: %r", self.pair, exc)
            return
        hot = dict(stats.get("hot") or {})
        for seconds in hot.pop("wait_seconds", ()):
            self.wait_counts[bisect.bisect_left(WAIT_BUCKETS, seconds)] += 1
            self.wait_sum_s += seconds
        self.files.publish(self.pair, "hot.stats", {
            "hot": self.plan.hot, "cold": self.plan.cold, "connected": self.connected,
            "attached_region": self.attached_region, "attaches": self.num_attaches,
            "attach_failures": self.num_attach_failures,
            "last_attach_error": self.last_attach_error, "wait_counts": self.wait_counts,
            "wait_sum_s": self.wait_sum_s, **hot})

    def close(self) -> None:
        self.files.withdraw(self.pair, "hot")
        self.files.withdraw(self.pair, "hot.stats")
