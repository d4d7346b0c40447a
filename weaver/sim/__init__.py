"""Cluster simulator and planner for multi-LLM serving (pure Python: no vLLM, no CUDA).

Pieces, one job each:
- `profile`: the JSON profile format (PROFILE_FORMAT.md) and roofline profiles from
  published device specs (measured profiles and their calibrations: `weaver.profiling`);
- `perf_model`: interpolated step times, offload (weaving) costs, poll wait, KV transfer;
- `engine`: discrete events ordered by (time, id), actions return follow-up events;
- `instance`: continuous batching with chunked prefill and paged KV capacity;
- `policies/`: dedicated, mux_temporal, muxserve, splitwise, weaver (registry by name);
- `planner`: MuxServe-style enumeration + greedy placement, extended with weaving;
- `workload`: requests from `weaver.workloads` (as `weaver bench` builds them) or replayed
  from a saved bench run; `deployment`: a cluster mirroring a deployment file;
  `validate`: sim vs measured runs through `weaver.results.metrics`;
- `config`, `runner`, `metrics`, `plots`: YAML configs, runs and sweeps, JSON results,
  plots from saved JSON. The commands are in `weaver.cli.simulate`.

Example: `weaver simulate paper_a100 --out results/sim` (a packaged config name or a path).
"""
