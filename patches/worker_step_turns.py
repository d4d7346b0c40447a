"""Make each step of a worker wait for its turn (colocated models, weaver/mux/).

vLLM's worker loop runs a step as ``worker.execute_model(scheduler_output)`` and, when that
returns None, ``worker.sample_tokens(grammar_output)``; the step is over when one of them
returns an output. Both methods of the worker instance are rebound: ``begin(scheduler_output)``
runs before the forward pass (it blocks until the turn is granted) and ``end()`` once the
step's output exists or the step failed. The originals are kept on the instance
(``_weaver_original_<name>``) and put back by ``uninstall``; the method check and the
rebinding are patches/worker_step_lock.py's, which wraps the same two methods.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .worker_step_lock import rebind_step_methods, step_methods, uninstall

__all__ = ["install", "uninstall"]


def install(worker: Any, begin: Callable[[Any], bool], end: Callable[[], None]) -> None:
    """Rebind the worker's step methods; `begin` returns False for a step that needs no turn
    (nothing scheduled). Raises if vLLM renamed a method."""
    originals = step_methods(worker, "colocated models would run their steps unscheduled "
                                     "(patches/worker_step_turns.py)")
    holding = {"turn": False}

    def execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        holding["turn"] = begin(scheduler_output)
        try:
            output = originals["execute_model"](scheduler_output, *args, **kwargs)
        except BaseException:
            _end_turn()
            raise
        if output is not None:
            _end_turn()
        return output

    def sample_tokens(*args: Any, **kwargs: Any) -> Any:
        try:
            return originals["sample_tokens"](*args, **kwargs)
        finally:
            _end_turn()

    def _end_turn() -> None:
        if holding["turn"]:
            holding["turn"] = False
            end()

    rebind_step_methods(worker, {"execute_model": execute_model,
                                 "sample_tokens": sample_tokens})
