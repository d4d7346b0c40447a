"""Build vLLM's Prometheus stat loggers one at a time in a process.

``PrometheusStatLogger.__init__`` first unregisters every ``vllm:`` collector from the
process's Prometheus registry, then registers its own, one metric after another. The
gateway builds several engines side by side, each in a thread of its own
(weaver/vllm_ext/engine/app.py); two loggers built at the same moment interleave those
two loops, and one of them registers a name the other has just registered:
``DuplicateTimeseries``, and that engine's start fails (seen starting the default pair of
two identical engines, both ready at once). ``install`` wraps the class's ``__init__``
(class-wide, once per process) in one lock, so the loggers take turns; the rest of each
engine's start-up still runs side by side.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

from .registry import PatchTargetMissing

_LOCK = threading.Lock()
_MARK = "_weaver_built_one_at_a_time"


def install() -> None:
    """Serialise PrometheusStatLogger.__init__ in this process (idempotent)."""
    try:
        from vllm.v1.metrics.loggers import PrometheusStatLogger
    except ImportError as exc:
        raise PatchTargetMissing(f"vllm.v1.metrics.loggers.PrometheusStatLogger is gone "
                                 f"({exc}; patches/prometheus_logger_lock.py)") from None
    with _LOCK:
        if getattr(PrometheusStatLogger.__init__, _MARK, False):
            return
        PrometheusStatLogger.__init__ = one_at_a_time(PrometheusStatLogger.__init__)


def one_at_a_time(init: Any) -> Any:
    """`init` held under the process-wide lock."""
    @functools.wraps(init)
    def locked_init(*args: Any, **kwargs: Any) -> None:
        with _LOCK:
            init(*args, **kwargs)

    setattr(locked_init, _MARK, True)
    return locked_init
