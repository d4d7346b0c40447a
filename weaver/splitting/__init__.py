"""Operator splitting for the cold model (Weaver paper §4.2), pure Python.

- ``queueing``: the polling-system model of how long an offloaded task waits (W, p99, stall).
- ``algorithm``: Algorithm 1, which splits the longest cold operators into a ``SplitPlan``.
- ``profile``: the JSON profile of operator times (T_i) and hot-side times (K, N), which
  the profilers write (weaver.profiling.timer times them).
- ``report``: the text table `weaver plan-split` prints.
"""
