"""The features of a deployment as parts of one `weaver serve` lifecycle.

Weaving, operator splitting, colocation (mux), a colocated group's unified KV pool and the
phase split each take part in serving through one object with the same small interface,
every hook a no-op unless the feature needs it:

1. `engine_section(model)`: its keys of the engine's `weaver` block (additional_config);
2. `set_up(stack, registry)`: before any engine starts (shared objects, its /metrics
   collectors, and, on `stack`, what to reclaim once every engine has stopped);
3. `before_engine_start(model)`: before each start of an engine, restarts included;
4. `after_start(engines, stack)`: once every engine is up (link what spans engines);
5. `health()` and `refresh()`: its part of /health, and its counters pulled in before a
   scrape.

`start_engines` (weaver/server/app.py) and the engine-argument builder (`engine_configs`)
loop over `serve_features`; a new feature is a class in its own module and one line there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from weaver.config.deployment import Deployment
from weaver.kv.pool_plan import PoolPlan
from weaver.vllm_ext.additional_config import merge_sections


class ServeFeature:
    """One feature's part in serving; see the module docstring for when each hook runs."""

    def engine_section(self, model: str) -> dict[str, Any]:
        return {}

    def set_up(self, stack: contextlib.AsyncExitStack, registry: CollectorRegistry) -> None:
        """Before any engine starts; cleanup goes on `stack` (it runs after every engine
        has stopped, also when start-up fails half-way)."""

    def before_engine_start(self, model: str) -> None:
        """Before each start of `model`'s engine (a restart too)."""

    async def after_start(self, engines: Mapping[str, Any],
                          stack: contextlib.AsyncExitStack) -> None:
        """Every engine is up (`engines`: name -> SupervisedEngine)."""

    def health(self) -> dict[str, Any]:
        return {}

    async def refresh(self) -> None:
        """Pull what the engines count into /metrics and /health (before a scrape)."""


def serve_features(deployment: Deployment, model_dirs: Mapping[str, Path],
                   mux_pools: Mapping[str, PoolPlan]) -> list[ServeFeature]:
    """The deployment's features, in the order their hooks run; `mux_pools`: the unified
    pool of each colocated group that keeps one (weaver/server/mux_pool.py)."""
    from weaver.server.mux import Colocation
    from weaver.server.mux_pool import MuxPools
    from weaver.server.phase_split import PhaseSplit
    from weaver.server.splitting import OperatorSplitting
    from weaver.server.weaving import Weaving

    return [Weaving.plan(deployment, model_dirs), OperatorSplitting(deployment),
            Colocation(deployment), MuxPools(deployment, mux_pools), PhaseSplit(deployment)]


def engine_configs(deployment: Deployment, features: Sequence[ServeFeature]
                   ) -> dict[str, dict]:
    """Each engine's `additional_config`: the sections its features write."""
    return {spec.name: merge_sections(*(f.engine_section(spec.name) for f in features))
            for spec in deployment.models}


def planned_engine_configs(deployment: Deployment, model_dirs: Mapping[str, Path]
                           ) -> dict[str, dict]:
    """The engines' blocks `weaver serve` would write, planned afresh (its pools included)
    for a command that starts nothing: ValueError where serving would refuse."""
    from weaver.server.mux_pool import plan_mux_pools

    return engine_configs(deployment, serve_features(deployment, model_dirs,
                                                     plan_mux_pools(deployment, model_dirs)))


def features_health(features: Sequence[ServeFeature]) -> dict[str, Any]:
    return {key: value for feature in features for key, value in feature.health().items()}


async def refresh_features(features: Sequence[ServeFeature]) -> None:
    for feature in features:
        await feature.refresh()
