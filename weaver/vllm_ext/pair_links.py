"""An engine of a weaving pair links itself once its EngineCore is up, under both launchers.

Its `link` section (weaver/vllm_ext/additional_config.py: written by `weaver serve`'s plan
or, under plain `vllm serve`, by the plugin from the user's block) says which side it is:
- a cold engine's worker starts serving regions (`weaver_join_pairs`: a ColdLink thread
  makes one for each hot engine that publishes a plan, weaver/weaving/pair_link.py);
- a hot engine's scheduler gets a HotLink per pair (one per cold engine it weaves into),
  ticked before each step, which attaches that cold side's region through the worker
  (`weaver_attach_hot`, vLLM's collective_rpc) and publishes the pair's counters.
Reached from the plugin's EngineCore hook (weaver/vllm_ext/plugin.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from weaver.vllm_ext.additional_config import hot_plans, link_of


def on_engine_core_ready(engine_core: Any) -> None:
    vllm_config = engine_core.vllm_config
    link = link_of(vllm_config.additional_config)
    if link is None:
        return
    rpc = engine_core.model_executor.collective_rpc
    if link.role == "cold":
        rpc("weaver_join_pairs", args=(link.to_dict(),))
        return
    from weaver.weaving.pair_link import HotLink
    from weaver.weaving.rendezvous import PairFiles

    plans = hot_plans(vllm_config)
    if len(plans) != len(link.pairs):
        raise ValueError(f"a hot engine's link section names pairs {list(link.pairs)} but it "
                         f"has {len(plans)} plan(s) (additional_config weaver.hot): one each")
    files = PairFiles(Path(link.root))
    scheduler = engine_core.scheduler
    hot = scheduler.weaver_hot
    hot.links = [
        HotLink(files, pair, plan,
                attach=lambda plan_data, handle: rpc("weaver_attach_hot",
                                                     args=(plan_data, handle)),
                read_stats=_stats_reader(rpc, plan.cold),
                # a unified pool dies with its cold engine: its blocks are let go first
                before_reattach=(lambda: hot.cold_restarted(scheduler))
                if plan.pool is not None else None)
        for pair, plan in zip(link.pairs, plans, strict=True)]


def _stats_reader(rpc: Any, cold: str) -> Any:
    return lambda: rpc("weaver_stats", args=(cold,))[0]
