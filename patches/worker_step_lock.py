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

from weaver.patches.registry import PatchTargetMissing

STEP_METHODS = ("execute_model", "sample_tokens")


def install(worker: Any, lock: threading.Lock) -> None:
    """Rebind the worker's step methods to hold `lock`; raises if vLLM renamed one."""
    originals = {}
    for name in STEP_METHODS:
        method = getattr(worker, name, None)
        if not callable(method):
            raise PatchTargetMissing(
                f"{type(worker).__name__} has no {name}(): vLLM's worker loop changed, and "
                "the cold worker's step lock would be silently dropped (patches/"
                "worker_step_lock.py)")
        originals[name] = method
    for name, method in originals.items():
        setattr(worker, f"_weaver_original_{name}", method)
        setattr(worker, name, _holding(lock, method))


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
