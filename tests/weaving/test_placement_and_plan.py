from __future__ import annotations

import json

import pytest

from weaver.config.deployment import parse_deployment
from weaver.weaving.placement import Placement, RatioPlacement
from weaver.weaving.plan import (
    PairPlan,
    lend_kv_gib_for,
    plan_pairs,
    region_bytes_of,
    remote_block_offsets,
)


def placements(ratio: float, n: int) -> str:
    """A burst of n requests, none finishing in between."""
    policy = RatioPlacement(ratio)
    out, counts = [], {Placement.LOCAL: 0, Placement.REMOTE: 0}
    for _ in range(n):
        choice = policy.preferred(counts[Placement.LOCAL], counts[Placement.REMOTE])
        counts[choice] += 1
        out.append(choice.value)
    return "".join(out)


@pytest.mark.parametrize(
    ("ratio", "expected"),
    [(0.0, "LLLLLL"), (1.0, "RRRRRR"), (0.5, "LRLRLR"), (2 / 3, "LRRLRR"), (0.25, "LLLRLL")],
)
def test_ratio_placement_spreads_remote_requests_evenly(ratio, expected):
    assert placements(ratio, 6) == expected


def test_split_follows_the_running_set_not_the_history():
    policy = RatioPlacement(2 / 3)
    # 32 requests of a burst: 21 remote, 11 local, as the pools of the benchmark hold.
    assert placements(0.66, 32).count("R") == 21
    # Whatever ran before, a fresh burst starts from the running counts alone.
    assert policy.preferred(0, 0) is Placement.LOCAL
    assert policy.preferred(1, 0) is Placement.REMOTE
    assert policy.preferred(1, 2) is Placement.LOCAL


def test_spill_only_strictly_between_extremes():
    assert RatioPlacement(0.5).may_spill
    assert not RatioPlacement(1.0).may_spill and not RatioPlacement(0.0).may_spill
    with pytest.raises(ValueError, match="offload_ratio"):
        RatioPlacement(1.5)


