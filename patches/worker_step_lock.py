"""Hold the cold runtime's step lock around each of a cold worker's steps.

vLLM's worker loop calls ``worker.execute_model`` then ``worker.sample_tokens`` for every
step. A cold worker also serves offloaded attention from an idle thread between its steps
(weaver/weaving/cold.py), and the two must never overlap, so both methods of that worker
instance are rebound to wrappers that take the lock. The originals are kept on the
instance (``_weaver_original_<name>``) and put back by ``uninstall``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from .registry import PatchTargetMissing

STEP_METHODS = ("execute_model", "sample_tokens")


def install(worker: Any, lock: threading.Lock) -> None:
    """Rebind the worker's step methods to hold `lock`; raises if vLLM renamed one."""
    originals = step_methods(worker, "the cold worker's step lock would be silently dropped "
                                     "(patches/worker_step_lock.py)")
    rebind_step_methods(worker, {name: _holding(lock, method)
                                 for name, method in originals.items()})


def step_methods(worker: Any, consequence: str) -> dict[str, Callable[..., Any]]:
    """The worker's step methods by name; PatchTargetMissing saying `consequence` if vLLM
    renamed one (also used by patches/worker_step_turns.py)."""
    methods = {}
    for name in STEP_METHODS:
        method = getattr(worker, name, None)
        if not callable(method):
            raise PatchTargetMissing(f"{type(worker).__name__} has no {name}(): vLLM's worker "
                                     f"loop changed, and {consequence}")
        methods[name] = method
    return methods


def rebind_step_methods(worker: Any, wrappers: dict[str, Callable[..., Any]]) -> None:
    """Put `wrappers` in place of the worker instance's step methods, keeping the originals
    as ``_weaver_original_<name>`` for ``uninstall``."""
    for name, wrapper in wrappers.items():
        setattr(worker, f"_weaver_original_{name}", getattr(worker, name))
        setattr(worker, name, wrapper)


def uninstall(worker: Any) -> None:
    for name in STEP_METHODS:
        original = worker.__dict__.pop(f"_weaver_original_{name}", None)
        if original is not None:
            worker.__dict__.pop(name, None)


def _holding(lock: threading.Lock, method: Callable[..., Any]) -> Callable[..., Any]:
    def stepping(*args: Any, **kwargs: Any) -> Any:
        with lock:
            return method(*args, **kwargs)

    return stepping
