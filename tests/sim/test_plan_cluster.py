"""A plan split over nodes (`weaver plan --nodes N --cluster DIR`): pairs stay on one node,
replicas of a model land on different nodes, the files read back as a cluster, and a GPU
config is planned with a GPU per model and written as GPU groups."""

from __future__ import annotations

import json
import logging

import pytest
import yaml

from weaver.cli.main import build_parser
from weaver.cluster.from_plan import split_devices, write_cluster
from weaver.cluster.spec import load_cluster
from weaver.sim.config import SimConfig
from weaver.sim.plan import GpuPlan, Plan, WeavePair
from weaver.sim.plan_deployment import best_candidate, deployment_from_plan
from weaver.sim.planner import plan_cluster

MODEL = "smollm2-135m-instruct"
GPU_MODEL = "meta-llama/Meta-Llama-3-8B-Instruct"


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


# Four Llama-3-8B-shaped models of one base on eight A100s, popularity a power law.
GPU_CONFIG = {
    "name": "gpus", "duration_s": 5.0, "cluster": {"device": "A100-80GB", "num_gpus": 8},
    "workload": {"trace": "azure-conv", "length_scale": 0.3},
    "model_set": {"num_models": 4, "total_rate": 40.0, "alpha": 1.0, "serve": GPU_MODEL},
    "slo": {"tpot_ms": 100},
}  # fmt: skip


@pytest.fixture
def gpu_models() -> SimConfig:
    return SimConfig.model_validate(GPU_CONFIG)


def test_a_model_set_serves_its_one_base_under_each_models_name(gpu_models):
    assert [(m.name, m.serve) for m in gpu_models.models] == [
        (f"m{i:02d}", GPU_MODEL) for i in range(4)
    ]


def test_a_gpu_plan_gives_each_model_its_devices_and_runs_as_gpu_groups(gpu_models, tmp_path):
    result = plan_cluster(gpu_models, exclusive_devices=True)
    assert result["exclusive_devices"]
    for entry in result["candidates"]:
        assert all(len(gpu["models"]) == 1 for gpu in entry["plan"]["gpus"]), entry["label"]
    plan = Plan.from_dict(best_candidate(result)["plan"])
    # the planner gives the most popular model as many GPUs as there are nodes
    cluster = load_cluster(write_cluster(gpu_models, plan, 4, tmp_path))
    assert sorted(cluster.groups_of()) == ["m00", "m01", "m02", "m03"]
    assert any(cluster.deployments[g.name].weaving for g in cluster.spec.groups)
    for group in cluster.spec.groups:
        deployment = cluster.deployments[group.name]
        # Ray shows the group's server its GPUs as cuda:0..n-1, n what the group asks for
        assert group.resources == {"GPU": float(len(deployment.models))}
        assert sorted(m.device for m in deployment.models) == [
            f"cuda:{i}" for i in range(len(deployment.models))]  # fmt: skip
        for model in deployment.models:
            assert model.model == GPU_MODEL and model.dtype == "bfloat16"
            assert model.cpu_cores is None and model.kv_cache_gib > 1.0
        for link in deployment.weaving:
            assert all(deployment.model(c).lend_kv_gib > 0 for c in link.cold)


def test_a_shared_gpu_is_refused_with_the_way_out(gpu_models):
    plan = Plan([GpuPlan(["m00", "m01"]), GpuPlan(["m02"]), GpuPlan(["m03"])])
    with pytest.raises(ValueError, match="a GPU deployment needs a device per model"):
        deployment_from_plan(gpu_models, plan)


def test_more_replicas_than_nodes_are_refused_with_the_node_count_that_works():
    plan = Plan([GpuPlan(["a"]), GpuPlan(["a"]), GpuPlan(["a"]), GpuPlan(["b"])])
    with pytest.raises(ValueError, match="on 3 devices.*use --nodes 3 or more"):
        split_devices(plan, 2)
    assert split_devices(plan, 3) == [[0, 3], [1], [2]]


def test_the_plan_command_plans_a_gpu_config_with_a_gpu_per_model(tmp_path, caplog):
    config_path = tmp_path / "gpus.yaml"
    config_path.write_text(yaml.safe_dump(GPU_CONFIG))
    args = build_parser().parse_args(["plan", str(config_path), "--out", str(tmp_path),
                                      "--no-plot", "--nodes", "4", "--cluster",
                                      str(tmp_path / "cluster")])  # fmt: skip
    with caplog.at_level(logging.INFO, logger="weaver.cli.simulate"):
        assert args.handler(args) == 0
    assert "with a GPU per model" in caplog.text
    assert json.loads((tmp_path / "gpus" / "plan.json").read_text())["exclusive_devices"]
    cluster = load_cluster(tmp_path / "cluster" / "cluster.yaml")
    assert all("GPU" in g.resources for g in cluster.spec.groups)
