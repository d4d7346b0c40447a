"""Weaver's measurements, in one package: what `weaver profile`, `weaver plan-split` and
`weaver offload-probe` measure and how measurements become profiles.

- ``timer``: the one timer (min/mean/median of repeated runs, on any device);
- ``torch_layers``: a simulator profile timed on this CPU with random-weight layers;
- ``engine_profile``: which engine steps to time and how they become a profile (the
  timing itself is vLLM's engine: weaver/vllm_ext/engine/timing.py);
- ``serving_probe`` + ``serving_calibration``, ``weaving_calibration``: the overhead of
  the real serving (and weaving) path, measured through `weaver serve`, fitted into a
  profile;
- ``task_timing``: an offloaded attention task as the cold side pays it, through a real
  region; ``channel_probe`` + ``probe_config``: round trips between two processes.

Imports no vLLM: the executors and engines that need it are passed in by the callers
(weaver/cli, weaver/vllm_ext).
"""
