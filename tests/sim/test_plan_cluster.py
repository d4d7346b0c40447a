"""A plan split over nodes (`weaver plan --nodes N --cluster DIR`): pairs stay on one node,
replicas of a model land on different nodes, and the files read back as a cluster."""

from __future__ import annotations

import pytest

from weaver.cluster.from_plan import split_devices, write_cluster
from weaver.cluster.spec import load_cluster
from weaver.sim.config import SimConfig
from weaver.sim.plan import GpuPlan, Plan, WeavePair

MODEL = "smollm2-135m-instruct"


@pytest.fixture
def four_models(cpu_profile):
    models = [{"name": n, "rate": r, "profile": str(cpu_profile), "num_blocks": 44,
               "block_size": 32, "serve": MODEL}
              for n, r in (("chat", 2.0), ("code", 0.5), ("docs", 0.2), ("math", 0.1))]
    return SimConfig.model_validate({
        "name": "four", "duration_s": 10.0, "cluster": {"device": "cpu", "num_gpus": 4},
        "workload": {"trace": "azure-conv", "length_scale": 0.1}, "models": models,
        "slo": {"tpot_ms": 500}})  # fmt: skip


def test_a_weaving_pair_stays_on_one_node_and_replicas_spread():
    plan = Plan([GpuPlan(["chat"]), GpuPlan(["docs"]), GpuPlan(["chat"]), GpuPlan(["code"])],
                [WeavePair(0, 1, 0.5)])
    nodes = split_devices(plan, 2)
    assert [0, 1] in nodes  # the pair
    assert nodes == [[0, 1], [2, 3]]  # chat's second device goes where chat is not
    with pytest.raises(ValueError, match="use fewer nodes"):
        split_devices(Plan([GpuPlan(["a"]), GpuPlan(["b"])], [WeavePair(0, 1, 0.5)]), 2)


def test_the_cluster_files_read_back_with_every_model(four_models, tmp_path):
    plan = Plan([GpuPlan(["chat"]), GpuPlan(["code"]), GpuPlan(["docs"]), GpuPlan(["math"])],
                [WeavePair(0, 1, 0.5)])
    path = write_cluster(four_models, plan, 2, tmp_path, port=8123)
    cluster = load_cluster(path)
    assert cluster.spec.ingress.port == 8123
    assert [g.name for g in cluster.spec.groups] == ["node0", "node1"]
    assert cluster.groups_of() == {"chat": ["node0"], "code": ["node0"], "docs": ["node1"],
                                   "math": ["node1"]}  # fmt: skip
    node0 = cluster.deployments["node0"]
    assert {m.name: m.role.value for m in node0.models} == {"chat": "hot", "code": "cold"}
    assert [m.cpu_cores for m in node0.models] == ["0", "1"]  # the node's own cores
    assert [m.cpu_cores for m in cluster.deployments["node1"].models] == ["0", "1"]
    assert cluster.spec.groups[0].resources == {"CPU": 2.0}
