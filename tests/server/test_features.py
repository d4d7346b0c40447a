"""The serve lifecycle's features (weaver/server/features.py): one deployment holding every
kind, each engine's block written by the features that concern it, set-up and cleanup in
the lifecycle's order, and /health and /metrics gathered from all of them."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os

import pytest
from prometheus_client import CollectorRegistry

from weaver.config.deployment import parse_deployment
from weaver.server.features import (
    ServeFeature,
    engine_configs,
    features_health,
    refresh_features,
    serve_features,
)
from weaver.server.mux_pool import MuxPools, plan_mux_pools
from weaver.server.weaving import Weaving
from weaver.vllm_ext.additional_config import KEY

SMOLLM2 = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
           "hidden_size": 576}


@pytest.fixture
def every_kind(tmp_path):
    """A weaving pair whose cold model splits its LM head, a colocated group with one KV
    pool, a phase split, and a dedicated model."""
    folder = tmp_path / "smollm2"
    folder.mkdir()
    folder.joinpath("config.json").write_text(json.dumps(SMOLLM2))
    small = {"model": "smollm2", "block_size": 32, "max_model_len": 512}
    deployment = parse_deployment({
        "models": [
            {"name": "hot", "role": "hot", **small},
            {"name": "cold", "role": "cold", "lend_kv_gib": 0.05, "split": {"lm_head": 4},
             **small},
            {"name": "a", **small, "num_gpu_blocks_override": 65},
            {"name": "b", **small, "kv_cache_gib": 0.25},
            {"name": "p0", **small}, {"name": "d0", **small}, {"name": "alone", **small}],
        "weaving": [{"hot": "hot", "cold": ["cold"], "offload_ratio": 0.5}],
        "mux": [{"name": "pair", "models": ["a", "b"], "unified_kv": True}],
        "phase_split": [{"model": "chat", "prefill": ["p0"], "decode": ["d0"]}]})
    dirs = {spec.name: folder for spec in deployment.models}
    return deployment, dirs, plan_mux_pools(deployment, dirs)


def test_each_engine_gets_the_sections_of_its_features_and_no_other(every_kind):
    deployment, dirs, pools = every_kind
    features = serve_features(deployment, dirs, pools)
    assert all(isinstance(feature, ServeFeature) for feature in features)
    sections = {name: sorted(config.get(KEY, {}))
                for name, config in engine_configs(deployment, features).items()}
    assert sections == {"hot": ["hot", "link"], "cold": ["link", "split"], "a": ["mux", "pool"],
                        "b": ["mux", "pool"], "p0": ["phase_split"], "d0": ["phase_split"],
                        "alone": []}


def test_features_set_up_and_reclaim_on_the_lifecycle_stack(every_kind):
    deployment, dirs, pools = every_kind
    features = serve_features(deployment, dirs, pools)
    registry = CollectorRegistry()
    (mux_pools,) = [f for f in features if isinstance(f, MuxPools)]

    async def lifecycle() -> list[str]:
        async with contextlib.AsyncExitStack() as stack:
            for feature in features:
                feature.set_up(stack, registry)
            # The group's pool is hosted before any engine starts, its pages in /dev/shm.
            hosted = [f"/dev/shm/{plan.pool_name}" for plan in mux_pools.pools.values()]
            assert all(os.path.exists(path) for path in hosted)
            names = {m.name for m in registry.collect()}
        assert not any(os.path.exists(path) for path in hosted)
        return sorted(names)

    names = asyncio.run(lifecycle())
    assert "weaver_offload_tasks" in names  # the weaving pairs' collector
    assert any(n.startswith("weaver_mux_kv") for n in names)  # the pool's collector
    assert any(n.startswith("weaver_mux_") and "kv" not in n for n in names)  # turn tables


def test_health_and_metrics_are_gathered_from_every_feature():
    calls = []

    class Probe(ServeFeature):
        def __init__(self, name: str) -> None:
            self.name = name

        def health(self):
            return {self.name: "ok"}

        async def refresh(self):
            calls.append(self.name)

    probes = [Probe("x"), ServeFeature(), Probe("y")]
    assert features_health(probes) == {"x": "ok", "y": "ok"}
    asyncio.run(refresh_features(probes))
    assert calls == ["x", "y"]


def test_a_hot_model_in_no_weaving_entry_is_refused_before_any_engine_starts(tmp_path):
    deployment = parse_deployment({"models": [
        {"name": "h", "model": "smollm2", "role": "hot"},
        {"name": "c", "model": "smollm2", "role": "cold"}], "weaving": []})
    with pytest.raises(ValueError, match="'h' is in no weaving entry"):
        Weaving(deployment, [], tmp_path)


def test_both_sides_of_a_pair_link_through_the_servers_own_directory(every_kind):
    deployment, dirs, pools = every_kind
    (weaving,) = [f for f in serve_features(deployment, dirs, pools) if isinstance(f, Weaving)]
    configs = engine_configs(deployment, [weaving])
    hot, cold = configs["hot"][KEY]["link"], configs["cold"][KEY]["link"]
    assert hot["role"] == "hot" and cold["role"] == "cold"
    assert hot["pairs"] == cold["pairs"] == ["p0-hot.cold"]
    assert hot["root"] == cold["root"] == str(weaving.files.root)
    assert str(os.getpid()) in hot["root"]  # no other server's pairs meet there
    assert cold["lend_bytes"] == int(0.05 * 2**30) and cold["cold_model"] == "cold"
