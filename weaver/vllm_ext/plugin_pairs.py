"""Weaving under plain `vllm serve`: the plugin reads a `weaver` block and wires the rest.

    vllm serve HOT  --additional-config '{"weaver": {"role": "hot", "pair": "p1",
                                          "remote_kv_gib": 0.25, "offload_ratio": 0.5}}'
    vllm serve COLD --additional-config '{"weaver": {"role": "cold", "pair": "p1",
                                          "lend_kv_gib": 0.25}}'

Three moments of an engine's start, each reached through a patch the plugin installs
(patches/engine_config_hook.py, patches/engine_core_hook.py):
1. `configure_engine_args` (front end, before vLLM builds its config): Weaver's scheduler
   (hot) and worker extension (both) are set, and prefix caching is turned off on the hot
   engine (a remote request gets no local prefix hits), so the user gives only the block.
2. `complete_engine_config` (front end, once vLLM's config exists): the engine's `link`
   section and the hot engine's plan (computed from its own model) are put where `weaver
   serve` puts them (additional_config's `weaver.link` and `weaver.hot`; a cold engine's
   `split` becomes its split plan), so the scheduler, worker and layers run unchanged; the
   pair's counters are registered with this server's /metrics.
3. Once the EngineCore is up, the engine links itself to the other side as under `weaver
   serve` (weaver/vllm_ext/pair_links.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from weaver.vllm_ext.additional_config import (
    KEY,
    SCHEDULER,
    WORKER_EXTENSION,
    LinkSection,
    hot_section,
    link_section_for,
)
from weaver.weaving import rendezvous

logger = logging.getLogger(__name__)

GiB = 1 << 30
# The pair's policy fields, parsed by the deployment file's own model (WeavingSpec), so a
# default and a bound exist once for both launchers.
POLICY_FIELDS = {"offload_ratio", "timeout_s", "hot_tpot_ms", "cold_tpot_budget"}
HOT_FIELDS = {"role", "pair", "remote_kv_gib"} | POLICY_FIELDS
_ALLOWED = {"offload_ratio": "'auto' or a number in [0, 1]", "timeout_s": "> 0 seconds",
            "hot_tpot_ms": "> 0 ms", "cold_tpot_budget": "a factor >= 1"}
COLD_FIELDS = {"role", "pair", "lend_kv_gib", "split"}


@dataclass(frozen=True)
class PluginWeaving:
    """The `weaver` block of one `vllm serve`: its side of one pair (hot) or of several
    (cold: `pair` may be a list)."""

    role: str
    pairs: tuple[str, ...]
    remote_kv_gib: float = 0.0  # hot: the KV it places on the cold engine
    # hot: the pair's placement policy and timeout, as a deployment's `weaving` entry
    # (weaver/config/deployment.py WeavingSpec, whose defaults these are).
    policy: tuple[tuple[str, Any], ...] = ()
    lend_kv_gib: float = 0.0  # cold: the KV it lends, all pairs together
    # cold: chunks per operator kind ({"lm_head": 16}), as a deployment's `split`
    # (docs/architecture.md, part 7): a hot task waits behind one chunk, not an operator.
    split: tuple[tuple[str, int], ...] = ()

    @property
    def pair(self) -> str:
        return self.pairs[0]


def plugin_weaving(additional_config: Any) -> PluginWeaving | None:
    """The block, when the engine was started with one in plugin form (a `role`); None for
    any other engine, a gateway-planned one included. ValueError saying the fix."""
    section = (additional_config or {}).get(KEY) if isinstance(additional_config, dict) else None
    if not isinstance(section, dict) or "role" not in section:
        return None
    role = section["role"]
    fields = {"hot": HOT_FIELDS, "cold": COLD_FIELDS}.get(role)
    if fields is None:
        raise ValueError(f"--additional-config weaver.role is {role!r}; use 'hot' or 'cold'")
    # "hot" and "link": the plan and the link section it gets (step 2)
    unknown = sorted(set(section) - fields - {"hot", "link"})
    if unknown:
        raise ValueError(f"--additional-config weaver (role {role}) has unknown field(s) "
                         f"{unknown}; a {role} engine takes {sorted(fields)}")
    raw_pairs = section.get("pair")
    if role == "hot" and isinstance(raw_pairs, list):
        raise ValueError("--additional-config weaver: a hot engine under vllm serve weaves "
                         "into one cold engine, so its 'pair' is one name; to weave a hot "
                         "model into several colds, serve them with weaver serve")
    pairs = tuple(raw_pairs) if isinstance(raw_pairs, list) and role == "cold" else (raw_pairs,)
    for pair in pairs:
        rendezvous.check_pair_name(pair)
    split = section.get("split") or {}
    if not isinstance(split, dict):
        raise ValueError("--additional-config weaver.split must map operator kinds to "
                         'chunks, e.g. {"lm_head": 16}')
    weaving = PluginWeaving(
        role=role, pairs=pairs, split=tuple(split.items()),
        policy=_policy(role, pairs[0], section),
        **{k: float(v) for k, v in section.items() if k in ("remote_kv_gib", "lend_kv_gib")})
    if role == "hot":
        if weaving.remote_kv_gib <= 0:
            raise ValueError("--additional-config weaver: a hot engine needs remote_kv_gib "
                             "> 0, the KV (GiB) it places on the cold engine (at most the "
                             "cold engine's lend_kv_gib)")
    elif weaving.lend_kv_gib <= 0:
        raise ValueError("--additional-config weaver: a cold engine needs lend_kv_gib > 0, "
                         "the KV (GiB) it lends to its hot engines")
    return weaving


def _policy(role: str, pair: str, section: dict) -> tuple[tuple[str, Any], ...]:
    """A hot block's policy fields, checked and completed by the deployment's WeavingSpec."""
    if role != "hot":
        return ()
    from pydantic import ValidationError

    from weaver.config.deployment import WeavingSpec

    given = {k: v for k, v in section.items() if k in POLICY_FIELDS}
    try:
        spec = WeavingSpec(hot="hot", cold=[pair], **given)
    except ValidationError as exc:
        fields = dict.fromkeys(str(e["loc"][0]) for e in exc.errors())
        problems = "; ".join(f"{name} must be {_ALLOWED.get(name, 'valid')}, got "
                             f"{given.get(name)!r}" for name in fields)
        raise ValueError(f"--additional-config weaver: {problems}") from None
    return tuple((k, getattr(spec, k)) for k in sorted(POLICY_FIELDS))


def configure_engine_args(engine_args: Any) -> None:
    """Step 1: the hooks a weaving engine needs, set from the block alone."""
    weaving = plugin_weaving(engine_args.additional_config)
    if weaving is None:
        return
    extension = engine_args.worker_extension_cls
    if extension and extension != WORKER_EXTENSION:
        raise ValueError(f"--worker-extension-cls {extension} cannot be combined with "
                         "Weaver's weaving block (it sets its own)")
    engine_args.worker_extension_cls = WORKER_EXTENSION
    if weaving.role == "hot":
        scheduler = engine_args.scheduler_cls
        if scheduler not in (None, SCHEDULER):
            raise ValueError(f"--scheduler-cls {scheduler} cannot be combined with Weaver's "
                             "weaving block on a hot engine (it sets its own)")
        engine_args.scheduler_cls = SCHEDULER
        engine_args.enable_prefix_caching = False


def complete_engine_config(vllm_config: Any) -> None:
    """Step 2: the engine's link section (the hot engine's plan with it), and this server's
    /metrics series of the pair."""
    weaving = plugin_weaving(vllm_config.additional_config)
    if weaving is None:
        return
    from weaver.weaving.pair_metrics import register_pair_collector

    # What a killed predecessor left, and what this engine will leave, are looked after by
    # weaver/vllm_ext/plain_serve.py (called first, for a mux member too).
    served = vllm_config.model_config.served_model_name
    model = served if isinstance(served, str) else served[0]
    files = rendezvous.PairFiles(rendezvous.runtime_dir())
    link = LinkSection(role=weaving.role, pairs=weaving.pairs, root=str(files.root),
                       lend_bytes=int(weaving.lend_kv_gib * GiB),
                       cold_model=model if weaving.role == "cold" else "")
    vllm_config.additional_config[KEY].update(link_section_for(link))
    if weaving.role == "hot":
        plan = hot_plan_for(vllm_config, weaving, model)
        vllm_config.additional_config[KEY].update(hot_section([plan]))
        logger.info("weaving pair %s: hot engine %r places %d remote blocks (ratio %s) "
                    "once its cold engine answers", weaving.pair, model,
                    plan.num_remote_blocks, plan.offload_ratio)
    elif weaving.split:
        from weaver.splitting.deploy import validate_split_chunks

        # Where a gateway-planned cold engine has its split plan (additional_config.py),
        # read by the split layers when the model loads.
        chunks = validate_split_chunks(dict(weaving.split))
        vllm_config.additional_config[KEY]["split"] = {"chunks": chunks}
    register_pair_collector(files, weaving.role, weaving.pairs)


def hot_plan_for(vllm_config: Any, weaving: PluginWeaving, model: str) -> Any:
    from weaver.weaving.plan import attention_shape_of, plugin_hot_plan

    model_config = vllm_config.model_config
    on_cpu = vllm_config.device_config.device_type == "cpu"
    dtype = str(model_config.dtype).removeprefix("torch.")
    shape = attention_shape_of(model_config.hf_config.to_dict(), dtype,
                               vllm_config.cache_config.block_size,
                               "pages" if on_cpu else "token")
    return plugin_hot_plan(model, weaving.pair, shape, weaving.remote_kv_gib,
                           model_config.max_model_len,
                           vllm_config.scheduler_config.max_num_seqs, dict(weaving.policy),
                           "shm" if on_cpu else "cuda")
