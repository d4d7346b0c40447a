"""A simulated cluster that mirrors a Weaver deployment file (weaver/config/deployment.py).

Each model of the deployment is one instance (its engine, pinned to its own cores) with
the KV blocks its engine gets; a weaving entry becomes a hot/cold pair whose remote pool
holds the blocks the cold model lends (`lend_kv_gib`, sized as `weaver.weaving.plan`
sizes the shared region) and places sequences by the hot scheduler's own `RatioPlacement`.
A mux group becomes one instance of all its models taking turns by the group's own rule,
mode and weights (`weaver.mux.turns`, policy muxserve), each engine keeping its own KV. A
phase split becomes Splitwise's prompt and token instances (policy splitwise), one per
engine, the prompt's KV crossing the profile's link, the first token from the token
instance as the gateway streams it.
Step times come from measured profiles (`weaver profile --engine`), one per model, timed
on as many cores as the model's engine runs on.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from weaver.config.deployment import Deployment, ModelSpec, Role
from weaver.sim.config import SimConfig
from weaver.sim.profile import CPU_DEVICE, Profile
from weaver.weaving.plan import GiB, block_size_of, loan_pool_hosts, num_lent_blocks
from weaver.workloads.types import TraceRequest

# vLLM's default token budget per step for an API server on CPU
# (vllm/engine/arg_utils.py, `get_batch_defaults`: OPENAI_API_SERVER 2048 * world size).
CPU_SERVER_MAX_NUM_BATCHED_TOKENS = 2048
# Simulated time allowed after the last arrival; a replay should drain well before.
REPLAY_DRAIN_S = 3600.0
# A mux group's engines run their threads on all the group's cores: two overlapping steps
# share them evenly.
CPU_OVERLAP_SPEED = 0.5


def num_usable_blocks(spec: ModelSpec, kv_bytes_per_token: int) -> int:
    """The KV blocks the engine's scheduler can hand out. vLLM keeps one block as the null
    block (v1/core/block_pool.py), so an override of N leaves N - 1; without an override,
    the KV budget (`--kv-cache-memory-bytes`) divided by the block's bytes."""
    if spec.num_gpu_blocks_override is not None:
        return max(1, spec.num_gpu_blocks_override - 1)
    block_bytes = block_size_of(spec) * kv_bytes_per_token
    return max(1, int(spec.kv_cache_gib * GiB) // block_bytes - 1)


def sim_config_from_deployment(
    deployment: Deployment,
    profiles: Mapping[str, str],
    requests: Sequence[TraceRequest],
    name: str = "deployment",
    overlap_speed: float = CPU_OVERLAP_SPEED,
    contended_speed: float = 1.0,
) -> SimConfig:
    """The `SimConfig` (cpu device, one instance per model or mux group, explicit
    placement) that serves `requests` as `deployment` would. `profiles` maps each model
    name to a profile JSON; `contended_speed` is a mux group's step speed while its other
    engine has work (benchmarks/mux_contention.py measures it)."""
    served = _served_models(deployment)
    missing = [name for name in served if name not in profiles]
    if missing:
        raise ValueError(f"no profile for model(s) {missing}; pass --profile PATH (all models) "
                         "or --profile MODEL=PATH")
    shapes = {name: Profile.load(profiles[name]).shape for name in served}
    span = max((r.arrival_s for r in requests), default=0.0)
    models = [_model(name, spec, profiles[name], shapes[name].kv_bytes_per_token,
                     sum(r.model == name for r in requests) / max(span, 1.0))
              for name, spec in served.items()]
    gpus = _instances(deployment)
    index = {model: i for i, gpu in enumerate(gpus) for model in gpu["models"]}
    loans = loan_pool_hosts(deployment)  # once: it logs each cold lent in fixed regions
    pairs = [pair for entry in deployment.weaving
             for pair in _pairs(deployment, entry, index, shapes, loans)]
    policy = _policy(deployment)
    return SimConfig.model_validate({
        "name": name, "duration_s": max(span, 1e-3), "drain_s": REPLAY_DRAIN_S,
        "policy": policy,
        "cluster": {"device": CPU_DEVICE, "num_gpus": len(gpus)},
        "models": models,
        "server": {"max_num_batched_tokens": CPU_SERVER_MAX_NUM_BATCHED_TOKENS},
        "weaving": {"offload_policy": "ratio"},
        "muxserve": {"overlap_speed": overlap_speed, "contended_speed": contended_speed},
        # The client's first token comes from the token engine (weaver/server/phase_split.py).
        "splitwise": {"first_token": "token"},
        "placement": {"gpus": gpus, "pairs": pairs},
    })


def _served_models(deployment: Deployment) -> dict[str, ModelSpec]:
    """Each model clients send requests to, with the spec of the engine that serves it: a
    phase split's first token engine (its engines agree on shape, block size and length:
    weaver/config/deployment.py)."""
    splits = {split.model: split for split in deployment.phase_split}
    return {name: deployment.model(splits[name].decode[0] if name in splits else name)
            for name in deployment.served_names}


def _policy(deployment: Deployment) -> str:
    kinds = [kind for kind, present in (("weaver", deployment.weaving),
                                        ("muxserve", deployment.mux),
                                        ("splitwise", deployment.phase_split)) if present]
    if len(kinds) > 1:
        raise ValueError(f"the simulator runs one policy per deployment; this one has "
                         f"{' and '.join(kinds)} (simulate them as separate deployments)")
    return kinds[0] if kinds else "dedicated"


def _instances(deployment: Deployment) -> list[dict]:
    """One simulated instance per mux group (its models in the file's order), one per engine
    of a phase split (its model, in the engine's role) and one per other model, in the order
    the file first names them."""
    gpus: list[dict] = []
    for spec in deployment.models:
        group = deployment.mux_group_of(spec.name)
        phase_split = deployment.phase_split_of(spec.name)
        if phase_split is not None:
            split, phase = phase_split
            gpus.append({"models": [split.model],
                         "role": "prompt" if phase == "prefill" else "token"})
        elif group is None:
            gpus.append({"models": [spec.name]})
        elif group.models[0] == spec.name:
            # A unified group's pool is its models' budgets together, as the gateway plans
            # it (weaver/server/mux_pool.py); the simulator divides it by its own ADBS rule.
            gpus.append({"models": list(group.models), "mux": {
                "mode": group.mode, "skip_limit": group.skip_limit,
                "own_kv": not group.unified_kv,
                "weights": {m: group.weight(m) for m in group.models}}})
    return gpus


def _model(name: str, spec: ModelSpec, profile: str, kv_bytes_per_token: int,
           rate: float) -> dict:
    return {"name": name, "profile": profile, "rate": rate,
            "num_blocks": num_usable_blocks(spec, kv_bytes_per_token),
            "block_size": block_size_of(spec), "max_num_seqs": spec.max_num_seqs}


def _pairs(deployment: Deployment, entry, index: Mapping[str, int], shapes: Mapping,
           loans: Mapping[str, list[ModelSpec]]) -> list[dict]:
    """One pair per cold model of a weaving entry, as `plan_pairs` plans them."""
    hot = deployment.model(entry.hot)
    if hot.role is not Role.HOT:
        raise ValueError(f"weaving names {hot.name!r} as hot but its role is {hot.role.value}")
    # Whole hot blocks in the lent bytes, counted as `plan_pairs` counts them.
    block_bytes = block_size_of(hot) * shapes[hot.name].kv_bytes_per_token
    pairs = []
    for name in entry.cold:
        pair = {"hot_gpu": index[hot.name], "cold_gpu": index[name],
                "offload_ratio": entry.offload_ratio,
                "remote_blocks": num_lent_blocks(deployment, deployment.model(name),
                                                 block_bytes),
                "hot_tpot_ms": entry.hot_tpot_ms, "cold_tpot_budget": entry.cold_tpot_budget}
        if name in loans:  # the whole loan, shared with the cold model's other hot models
            loan_blocks = int(deployment.model(name).lend_kv_gib * GiB) // block_bytes
            floors = sum(math.ceil(other.max_model_len / block_size_of(other))
                         * block_size_of(other) * shapes[other.name].kv_bytes_per_token
                         for other in loans[name] if other.name != hot.name)
            pair.update(remote_blocks=loan_blocks,
                        loan_quota_blocks=loan_blocks - math.ceil(floors / block_bytes))
        pairs.append(pair)
    return pairs
