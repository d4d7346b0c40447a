"""Deployment files from the planner's placements (`weaver plan CONFIG --deployments DIR`).

The inverse of `weaver.sim.deployment`: a plan for a config on CPU cores becomes the file
`weaver serve` runs. Device i of the plan is core i: a device of one model is a dedicated
engine pinned there (`cpu_cores: "i"`), a device of several models a mux group on that core
(MuxServe's mode, decode shares by the models' rates), a weaving pair a hot and a cold
engine with the pair's offload ratio and the lent blocks as `lend_kv_gib`. Each engine gets
the KV blocks the simulation gave its model (`num_blocks`, plus vLLM's null block). The
model each engine serves is the config model's `serve`.

What a deployment cannot hold is refused with the reason: GPU configs (mux groups run on
CPU engines only), a model on several devices (one engine per API name), weaving from or
to a shared device (a weaving model has its device to itself).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import yaml

from weaver.config.deployment import parse_deployment
from weaver.sim.cluster import Cluster
from weaver.sim.config import SimConfig
from weaver.sim.engine import Engine
from weaver.sim.plan import Plan
from weaver.sim.profile import CPU_DEVICE
from weaver.weaving.plan import GiB, lend_kv_gib_for

logger = logging.getLogger(__name__)

# What the planner's labels become: the baseline, the best plain placement, the best woven.
FILE_NAMES = ("dedicated", "muxserve", "weaver")


def require_writable(config: SimConfig) -> None:
    """ValueError unless plans of `config` can become deployment files."""
    if config.cluster.device != CPU_DEVICE:
        raise ValueError(f"deployments are written for cpu configs; {config.name!r} is on "
                         f"{config.cluster.device} (mux groups run on CPU engines only)")
    unserved = [m.name for m in config.models if not m.serve]
    if unserved:
        raise ValueError(f"models {unserved} have no `serve:` (the model each engine runs, "
                         "e.g. smollm2-135m-instruct); add it to the config")


def deployment_from_plan(config: SimConfig, plan: Plan, mode: str = "spatial-temporal") -> dict:
    """The deployment file (as a dict, validated) that serves `plan` on this machine's cores;
    `mode` for its mux groups. ValueError when a deployment cannot serve the plan."""
    require_writable(config)
    for model in config.models:
        devices = plan.gpus_of(model.name)
        if len(devices) > 1:
            raise ValueError(f"the plan places {model.name!r} on devices {devices}; a "
                             "deployment runs one engine per model")
    cluster = Cluster(config, Engine())
    roles = _roles(plan)
    models, groups = [], []
    for core, device in enumerate(plan.gpus):
        shared = len(device.models) > 1
        for name in device.models:
            models.append(_engine(config, cluster, name, roles.get(core, "dedicated"),
                                  None if shared else str(core)))
        if shared:
            if core in roles:
                raise ValueError(f"device {core} is shared by {device.models} and in a "
                                 "weaving pair; a weaving model has its device to itself")
            groups.append({"name": f"core{core}", "models": list(device.models),
                           "mode": mode, "cpu_cores": str(core),
                           "rates": {m: config.model(m).rate for m in device.models}})
    weaving = []
    for pair in plan.pairs:
        (hot,), (cold,) = plan.gpus[pair.hot_gpu].models, plan.gpus[pair.cold_gpu].models
        cold_spec = next(m for m in models if m["name"] == cold)
        blocks = pair.remote_blocks
        if blocks is None:  # the simulator lends a share of the cold model's own KV
            lent_bytes = config.model(cold).num_blocks * cluster.block_bytes(cold) \
                * config.weaving.region_fraction
            blocks = max(1, int(lent_bytes) // cluster.block_bytes(hot))
            kept = config.model(cold).num_blocks - math.ceil(
                blocks * cluster.block_bytes(hot) / cluster.block_bytes(cold))
            cold_spec.update(_kv_fields(max(kept, 1), cluster.block_bytes(cold),
                                        cold_spec["block_size"]))
        cold_spec["lend_kv_gib"] = float(lend_kv_gib_for(blocks, cluster.block_bytes(hot)))
        # The server wants one whole hot sequence to fit in the lent blocks.
        hot_spec = next(m for m in models if m["name"] == hot)
        hot_spec["max_model_len"] = min(hot_spec["max_model_len"],
                                        blocks * hot_spec["block_size"])
        weaving.append({"hot": hot, "cold": [cold], "offload_ratio": pair.offload_ratio})
    data = {"models": models, "weaving": weaving}
    if groups:
        data["mux"] = groups
    parse_deployment(data, f"plan of {config.name}")  # what the server would refuse, now
    return data


def write_plan_deployments(config: SimConfig, result: dict, out_dir: Path) -> dict[str, Path]:
    """dedicated.yaml (the planner's baseline), muxserve.yaml (its best placement without
    weaving) and weaver.yaml (its best woven placement, when it tried one) in `out_dir`."""
    plain = [c for c in result["candidates"] if c["policy"] != "weaver"]
    woven = [c for c in result["candidates"] if c["policy"] == "weaver"]
    chosen = {"dedicated": result["baseline"],
              "muxserve": max(plain, key=_score),
              "weaver": max(woven, key=_score) if woven else None}
    out_dir.mkdir(parents=True, exist_ok=True)
    written = {}
    for name in FILE_NAMES:
        entry = chosen[name]
        if entry is None:
            logger.warning("no %s.yaml: the planner found no hot/cold pair to weave", name)
            continue
        mode = "temporal" if entry["policy"] == "mux_temporal" else "spatial-temporal"
        try:
            data = deployment_from_plan(config, Plan.from_dict(entry["plan"]), mode)
        except ValueError as exc:
            if name == "dedicated":
                raise
            logger.warning("no %s.yaml: %s (%s)", name, exc, entry["label"])
            continue
        path = out_dir / f"{name}.yaml"
        header = (f"# Written by `weaver plan {config.name} --deployments`: {entry['label']}, "
                  f"simulated goodput {entry['summary']['_all']['goodput_rps']:.2f} req/s.\n")
        path.write_text(header + yaml.safe_dump(data, sort_keys=False))
        written[name] = path
    return written


def best_candidate(result: dict) -> dict:
    """The planner's best woven candidate, else its best plain one."""
    woven = [c for c in result["candidates"] if c["policy"] == "weaver"]
    return max(woven or result["candidates"], key=_score)


