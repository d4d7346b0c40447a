"""The cluster file is checked before anything reaches Ray, each refusal saying the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from weaver.cluster.spec import load_cluster

DEPLOYMENT = {"models": [{"name": "chat", "model": "smollm2-135m-instruct"}]}


def _write(tmp_path: Path, cluster: dict, deployments: dict[str, dict] | None = None) -> Path:
    for name, data in (deployments or {"a.yaml": DEPLOYMENT}).items():
        (tmp_path / name).write_text(yaml.safe_dump(data))
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(cluster))
    return path


def test_a_cluster_file_loads_its_groups_deployments(tmp_path):
    other = {"models": [{"name": "chat", "model": "smollm2-135m-instruct"},
                        {"name": "code", "model": "smollm2-135m-instruct"}]}  # fmt: skip
    path = _write(tmp_path, {"groups": [
        {"name": "n0", "deployment": "a.yaml", "resources": {"CPU": 1}},
        {"name": "n1", "deployment": "b.yaml", "resources": {"CPU": 2}, "replicas": 2}]},
        {"a.yaml": DEPLOYMENT, "b.yaml": other})  # fmt: skip
    cluster = load_cluster(path)
    assert cluster.groups_of() == {"chat": ["n0", "n1"], "code": ["n1"]}
    assert cluster.spec.groups[1].replicas == 2 and cluster.spec.ingress.port == 8000
    assert "smollm2-135m-instruct" in cluster.deployment_texts["n0"]


@pytest.mark.parametrize(
    ("groups", "message"),
    [
        ([], "groups"),
        ([{"name": "n0", "deployment": "a.yaml", "resources": {"TPU": 1}}], "TPU"),
        ([{"name": "n0", "deployment": "a.yaml", "resources": {"CPU": 0}}], "> 0"),
        ([{"name": "n0", "deployment": "a.yaml", "resources": {"CPU": 1}}] * 2,
         "more than once"),
        ([{"name": "n 0", "deployment": "a.yaml", "resources": {"CPU": 1}}], "letters"),
        ([{"name": "n0", "deployment": "missing.yaml", "resources": {"CPU": 1}}],
         "group 'n0'"),
    ],
)
def test_what_cannot_deploy_is_refused_with_the_reason(tmp_path, groups, message):
    with pytest.raises(ValueError, match=message):
        load_cluster(_write(tmp_path, {"groups": groups}))


def test_a_gpu_group_must_ask_for_gpus(tmp_path):
    gpu = {"models": [{"name": "chat", "model": "smollm2-135m-instruct", "device": "cuda:0",
                       "gpu_memory_gib": 10}]}  # fmt: skip
    path = _write(tmp_path, {"groups": [{"name": "n0", "deployment": "g.yaml",
                                         "resources": {"CPU": 4}}]}, {"g.yaml": gpu})
    with pytest.raises(ValueError, match="add GPU"):
        load_cluster(path)
