"""Poll points after the cold model's operators: each operator's ``forward``, wrapped.

Why not ``register_forward_hook``: a module with any hook leaves ``nn.Module``'s fast
path (``_call_impl`` then walks the hook dicts and rebuilds the call). Measured on this
machine with a tiny Linear: +7.5 us per call with a no-op hook, +0.3 us with a wrapped
``forward``. The cold model has ~150 poll-point operators per decode step, so hooks
cost about 1 ms of each ~66 ms step (1.6 % of its TPOT) before any task is served.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

Poll = Callable[[], Any]  # the cold worker's poll of its offload regions


class PollPoints:
    """Runs ``poll()`` right after ``forward`` of each given module; ``remove()`` undoes it.

    The wrapper is an instance attribute, so ``nn.Module.__call__`` still takes its
    no-hook path and calls it as ``self.forward``. A module whose ``forward`` was
    already replaced on the instance keeps that replacement underneath ours.
    """

    def __init__(self, modules: Iterable[torch.nn.Module], poll: Poll) -> None:
        self._poll = poll
        # (module, our wrapper, the instance attribute we shadowed or None)
        self._installed: list[tuple[torch.nn.Module, Any, Any]] = []
        for module in modules:
            if any(module is m for m, _, _ in self._installed):
                continue  # one poll per call, even if a module is listed twice
            shadowed = module.__dict__.get("forward")
            wrapper = self._wrap(module.forward)
            module.forward = wrapper
            self._installed.append((module, wrapper, shadowed))

    def __len__(self) -> int:
        return len(self._installed)

    def _wrap(self, forward: Callable[..., Any]) -> Callable[..., Any]:
        poll = self._poll

        def forward_then_poll(*args: Any, **kwargs: Any) -> Any:
            output = forward(*args, **kwargs)
            poll()
            return output

        return forward_then_poll

    def remove(self) -> None:
        """Restore every module's ``forward``; a second call does nothing."""
        for module, wrapper, shadowed in reversed(self._installed):
            if module.__dict__.get("forward") is not wrapper:
                raise RuntimeError(
                    f"{type(module).__name__}.forward was replaced after the poll point was "
                    "installed; refusing to undo someone else's wrapper")
            if shadowed is None:
                del module.forward
            else:
                module.forward = shadowed
        self._installed = []
