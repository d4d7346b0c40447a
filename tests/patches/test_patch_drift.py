"""The patch registry (patches/registry.py): every change Weaver makes to vLLM outside its
official hooks is listed, its targets are where it expects them, and a missing one stops
start-up with a message that says what moved and how to fix it."""

from __future__ import annotations

import importlib
import pkgutil
import threading

import pytest

pytest.importorskip("vllm")

import weaver.patches  # noqa: E402
from weaver.patches import (  # noqa: E402
    block_pool_class,
    prometheus_logger_lock,
    worker_step_lock,
    worker_step_turns,
)
from weaver.patches.registry import PATCHES, PatchTargetMissing, check_targets  # noqa: E402


@pytest.mark.parametrize("patch", PATCHES, ids=[p.name for p in PATCHES])
def test_every_target_of_a_patch_is_where_it_expects(patch):
    problems = [target.problem() for target in patch.targets]
    assert problems == [None] * len(patch.targets)


@pytest.mark.parametrize("patch", PATCHES, ids=[p.name for p in PATCHES])
def test_a_patch_says_why_how_and_when_it_can_go(patch):
    importlib.import_module(f"weaver.patches.{patch.name}")
    assert patch.targets and patch.why and patch.how and patch.remove_when


def test_every_patch_module_is_in_the_registry():
    modules = {m.name for m in pkgutil.iter_modules(weaver.patches.__path__)}
    assert modules - {"registry"} == {p.name for p in PATCHES}


def test_a_missing_target_stops_start_up_and_names_the_patch(monkeypatch):
    from vllm.v1.worker import gpu_worker

    from weaver.vllm_ext import plugin

    for cls in gpu_worker.Worker.__mro__:  # gone from the worker and its bases
        if "sample_tokens" in vars(cls):
            monkeypatch.delattr(cls, "sample_tokens")
    with pytest.raises(PatchTargetMissing, match="patches/worker_step_lock.py.*sample_tokens"):
        check_targets()
    monkeypatch.setitem(plugin._state, "registered", False)
    with pytest.raises(PatchTargetMissing, match="install the vLLM version Weaver pins"):
        plugin.register()
    assert not plugin._state["registered"]  # tried again, and refused again, next time


def test_a_changed_signature_is_a_missing_target(monkeypatch):
    from vllm.v1.core.block_pool import BlockPool

    monkeypatch.setattr(BlockPool, "get_new_blocks", lambda self, n, extra: None)
    with pytest.raises(PatchTargetMissing, match="get_new_blocks takes"):
        check_targets()


class _Worker:
    def __init__(self) -> None:
        self.lock_held: list[bool] = []
        self.lock = threading.Lock()

    def execute_model(self, scheduler_output):
        self.lock_held.append(self.lock.locked())
        return scheduler_output

    def sample_tokens(self, grammar_output):
        self.lock_held.append(self.lock.locked())
        return grammar_output


def test_the_step_lock_is_held_around_each_step_and_the_originals_kept():
    worker = _Worker()
    worker_step_lock.install(worker, worker.lock)
    assert worker.execute_model("out") == "out" and worker.sample_tokens("g") == "g"
    assert worker.lock_held == [True, True]
    worker_step_lock.uninstall(worker)
    worker.execute_model("out")
    assert worker.lock_held == [True, True, False]


def test_the_step_lock_refuses_a_worker_it_cannot_wrap():
    with pytest.raises(PatchTargetMissing, match="no execute_model"):
        worker_step_lock.install(object(), threading.Lock())


def test_only_a_vllm_block_pool_changes_class():
    from weaver.vllm_ext.block_pool import AllocatorBlockPool

    with pytest.raises(PatchTargetMissing, match="not the vLLM BlockPool"):
        block_pool_class.adopt(object(), AllocatorBlockPool)


class _TwoPhaseWorker:
    """A worker whose execute_model returns None (sampling follows) for odd steps."""

    def __init__(self, events: list[str]) -> None:
        self.events = events

    def execute_model(self, scheduler_output):
        self.events.append(f"forward {scheduler_output}")
        if scheduler_output == "boom":
            raise RuntimeError("forward failed")
        return None if scheduler_output == "two-phase" else "output"

    def sample_tokens(self, grammar_output):
        self.events.append("sample")
        return "sampled"


def test_a_turn_spans_the_step_and_is_given_back_after_its_output_or_failure():
    events: list[str] = []
    worker = _TwoPhaseWorker(events)

    def begin(scheduler_output) -> bool:
        events.append("turn")
        return scheduler_output != "empty"

    worker_step_turns.install(worker, begin, lambda: events.append("done"))
    assert worker.execute_model("one-phase") == "output"
    assert worker.execute_model("two-phase") is None
    assert worker.sample_tokens(None) == "sampled"
    with pytest.raises(RuntimeError):
        worker.execute_model("boom")
    worker.execute_model("empty")  # nothing scheduled: no turn to give back
    assert events == ["turn", "forward one-phase", "done",
                      "turn", "forward two-phase", "sample", "done",
                      "turn", "forward boom", "done",
                      "turn", "forward empty"]
    worker_step_turns.uninstall(worker)
    worker.execute_model("one-phase")
    assert events[-1] == "forward one-phase"


class _OverlapCounter:
    """A stand-in for a logger's __init__ that records how many calls ran at once."""

    def __init__(self) -> None:
        self.inside = self.most = 0
        self.lock = threading.Lock()

    def __call__(self) -> None:
        import time

        with self.lock:
            self.inside += 1
            self.most = max(self.most, self.inside)
        time.sleep(0.05)
        with self.lock:
            self.inside -= 1


def _most_at_once(init) -> int:
    threads = [threading.Thread(target=init) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return init.most if isinstance(init, _OverlapCounter) else init.__wrapped__.most


def test_prometheus_loggers_are_built_one_at_a_time():
    """Two engines built at once each register vLLM's metrics; the wrapper makes their
    loggers take turns (the unwrapped stand-in overlaps, the wrapped one never does)."""
    assert _most_at_once(_OverlapCounter()) > 1
    assert _most_at_once(prometheus_logger_lock.one_at_a_time(_OverlapCounter())) == 1


def test_the_prometheus_lock_wraps_vllms_logger_once_and_keeps_its_signature():
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    prometheus_logger_lock.install()
    wrapped = PrometheusStatLogger.__init__
    prometheus_logger_lock.install()
    assert PrometheusStatLogger.__init__ is wrapped  # not wrapped twice
    assert getattr(wrapped, "_weaver_built_one_at_a_time", False)
    check_targets()  # the drift check still sees vLLM's parameters through the wrapper