def write_model(tmp_path, name, layers, heads, kv_heads, hidden):
    folder = tmp_path / name
    folder.mkdir()
    folder.joinpath("config.json").write_text(json.dumps({
        "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "hidden_size": hidden}))
    return folder


def deployment(lend_gib: float, colds: list[str] | None = None):
    return parse_deployment({
        "models": [
            {"name": "h", "model": "x", "role": "hot", "block_size": 32, "max_model_len": 512},
            {"name": "c", "model": "y", "role": "cold", "lend_kv_gib": lend_gib},
            {"name": "d", "model": "y", "role": "cold", "lend_kv_gib": lend_gib},
        ],
        "weaving": [{"hot": "h", "cold": colds or ["c"], "offload_ratio": 0.5}],
    })


def test_plan_sizes_the_remote_pool_from_the_lent_memory(tmp_path):
    dirs = {"h": write_model(tmp_path, "h", 30, 9, 3, 576), "c": tmp_path, "d": tmp_path}
    (plan,) = plan_pairs(deployment(0.25), dirs, "pfx")
    # SmolLM2's block: 30 layers × 3 kv heads × 32 tokens × (K, V) × 64 × 4 bytes.
    assert plan.num_remote_blocks == (1 << 28) // (30 * 3 * 32 * 2 * 64 * 4) == 182
    assert (plan.shape.num_q_heads, plan.shape.head_size, plan.max_blocks_per_seq) == (9, 64, 16)
    assert plan.region_name == ""  # the cold engine names the region when it accepts it
    assert PairPlan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
    assert plan.layout().total_bytes >= plan.num_remote_blocks * 30 * 3 * 32 * 2 * 64 * 4


@pytest.mark.parametrize("num_blocks", [128, 182, 189, 1000])
def test_lend_kv_gib_for_lends_exactly_that_many_blocks(tmp_path, num_blocks):
    dirs = {"h": write_model(tmp_path, "h", 30, 9, 3, 576), "c": tmp_path, "d": tmp_path}
    lend = float(lend_kv_gib_for(num_blocks, 30 * 3 * 32 * 2 * 64 * 4))
    (plan,) = plan_pairs(deployment(lend), dirs, "pfx")
    assert plan.num_remote_blocks == num_blocks


def test_plan_refuses_a_region_smaller_than_one_sequence(tmp_path):
    dirs = {"h": write_model(tmp_path, "h", 30, 9, 3, 576)}
    with pytest.raises(ValueError, match="raise lend_kv_gib"):
        plan_pairs(deployment(0.01), dirs, "pfx")


def test_a_hot_model_over_two_colds_gets_a_plan_each_with_its_remote_range(tmp_path):
    dirs = {"h": write_model(tmp_path, "h", 30, 9, 3, 576)}
    plans = plan_pairs(deployment(0.25, ["d", "c"]), dirs, "pfx")
    assert [(p.hot, p.cold, p.num_remote_blocks) for p in plans] == [("h", "d", 182),
                                                                     ("h", "c", 182)]
    assert remote_block_offsets(plans) == [0, 182]  # d's ids first, then c's
    with pytest.raises(ValueError, match="lists a cold model twice"):
        deployment(0.25, ["c", "c"])


def test_a_hot_model_over_several_colds_cannot_lease_from_a_unified_pool(tmp_path):
    data = deployment(0.25, ["c", "d"]).model_dump()
    data["models"][2]["unified_kv"] = True
    dirs = {"h": write_model(tmp_path, "h", 30, 9, 3, 576), "d": dirs_of_cold(tmp_path)}
    with pytest.raises(ValueError, match="unified_kv: false on it or weave into it alone"):
        plan_pairs(parse_deployment(data), dirs, "pfx")


def dirs_of_cold(tmp_path):
    return write_model(tmp_path, "cold", 3, 6, 1, 384)


def unified_deployment(hot_block_size: int, hot_dtype: str = "float32"):
    return parse_deployment({
        "models": [
            {"name": "h", "model": "x", "role": "hot", "block_size": hot_block_size,
             "max_model_len": 512, "dtype": hot_dtype},
            {"name": "c", "model": "y", "role": "cold", "block_size": 32, "kv_cache_gib": 0.25,
             "lend_kv_gib": 0.75, "unified_kv": True},
        ],
        "weaving": [{"hot": "h", "cold": ["c"], "offload_ratio": 0.5}],
    })


def test_a_unified_cold_model_plans_one_pool_for_itself_and_its_hot_model(tmp_path):
    from weaver.vllm_ext.additional_config import pool_of
    from weaver.vllm_ext.engine.app import engine_cli_args

    # hot: SmolLM2 (head 64), cold: 4 layers x 4 KV heads of 128 -> 32 KiB pages
    dirs = {"h": write_model(tmp_path, "h", 30, 9, 3, 576),
            "c": write_model(tmp_path, "c", 4, 4, 4, 512)}
    (plan,) = plan_pairs(unified_deployment(64), dirs, "pfx")
    pool = plan.pool
    assert pool.page_bytes == 32 * 2 * 128 * 4
    assert pool.num_pages == (1 << 30) // pool.page_bytes == 32768
    cold, hot = pool.tenants
    assert (cold.name, cold.is_owner, cold.quota_pages) == ("c", True, 8192)
    assert (hot.name, hot.quota_pages, hot.shape.block_size) == ("h", 32768 - 8192, 64)
    assert plan.num_remote_blocks == pool.max_blocks("h") == 32768 // 90
    assert plan.layout().kv_in_pool and plan.layout().kv_layer_bytes == 0
    assert PairPlan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
    # The cold engine: a KV budget with an id for every block it may hold, the scheduler
    # that allocates through the pool; prefix caching as vLLM sets it (cached blocks keep
    # their pages until the pool lends them).
    spec = unified_deployment(64).model("c")
    args = engine_cli_args(spec, tmp_path, {"weaver": {"pool": {"plan": pool.to_dict(),
                                                                 "tenant": "c"}}})
    assert args[args.index("--kv-cache-memory-bytes") + 1] == str(pool.engine_kv_bytes("c"))
    assert "--no-enable-prefix-caching" not in args and "--scheduler-cls" in args
    assert pool_of({"weaver": {"pool": {"plan": pool.to_dict(), "tenant": "c"}}})[1] == "c"


def test_a_hot_block_size_that_does_not_fill_the_pages_is_named(tmp_path):
    dirs = {"h": write_model(tmp_path, "h", 30, 9, 3, 576),
            "c": write_model(tmp_path, "c", 4, 4, 4, 512)}
    with pytest.raises(ValueError, match="needs block_size: 64"):
        plan_pairs(unified_deployment(32), dirs, "pfx")


def test_a_hot_model_of_another_dtype_is_refused_by_a_unified_pool(tmp_path):
    # bfloat16 at twice the block size would fill the fp32 pages exactly; stale fp32 bytes
    # read as bf16 can be NaN, so the pool keeps one dtype.
    dirs = {"h": write_model(tmp_path, "h", 30, 9, 3, 576),
            "c": write_model(tmp_path, "c", 4, 4, 4, 512)}
    with pytest.raises(ValueError, match="'h' must use the same dtype, not bfloat16"):
        plan_pairs(unified_deployment(128, "bfloat16"), dirs, "pfx")


def test_unified_kv_is_for_cold_models_only():
    with pytest.raises(ValueError, match="unified_kv is for cold models only"):
        parse_deployment({"models": [{"name": "a", "model": "x", "unified_kv": True}]})


def two_hots_deployment(both_into_d: bool = False, hot_device: str = "cpu"):
    hot = {"model": "x", "role": "hot", "block_size": 32, "max_model_len": 512,
           "device": hot_device}
    cold = {"model": "y", "role": "cold", "lend_kv_gib": 0.25, "device": hot_device}
    return parse_deployment({
        "models": [{"name": "h", **hot}, {"name": "h2", **hot}, {"name": "c", **cold},
                   {"name": "d", **cold}],
        "weaving": [{"hot": "h", "cold": ["c", "d"] if both_into_d else ["c"]},
                    {"hot": "h2", "cold": ["c", "d"] if both_into_d else ["c"]}]})


def smollm2_dirs(tmp_path):
    dirs = {"h": write_model(tmp_path, "h", 30, 9, 3, 576), "c": tmp_path, "d": tmp_path}
    dirs["h2"] = dirs["h"]
    return dirs


SMOLLM2_BLOCK = 30 * 3 * 32 * 2 * 64 * 4  # 30 layers x 3 kv heads x 32 tokens x K, V x 64 x fp32


def test_two_hot_models_share_their_cold_models_loan_in_one_pool(tmp_path):
    from weaver.server.weaving import Weaving, loan_pools, remote_kv_home

    deployment = two_hots_deployment()
    plans = plan_pairs(deployment, smollm2_dirs(tmp_path), "pfx")
    pool = plans[0].pool
    assert pool is not None and plans[1].pool == pool and pool.owner is None
    # Exactly the loan, in pages of one head-block (32 tokens x K, V x 64 x 4 bytes).
    assert pool.page_bytes == 32 * 2 * 64 * 4
    assert pool.num_pages == (1 << 28) // pool.page_bytes
    # Equal quotas to start with, never below one 512-token sequence (16 blocks of 90 pages).
    assert [(t.name, t.quota_pages, t.min_quota_pages) for t in pool.tenants] == [
        ("h", pool.num_pages // 2, 16 * 90), ("h2", pool.num_pages // 2, 16 * 90)]
    # Each hot model's ids span the whole loan: its quota, not its range, bounds it.
    assert [p.num_remote_blocks for p in plans] == [(1 << 28) // SMOLLM2_BLOCK] * 2
    assert plans[0].layout().kv_in_pool
    assert PairPlan.from_dict(json.loads(json.dumps(plans[0].to_dict()))) == plans[0]
    assert loan_pools(plans) == [pool] and remote_kv_home(plans[0]) == "loan pool"
    # The cold model's own KV stays in vLLM's cache: no pool in its engine's section.
    weaving = Weaving(deployment, plans, tmp_path / "pairs")
    assert "pool" not in weaving.engine_section("c")
    assert weaving.engine_section("h")["hot"][0]["pool"]["pool_name"] == pool.pool_name


@pytest.mark.parametrize(("both_into_d", "hot_device"), [(True, "cpu"), (False, "cuda:0")])
def test_hot_models_that_cannot_share_a_pool_get_fixed_equal_regions(
        tmp_path, both_into_d, hot_device, caplog):
    """On CUDA (no pool of pages there yet), and on a second cold model whose hot models
    already lease from the first one's loan pool (a hot engine leases from one pool)."""
    import logging

    with caplog.at_level(logging.INFO, logger="weaver.weaving.plan"):
        plans = plan_pairs(two_hots_deployment(both_into_d, hot_device),
                           smollm2_dirs(tmp_path), "pfx")
    fixed_on = "d" if both_into_d else "c"
    in_regions = [p for p in plans if p.cold == fixed_on]
    assert [p.pool for p in in_regions] == [None, None]
    # Half of 0.25 GiB each, in SmolLM2's blocks.
    assert [p.num_remote_blocks for p in in_regions] == [(1 << 27) // SMOLLM2_BLOCK] * 2
    total = sum(region_bytes_of(p.shape, p.num_remote_blocks) for p in in_regions)
    assert total <= 0.25 * 2**30  # within the loan, as the cold side's ColdLink checks
    if both_into_d:  # c's loan is shared: each hot model's plans hold one pool at most
        assert [p.pool is not None for p in plans if p.cold == "c"] == [True, True]
    why = ("'h' already shares cold model 'c''s loan pool" if both_into_d
           else "shared memory on the CPU only")
    assert f"cold model '{fixed_on}' lends ['h', 'h2'] fixed, equal regions" in caplog.text
    assert why in caplog.text
