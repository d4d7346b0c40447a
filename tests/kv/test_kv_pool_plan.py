"""PoolPlan: what the processes of one cold device agree on about its unified pool."""

import pytest

from weaver.kv.pages import TenantShape, headwise_block_size
from weaver.kv.pool_plan import PoolPlan, PoolTenantPlan
from weaver.kv.shared_table import SharedPageTable

PAGE = 8192
COLD = TenantShape(num_layers=2, num_kv_heads=2, head_size=32,
                   block_size=headwise_block_size(PAGE, 32, 4), dtype_bytes=4)
HOT = TenantShape(num_layers=3, num_kv_heads=1, head_size=64,
                  block_size=headwise_block_size(PAGE, 64, 4), dtype_bytes=4)


def plan(**changes) -> PoolPlan:
    fields = dict(pool_name="p", table_name="t", page_bytes=PAGE, num_pages=100,
                  tenants=(PoolTenantPlan("cold", COLD, 40, is_owner=True),
                           PoolTenantPlan("hot", HOT, 60)))
    return PoolPlan(**{**fields, **changes})


def test_round_trip_and_sizes():
    p = plan()
    assert PoolPlan.from_dict(p.to_dict()) == p
    assert p.pool_bytes == 100 * PAGE
    assert p.max_blocks("cold") == 100 // 4 and p.max_blocks("hot") == 100 // 3
    # ids 1..25 plus vLLM's null block 0, each block 4 pages
    assert p.engine_kv_bytes("cold") == 26 * 4 * PAGE


def test_allocator_and_table_layout_follow_the_plan():
    p = plan()
    allocator = p.build_allocator()
    assert allocator.tenant_names == ["cold", "hot"]
    assert allocator.quota_pages("hot") == 60
    layout = SharedPageTable.layout_for("t", [(t.name, p.max_blocks(t.name),
                                              t.shape.pages_per_block(PAGE))
                                             for t in p.tenants])
    assert [e["offset"] for e in layout["tenants"]] == [0, 25 * 4 * 4]
    assert layout["num_bytes"] == 25 * 4 * 4 + 33 * 3 * 4


@pytest.mark.parametrize(("changes", "message"), [
    ({"num_pages": 90}, "add up to 100 pages"),
    ({"page_bytes": 4096}, "set its block_size"),
    ({"tenants": ()}, "distinct names"),
    ({"tenants": (PoolTenantPlan("a", COLD, 1, is_owner=True),
                  PoolTenantPlan("b", COLD, 1, is_owner=True))}, "at most one owner"),
])
def test_bad_plans_are_refused(changes, message):
    with pytest.raises(ValueError, match=message):
        plan(**changes)


def test_unknown_tenant_is_named():
    with pytest.raises(ValueError, match="no tenant 'x'"):
        plan().tenant("x")


def test_plan_travels_as_json_in_additional_config():
    import json

    from weaver.vllm_ext.additional_config import make_additional_config, pool_section

    config = json.loads(json.dumps(make_additional_config(pool=(plan(), "cold"))))

    class VllmConfig:
        additional_config = config

    assert pool_section(VllmConfig) == (plan(), "cold")
    with pytest.raises(ValueError, match="no tenant"):
        make_additional_config(pool=(plan(), "nobody"))
