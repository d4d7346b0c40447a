"""A colocated group's unified KV pool in the gateway (weaver/server/mux_pool.py): its plan
from the models' own budgets, the engines' pool blocks and the /metrics series."""

from __future__ import annotations

import json

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from weaver.config.deployment import parse_deployment
from weaver.kv.owner import HostedPool
from weaver.server.mux_pool import MuxPoolCollector, MuxPools, plan_mux_pool, plan_mux_pools
from weaver.vllm_ext.additional_config import pool_of
from weaver.vllm_ext.engine.app import engine_cli_args

SMOLLM2 = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
           "hidden_size": 576}
BLOCK_BYTES = 30 * 3 * 32 * 64 * 2 * 4  # 30 layers x 3 KV heads x 32 tokens x (K|V) float32


def model_dir(tmp_path, config=SMOLLM2):
    folder = tmp_path / "smollm2"
    folder.mkdir(exist_ok=True)
    folder.joinpath("config.json").write_text(json.dumps(config))
    return folder


def group_deployment(**overrides):
    models = [
        {"name": "a", "model": "smollm2", "block_size": 32, "max_model_len": 512,
         "num_gpu_blocks_override": 65},
        {"name": "b", "model": "smollm2", "block_size": 32, "max_model_len": 512,
         "kv_cache_gib": 0.25},
        {"name": "c", "model": "smollm2"},
    ]
    for model in models:
        model.update(overrides.get(model["name"], {}))
    return parse_deployment({"models": models, "mux": [
        {"name": "pair", "models": ["a", "b"], "unified_kv": True}]})


def test_the_pool_is_the_models_own_budgets_and_each_keeps_one_sequence(tmp_path):
    deployment = group_deployment()
    dirs = dict.fromkeys("abc", model_dir(tmp_path))
    plan = plan_mux_pool(deployment, deployment.mux[0], dirs, "pfx")
    assert plan.owner is None and plan.service_address
    pages_per_block = 90  # one page per head-block: 30 layers x 3 KV heads
    assert plan.page_bytes == BLOCK_BYTES // pages_per_block
    a, b = plan.tenants
    assert a.quota_pages == 64 * pages_per_block  # the override's blocks less the null one
    assert b.quota_pages == (int(0.25 * 2**30) // BLOCK_BYTES - 1) * pages_per_block
    assert plan.num_pages == a.quota_pages + b.quota_pages
    assert a.min_quota_pages == b.min_quota_pages == 16 * pages_per_block  # 512 tokens
    assert (a.first_block_id, b.first_block_id) == (1, 1)  # vLLM's block 0 is its null block
    assert set(MuxPools(deployment, {"pair": plan}).pool_of) == {"a", "b"}


@pytest.mark.parametrize(("overrides", "message"), [
    ({"b": {"block_size": 64}}, "'b' needs block_size: 32"),
    ({"b": {"dtype": "float16"}}, "must use 'a''s dtype float32, not float16"),
    ({"a": {"num_gpu_blocks_override": 9}}, "fewer than one 512-token sequence"),
])
def test_a_group_whose_models_cannot_share_pages_says_the_fix(tmp_path, overrides, message):
    deployment = group_deployment(**overrides)
    dirs = dict.fromkeys("abc", model_dir(tmp_path))
    with pytest.raises(ValueError, match=message):
        plan_mux_pools(deployment, dirs)


def test_prefix_caching_is_refused_in_a_unified_group():
    with pytest.raises(ValueError, match="remove enable_prefix_caching"):
        group_deployment(b={"extra_engine_args": {"enable_prefix_caching": True}})
    group_deployment(b={"extra_engine_args": {"enable_prefix_caching": False}})  # fine


def test_an_engine_of_the_group_leases_the_whole_pool_without_prefix_caching(tmp_path):
    from weaver.server.features import engine_configs, serve_features

    deployment = group_deployment()
    dirs = dict.fromkeys("abc", model_dir(tmp_path))
    pools = plan_mux_pools(deployment, dirs)
    configs = engine_configs(deployment, serve_features(deployment, dirs, pools))
    plan, tenant = pool_of(configs["a"])
    assert tenant == "a" and plan == pools["pair"] and pool_of(configs["c"]) is None
    args = engine_cli_args(deployment.model("a"), dirs["a"], configs["a"])
    assert args[args.index("--kv-cache-memory-bytes") + 1] == str(plan.engine_kv_bytes("a"))
    assert "--no-enable-prefix-caching" in args
    assert "--num-gpu-blocks-override" not in args  # the override is now a's starting quota
    assert args[args.index("--scheduler-cls") + 1].endswith("WeaverScheduler")


def test_quotas_and_use_are_served_per_model(tmp_path):
    deployment = group_deployment()
    plan = plan_mux_pool(deployment, deployment.mux[0], dict.fromkeys("abc", model_dir(tmp_path)),
                         f"wtest{tmp_path.name[-8:]}")
    host = HostedPool(plan)
    try:
        host.allocator.allocate_blocks("a", 2)
        registry = CollectorRegistry()
        registry.register(MuxPoolCollector({"pair": host}))
        text = generate_latest(registry).decode()
        assert f'weaver_mux_kv_pool_pages{{group="pair"}} {float(plan.num_pages)}' in text
        assert 'weaver_mux_kv_used_pages{group="pair",model="a"} 180.0' in text
        assert (f'weaver_mux_kv_quota_pages{{group="pair",model="b"}} '
                f'{float(plan.tenants[1].quota_pages)}') in text
        assert 'weaver_mux_kv_rebalances_total{group="pair"} 0.0' in text
    finally:
        host.close()
