"""The split plan a cold model of the deployment runs with (its `split:` field).

``split: auto`` plans with Algorithm 1 from a saved profile; an explicit mapping is taken
as it is. The result, chunks per operator kind, travels to the engine in
``additional_config`` (weaver/vllm_ext/additional_config.py). Pure Python.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from weaver.config.deployment import ModelSpec
from weaver.splitting.algorithm import plan_split
from weaver.splitting.profile import LM_HEAD_NAME, PER_LAYER_OP_NAMES, SplitProfile

logger = logging.getLogger(__name__)

PROFILES_DIR_ENV = "WEAVER_SPLIT_PROFILES_DIR"
# What the cold engine can split: the linear layers along output features and the LM head
# along the vocabulary (weaver/vllm_ext/layers.py), attention along the sequences of
# the batch (weaver/vllm_ext/attention/backend.py): every operator the profile names.
SPLITTABLE_OPS = frozenset({*PER_LAYER_OP_NAMES, LM_HEAD_NAME})


def validate_split_chunks(chunks: dict[str, int]) -> dict[str, int]:
    """The plan's chunk counts, checked; ValueError saying how to fix a bad one."""
    unknown = sorted(set(chunks) - SPLITTABLE_OPS)
    if unknown:
        raise ValueError(f"unknown operator(s) {unknown} in the split plan; known: "
                         f"{sorted(SPLITTABLE_OPS)}")
    for name, count in chunks.items():
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"split plan: chunks for {name!r} must be an int >= 1, not {count!r}")
    return {n: k for n, k in chunks.items() if k > 1}


def default_profiles_dir() -> Path:
    """`$WEAVER_SPLIT_PROFILES_DIR`, else `$XDG_CACHE_HOME/weaver/split-profiles`."""
    if os.environ.get(PROFILES_DIR_ENV):
        return Path(os.environ[PROFILES_DIR_ENV]).expanduser()
    cache_home = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(cache_home).expanduser() / "weaver" / "split-profiles"


def default_profile_path(spec: ModelSpec) -> Path:
    # A name may be a Hugging Face id (org/model): one file per name, no sub-directory.
    return default_profiles_dir() / f"{spec.name.replace('/', '--')}.json"


def profile_path_of(spec: ModelSpec) -> Path:
    return Path(spec.split_profile).expanduser() if spec.split_profile else default_profile_path(
        spec)


def split_chunks_for(spec: ModelSpec, config_path: str | None = None) -> dict[str, int]:
    """Chunks per operator kind for ``spec``; {} when it does not split."""
    if spec.split is None:
        return {}
    if isinstance(spec.split, dict):
        try:
            return validate_split_chunks(dict(spec.split))
        except ValueError as exc:
            raise ValueError(f"model {spec.name!r}: {exc}") from None
    path = profile_path_of(spec)
    if not path.is_file():
        where = config_path or "DEPLOYMENT.yaml"
        raise ValueError(
            f"model {spec.name!r} has split: auto but there is no profile at {path}; measure "
            f"one with `weaver plan-split {where} --measure --cold {spec.name}` (or set "
            "split_profile, or give explicit chunks)")
    profile = SplitProfile.load(path)
    plan = plan_split(profile.operator_specs(), profile.split_config())
    logger.info("split plan for %s from %s: %s (W %.1f us -> %.1f us)", spec.name, path,
                plan.chunks, plan.wait_before_s * 1e6, plan.wait_after_s * 1e6)
    return validate_split_chunks(plan.chunks)
