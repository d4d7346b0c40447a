"""Deployment files from the planner's placements (`weaver plan CONFIG --deployments DIR`).

The inverse of `weaver.sim.deployment`: a plan for a config becomes the file `weaver serve`
runs. Device i of the plan is core i on a cpu config and GPU i (`cuda:i`) on a GPU one: a
device of one model is a dedicated engine there, a device of several models a mux group on
that core (MuxServe's mode, decode shares by the models' rates), a weaving pair a hot and a
cold engine with the pair's offload ratio and the lent blocks as `lend_kv_gib`. Each engine
gets the KV blocks the simulation gave its model (`num_blocks`, else what its device holds
after the weights, plus vLLM's null block). The model each engine serves is the config
model's `serve`.

What a deployment cannot hold is refused with the reason: a shared GPU (mux groups run on
CPU engines only; `weaver plan` plans GPU configs with a device per model when it writes
files), a model on several devices (one engine per API name), weaving from or to a shared
device (a weaving model has its device to itself).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import yaml

from weaver.config.deployment import parse_deployment
from weaver.sim.cluster import Cluster
from weaver.sim.config import SimConfig, WeavingSpec
from weaver.sim.engine import Engine
from weaver.sim.plan import Plan
from weaver.sim.planner import MIN_WEAVING_GAIN, cold_factors_text, is_clearly_better
from weaver.sim.profile import CPU_DEVICE
from weaver.weaving.plan import GiB, lend_kv_gib_for

logger = logging.getLogger(__name__)

# What the planner's labels become: the baseline, the best plain placement, the best woven.
FILE_NAMES = ("dedicated", "muxserve", "weaver")


# Longest prompt + output an engine written here takes: a CPU engine's batch is small; on
# a GPU, the shortest context of the simulator's GPU shapes (Llama-2's 4,096 tokens).
CPU_MAX_MODEL_LEN = 2048
GPU_MAX_MODEL_LEN = 4096


def require_writable(config: SimConfig) -> None:
    """ValueError unless plans of `config` can become deployment files."""
    unserved = [m.name for m in config.models if not m.serve]
    if unserved:
        raise ValueError(f"models {unserved} have no `serve:` (the model each engine runs, "
                         "e.g. smollm2-135m-instruct); add it to the config")


def deployment_from_plan(config: SimConfig, plan: Plan, mode: str = "spatial-temporal") -> dict:
    """The deployment file (as a dict, validated) that serves `plan` on this machine's cores
    or GPUs; `mode` for its mux groups. ValueError when a deployment cannot serve the plan."""
    require_writable(config)
    on_gpu = config.cluster.device != CPU_DEVICE
    for model in config.models:
        devices = plan.gpus_of(model.name)
        if len(devices) > 1:
            raise ValueError(f"the plan places {model.name!r} on devices {devices}; a "
                             "deployment runs one engine per model (a cluster file puts "
                             "replicas on different nodes: --nodes N --cluster DIR)")
    cluster = Cluster(config, Engine())
    roles = _roles(plan)
    models, groups = [], []
    for core, device in enumerate(plan.gpus):
        shared = len(device.models) > 1
        if shared and on_gpu:
            raise ValueError(f"GPU {core} is shared by {device.models}; mux groups run on CPU "
                             "engines only, so a GPU deployment needs a device per model "
                             "(`weaver plan` plans so when it writes files for a GPU config)")
        for name in device.models:
            models.append(_engine(config, cluster, name, roles.get(core, "dedicated"),
                                  None if shared else core))
        if shared:
            if core in roles:
                raise ValueError(f"device {core} is shared by {device.models} and in a "
                                 "weaving pair; a weaving model has its device to itself")
            groups.append({"name": f"core{core}", "models": list(device.models),
                           "mode": mode, "cpu_cores": str(core),
                           "rates": {m: config.model(m).rate for m in device.models}})
    entries: dict[str, dict] = {}  # by hot model: one entry lists all of its colds
    for pair in plan.pairs:
        (hot,), (cold,) = plan.gpus[pair.hot_gpu].models, plan.gpus[pair.cold_gpu].models
        cold_spec = next(m for m in models if m["name"] == cold)
        blocks = pair.remote_blocks
        if blocks is None:  # the simulator lends a share of the cold model's own KV
            cold_blocks = _num_blocks(config, cluster, cold)
            lent_bytes = cold_blocks * cluster.block_bytes(cold) * config.weaving.region_fraction
            blocks = max(1, int(lent_bytes) // cluster.block_bytes(hot))
            kept = cold_blocks - math.ceil(
                blocks * cluster.block_bytes(hot) / cluster.block_bytes(cold))
            cold_spec.update(_kv_fields(max(kept, 1), cluster.block_bytes(cold),
                                        cold_spec["block_size"], on_gpu))
        cold_spec["lend_kv_gib"] = float(lend_kv_gib_for(blocks, cluster.block_bytes(hot)))
        # The server wants one whole hot sequence to fit in the lent blocks.
        hot_spec = next(m for m in models if m["name"] == hot)
        hot_spec["max_model_len"] = min(hot_spec["max_model_len"],
                                        blocks * hot_spec["block_size"])
        entry = entries.get(hot)
        if entry is None:
            entry = entries[hot] = {"hot": hot, "cold": [], "offload_ratio": pair.offload_ratio}
            if pair.hot_tpot_ms is not None:
                entry["hot_tpot_ms"] = round(pair.hot_tpot_ms, 1)
        elif entry["offload_ratio"] != pair.offload_ratio:
            raise ValueError(f"the plan weaves {hot!r} at ratios {entry['offload_ratio']} and "
                             f"{pair.offload_ratio}; a hot model has one offload_ratio")
        entry["cold"].append(cold)
    data = {"models": models, "weaving": list(entries.values())}
    if groups:
        data["mux"] = groups
    parse_deployment(data, f"plan of {config.name}")  # what the server would refuse, now
    return data


def write_plan_deployments(config: SimConfig, result: dict, out_dir: Path) -> dict[str, Path]:
    """dedicated.yaml (the planner's baseline), muxserve.yaml (its best placement without
    weaving) and weaver.yaml (its best woven placement, when it tried one) in `out_dir`."""
    chosen = {"dedicated": result["baseline"], "muxserve": best_plain(result),
              "weaver": best_woven(result)}
    out_dir.mkdir(parents=True, exist_ok=True)
    written = {}
    for name in FILE_NAMES:
        entry = chosen[name]
        if entry is None:
            logger.warning("no %s.yaml: the planner found no hot/cold pair to weave", name)
            continue
        try:
            data = deployment_from_plan(config, Plan.from_dict(entry["plan"]), mux_mode(entry))
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
    return best_woven(result) or best_plain(result)


def best_plain(result: dict) -> dict:
    """The planner's best simulated candidate without weaving (MuxServe's placement)."""
    return max((c for c in result["candidates"] if c["policy"] != "weaver"), key=_score)


def best_woven(result: dict) -> dict | None:
    """The planner's best simulated woven candidate that keeps every cold model within its
    TPOT budget; None when it wove none, or none that does."""
    woven = [c for c in result["candidates"]
             if c["policy"] == "weaver" and c["within_cold_budget"]]
    return max(woven, key=_score) if woven else None


def weaving_answer(result: dict, weaving: WeavingSpec) -> str:
    """Does weaving pay for this deployment: the best woven candidate's simulated goodput
    against the best plain one (MuxServe's placement) and the dedicated baseline, and the
    knobs it used; or which plain placement to serve instead. It pays by the planner's own
    rule for choosing it (a gain above simulation noise: planner.is_clearly_better)."""
    plain, woven = best_plain(result), best_woven(result)
    baseline = result["baseline"]["summary"]["_all"]["goodput_rps"]
    plain_goodput = plain["summary"]["_all"]["goodput_rps"]
    over_budget = [c for c in result["candidates"]
                   if c["policy"] == "weaver" and not c["within_cold_budget"]]
    if woven is None and over_budget:
        worst = max(over_budget, key=lambda c: max(c["cold_tpot_factors"].values()))
        return (f"weaving does not pay here: every woven placement raises a cold model's "
                f"TPOT over its budget (cold_tpot_budget; {worst['label']}: "
                f"{cold_factors_text(worst['cold_tpot_factors'])}); serve {plain['label']}")
    if woven is None:
        return (f"weaving: not planned (no cold device to weave into); serve "
                f"{plain['label']}")
    woven_goodput = woven["summary"]["_all"]["goodput_rps"]
    vs_plain = _relative(woven_goodput, plain_goodput)
    vs_baseline = _relative(woven_goodput, baseline)
    ratios = sorted({str(p["offload_ratio"]) for p in woven["plan"]["pairs"]})
    knobs = (f"offload_ratio {'/'.join(ratios)}, region_fraction {weaving.region_fraction}, "
             f"split {weaving.split}, {len(woven['plan']['pairs'])} pair(s)")
    refused = _refused_text(over_budget, woven_goodput)
    if is_clearly_better(_score(woven), _score(plain)):
        return (f"weaving pays here: goodput {vs_plain} over the best plain placement, "
                f"{vs_baseline} over dedicated, token throughput "
                f"{_relative(_score(woven)[1], _score(plain)[1])} ({knobs}); "
                f"serve {woven['label']}{refused}")
    return (f"weaving does not pay here: goodput {vs_plain} against the best plain placement "
            f"({knobs}; a woven one must gain over {MIN_WEAVING_GAIN:.0%}); "
            f"serve {plain['label']}{refused}")


def _refused_text(over_budget: list[dict], served_goodput: float) -> str:
    """The woven candidates of a higher goodput than the one served, which their cold
    models' TPOT budget refused (goodput alone would have served them)."""
    better = sorted((c for c in over_budget if _score(c)[0] > served_goodput),
                    key=lambda c: -_score(c)[0])
    if not better:
        return ""
    return "; not served, over the cold TPOT budget (cold_tpot_budget): " + ", ".join(
        f"{c['label']} (goodput {_score(c)[0]:.2f} req/s, "
        f"{cold_factors_text(c['cold_tpot_factors'])})" for c in better)


def _relative(value: float, base: float) -> str:
    return "n/a (the base meets the SLO nowhere)" if base <= 0 else f"{value / base - 1:+.0%}"


def mux_mode(entry: dict) -> str:
    """The mux groups' mode of a planner entry's deployment: Mux-Temporal's for the
    mux_temporal baseline, else MuxServe's."""
    return "temporal" if entry["policy"] == "mux_temporal" else "spatial-temporal"


def _score(entry: dict) -> tuple[float, float]:
    total = entry["summary"]["_all"]
    return (total["goodput_rps"], total["output_tokens_per_s"])


def _roles(plan: Plan) -> dict[int, str]:
    roles = {}
    for pair in plan.pairs:
        roles[pair.hot_gpu], roles[pair.cold_gpu] = "hot", "cold"
    return roles


def _engine(config: SimConfig, cluster: Cluster, name: str, role: str,
            device: int | None) -> dict:
    """One engine of the deployment; `device`: the core or GPU it has to itself, None on a
    shared core (its mux group binds the cores)."""
    spec, server = config.model(name), cluster.server_config(name)
    on_gpu = config.cluster.device != CPU_DEVICE
    engine = {"name": name, "model": spec.serve, "role": role,
              **_kv_fields(_num_blocks(config, cluster, name), cluster.block_bytes(name),
                           server.block_size, on_gpu),
              "max_num_seqs": server.max_num_seqs}
    if on_gpu:
        engine.update(device=f"cuda:{device}", dtype="bfloat16")
    elif device is not None:
        engine["cpu_cores"] = str(device)
    return engine


def _num_blocks(config: SimConfig, cluster: Cluster, name: str) -> int:
    """The KV blocks the simulation gives a model: its `num_blocks`, else what its device
    holds after its weights (as weaver.sim.cluster counts a GPU's memory)."""
    spec = config.model(name)
    if spec.num_blocks is not None:
        return spec.num_blocks
    return int(cluster.kv_capacity_bytes([name]) // cluster.block_bytes(name))


def _kv_fields(num_blocks: int, block_bytes: int, block_size: int, on_gpu: bool) -> dict:
    """An engine's KV: `num_blocks` usable blocks (+ vLLM's null block, as
    weaver.sim.deployment counts them), memory for them, sequences that fit in them."""
    blocks = num_blocks + 1
    longest = GPU_MAX_MODEL_LEN if on_gpu else CPU_MAX_MODEL_LEN
    return {"kv_cache_gib": math.ceil(blocks * block_bytes / GiB * 64) / 64,
            "block_size": block_size, "num_gpu_blocks_override": blocks,
            "max_model_len": min(longest, num_blocks * block_size)}
