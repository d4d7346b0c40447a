"""The cluster file: Weaver across nodes, as groups of engines that each run on one node.

A group is one deployment file (what `weaver serve` runs on one machine: a weaving pair, a
mux group, dedicated models) plus what it needs of a node (CPU cores or GPUs, for the
placement group that packs it on one node) and how many replicas of it run. One ingress
routes by `model` to the groups that serve it. `weaver plan ... --nodes N --cluster DIR`
writes one; `weaver cluster up FILE` deploys it on a running Ray cluster.

    ingress: {port: 8000}
    groups:
      - name: node0
        deployment: node0.yaml     # relative to this file
        resources: {CPU: 2}        # one node's share: cores (cpu) or GPUs (cuda)
        replicas: 1

Pure pydantic: nothing of Ray here, so single-machine use needs no Ray.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from weaver.config.deployment import Deployment, load_deployment

_GROUP_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,47}$")
RESOURCE_NAMES = ("CPU", "GPU")  # Ray's own resource names


class GroupSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="the group's name (its Ray Serve deployment is named after it)")
    deployment: Path = Field(description="the deployment file this group serves, relative to "
                             "the cluster file")
    resources: dict[str, float] = Field(
        description="what one replica takes of a node: {CPU: cores} or {GPU: gpus, CPU: ...}; "
        "all of it on one node (a STRICT_PACK placement group)")
    replicas: int = Field(1, ge=1, description="copies of the group, on nodes with room")

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        if not _GROUP_NAME_RE.match(value):
            raise ValueError(f"group name {value!r} must be 1-48 letters, digits, '_' or '-'")
        return value

    @field_validator("resources")
    @classmethod
    def _check_resources(cls, value: dict[str, float]) -> dict[str, float]:
        unknown = sorted(set(value) - set(RESOURCE_NAMES))
        if unknown or not value:
            raise ValueError(f"resources {value} must name some of {list(RESOURCE_NAMES)} "
                             f"(unknown: {unknown})")
        if any(amount <= 0 for amount in value.values()):
            raise ValueError(f"resources {value} must be > 0")
        return value


class IngressSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    host: str = "0.0.0.0"
    port: int = Field(8000, ge=1, le=65535)
    proxy_location: Literal["EveryNode", "HeadOnly"] = Field(
        "EveryNode", description="where Ray Serve runs the HTTP proxy: on every node (any "
        "node's address is the endpoint) or on the head only (one address; also what a "
        "cluster of several Ray nodes on one machine needs, their ports being one)")


class ClusterSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    groups: list[GroupSpec] = Field(min_length=1)
    ingress: IngressSpec = IngressSpec()

    @model_validator(mode="after")
    def _check_names(self) -> ClusterSpec:
        names = [g.name for g in self.groups]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"group names {twice} appear more than once; name each group once")
        return self


class Cluster:
    """A loaded cluster file: its groups with their deployments read and checked."""

    def __init__(self, spec: ClusterSpec, deployments: dict[str, Deployment],
                 deployment_texts: dict[str, str], source: Path) -> None:
        self.spec = spec
        self.deployments = deployments  # group name -> its deployment
        self.deployment_texts = deployment_texts  # group name -> the file, as written
        self.source = source

    def models_of(self, group: str) -> list[str]:
        return self.deployments[group].served_names

    def groups_of(self) -> dict[str, list[str]]:
        """API model name -> the groups that serve it (replicas of one model in several
        groups share its load)."""
        serving: dict[str, list[str]] = {}
        for group in self.spec.groups:
            for model in self.models_of(group.name):
                serving.setdefault(model, []).append(group.name)
        return serving


def load_cluster(path: str | Path) -> Cluster:
    """Read and check a cluster file and every deployment it names. ValueError says which
    file and field is wrong and how to fix it."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"cannot read cluster file {path}: {exc}") from exc
    try:
        spec = ClusterSpec.model_validate(data)
    except ValidationError as exc:
        raise ValueError(f"cluster file {path}: {_first_errors(exc)}") from exc
    deployments, texts = {}, {}
    for group in spec.groups:
        file = path.parent / group.deployment  # an absolute path stays itself
        try:
            texts[group.name] = file.read_text()
            deployments[group.name] = load_deployment(file)
        except (OSError, ValueError) as exc:
            raise ValueError(f"cluster file {path}, group {group.name!r}: {exc}") from exc
        _check_group_fits(group, deployments[group.name])
    return Cluster(spec, deployments, texts, path)


def _check_group_fits(group: GroupSpec, deployment: Deployment) -> None:
    """A group's resources must cover what its deployment pins: its cores or its GPUs."""
    devices = {m.device for m in deployment.models}
    uses_gpu = any(d.startswith("cuda") for d in devices)
    if uses_gpu and "GPU" not in group.resources:
        raise ValueError(f"group {group.name!r}: its deployment runs on {sorted(devices)} but "
                         "its resources name no GPU; add GPU: <number of GPUs it uses>")


def _first_errors(exc: ValidationError, limit: int = 3) -> str:
    parts = []
    for error in exc.errors()[:limit]:
        where = ".".join(str(p) for p in error["loc"]) or "(top level)"
        parts.append(f"{where}: {error['msg']}")
    return "; ".join(parts)


def dump_cluster(spec: ClusterSpec) -> dict[str, Any]:
    """The cluster file's content, as written (paths as strings)."""
    return spec.model_dump(mode="json")
