"""A planner's placement split over nodes: the cluster file and one deployment per node
(`weaver plan CONFIG --nodes N --cluster DIR`).

A weaving pair never spans two nodes (its region is shared memory on CPU, a peer mapping
on GPU), so a pair's two devices are one unit; every other device is a unit of its own.
Units go to the least filled node that still has room and serves none of the unit's
models yet (a deployment runs one engine per model), pairs first, the units of the most
replicated models first among them: a model placed on several devices lands on several
nodes, one engine each, and the ingress spreads its load over them. Each node's devices
become that node's deployment file (weaver/sim/plan_deployment.py: device i of the node is
its core i, or its GPU i on a GPU config).
"""

from __future__ import annotations

import math
from pathlib import Path

import yaml

from weaver.cluster.spec import ClusterSpec, GroupSpec, IngressSpec, dump_cluster
from weaver.sim.config import SimConfig
from weaver.sim.plan import Plan, WeavePair
from weaver.sim.plan_deployment import deployment_from_plan
from weaver.sim.profile import CPU_DEVICE

CLUSTER_FILE_NAME = "cluster.yaml"


def split_devices(plan: Plan, num_nodes: int) -> list[list[int]]:
    """The plan's device indices per node (each node at most ceil(devices / nodes)), no
    model twice on one node. ValueError when the units do not fit."""
    if num_nodes < 1:
        raise ValueError(f"--nodes {num_nodes}: give at least one node")
    replicas: dict[str, int] = {}
    for device in plan.gpus:
        for model in device.models:
            replicas[model] = replicas.get(model, 0) + 1
    most = max(replicas, key=lambda m: (replicas[m], m))
    if replicas[most] > num_nodes:
        raise ValueError(f"the plan places {most!r} on {replicas[most]} devices, one engine "
                         f"each, and a node serves a model once: use --nodes "
                         f"{replicas[most]} or more")
    capacity = math.ceil(len(plan.gpus) / num_nodes)
    paired = {d for p in plan.pairs for d in (p.hot_gpu, p.cold_gpu)}
    units = [[p.hot_gpu, p.cold_gpu] for p in plan.pairs]
    units += [[d] for d in range(len(plan.gpus)) if d not in paired]

    def spread(unit: list[int]) -> int:  # the most replicas among the unit's models
        return max(replicas[m] for d in unit for m in plan.gpus[d].models)

    # Pairs before single devices (two free slots are rarer late), and among each, the
    # units of the most replicated models first, while every node still has room.
    units.sort(key=lambda unit: (-len(unit), -spread(unit), unit))
    nodes: list[list[int]] = [[] for _ in range(num_nodes)]
    for unit in units:
        models = {m for d in unit for m in plan.gpus[d].models}

        def served_there(node: list[int], models: set[str] = models) -> bool:
            return any(m in plan.gpus[d].models for d in node for m in models)

        if len(unit) > capacity:
            raise ValueError(f"devices {unit} are a weaving pair, which stays on one node, and "
                             f"{num_nodes} nodes hold {capacity} device(s) each: use fewer nodes")
        fits = [n for n in nodes if len(n) + len(unit) <= capacity and not served_there(n)]
        if not fits:
            raise ValueError(f"devices {unit} (models {sorted(models)}) fit on none of "
                             f"{num_nodes} nodes of {capacity} devices without serving a model "
                             "twice on one node; try another --nodes")
        min(fits, key=len).extend(unit)
    return [sorted(node) for node in nodes if node]


def node_plan(plan: Plan, devices: list[int]) -> Plan:
    """The part of `plan` on `devices`, renumbered from 0 in that order."""
    index = {d: i for i, d in enumerate(devices)}
    pairs = [WeavePair(index[p.hot_gpu], index[p.cold_gpu], p.offload_ratio, p.remote_blocks)
             for p in plan.pairs if p.hot_gpu in index]
    return Plan([plan.gpus[d] for d in devices], pairs)


def write_cluster(config: SimConfig, plan: Plan, num_nodes: int, out_dir: Path,
                  port: int = 8000, mode: str = "spatial-temporal") -> Path:
    """DIR/node<i>.yaml for each node's devices and DIR/cluster.yaml naming them; returns
    the cluster file. Each group takes as many CPU cores, or GPUs on a GPU config, as its
    node's devices (Ray then shows the group's server its GPUs as cuda:0, 1, ...)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    unit = "CPU" if config.cluster.device == CPU_DEVICE else "GPU"
    what = "cores" if unit == "CPU" else "GPUs"
    groups = []
    for i, devices in enumerate(split_devices(plan, num_nodes)):
        data = deployment_from_plan(config, node_plan(plan, devices), mode)
        name = f"node{i}"
        header = (f"# Written by `weaver plan {config.name} --nodes {num_nodes}`: devices "
                  f"{devices} of the plan, as {what} 0-{len(devices) - 1} of one node.\n")
        (out_dir / f"{name}.yaml").write_text(header + yaml.safe_dump(data, sort_keys=False))
        groups.append(GroupSpec(name=name, deployment=Path(f"{name}.yaml"),
                                resources={unit: float(len(devices))}))
    spec = ClusterSpec(groups=groups, ingress=IngressSpec(port=port))
    path = out_dir / CLUSTER_FILE_NAME
    path.write_text(f"# Written by `weaver plan {config.name} --nodes {num_nodes}`; deploy "
                    f"it with `weaver cluster up {path}`.\n"
                    + yaml.safe_dump(dump_cluster(spec), sort_keys=False))
    return path