def _score(entry: dict) -> tuple[float, float]:
    total = entry["summary"]["_all"]
    return (total["goodput_rps"], total["output_tokens_per_s"])


def _roles(plan: Plan) -> dict[int, str]:
    roles = {}
    for pair in plan.pairs:
        roles[pair.hot_gpu], roles[pair.cold_gpu] = "hot", "cold"
    return roles


def _engine(config: SimConfig, cluster: Cluster, name: str, role: str,
            cpu_cores: str | None) -> dict:
    spec, server = config.model(name), cluster.server_config(name)
    engine = {"name": name, "model": spec.serve, "role": role,
              **_kv_fields(spec.num_blocks, cluster.block_bytes(name), server.block_size),
              "max_num_seqs": server.max_num_seqs}
    if cpu_cores is not None:
        engine["cpu_cores"] = cpu_cores
    return engine


def _kv_fields(num_blocks: int, block_bytes: int, block_size: int) -> dict:
    """An engine's KV: `num_blocks` usable blocks (+ vLLM's null block, as
    weaver.sim.deployment counts them), memory for them, sequences that fit in them."""
    blocks = num_blocks + 1
    return {"kv_cache_gib": math.ceil(blocks * block_bytes / GiB * 64) / 64,
            "block_size": block_size, "num_gpu_blocks_override": blocks,
            "max_model_len": min(2048, num_blocks * block_size)}
