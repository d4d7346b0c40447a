"""The engines of a running `weaver serve` as its /health names them, and the roles the soak
kills: every (engine, process kind) pair, so that a run kills the EngineCore and the worker
of every engine of every kind (weaving hot and cold, unified-pool hot and cold, mux
members, a phase split's prompt and token engines).

/health's `models` holds one entry per served model; a phase split's entry holds its
engines under `prefill` and `decode` (weaver/server/phase_split.py `describe`), each as
the gateway describes an engine: status, restarts, engine_pids. `weaving` holds one entry
per pair, with its status (ok, degraded, starting).
"""

from __future__ import annotations

import random
from typing import Any

PROCESS_KINDS = ("engine core", "worker")

Role = tuple[str, str]  # (engine name, process kind)


def engines_of(health: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every engine of the deployment by name, a phase split's engines included."""
    engines: dict[str, dict[str, Any]] = {}
    for name, model in health.get("models", {}).items():
        if model.get("role") == "phase_split":
            for phase in ("prefill", "decode"):
                engines.update(model.get(phase) or {})
        else:
            engines[name] = model
    return engines


def in_service(health: dict[str, Any]) -> dict[str, int]:
    """Engines in service, with their restart counts."""
    return {name: engine.get("restarts", 0) for name, engine in engines_of(health).items()
            if engine.get("status") == "ok"}


def pair_name(pair: dict[str, Any]) -> str:
    return f"{pair['hot']}->{pair['cold']}"


def pair_statuses(health: dict[str, Any]) -> dict[str, str]:
    """Each weaving pair's status (ok, degraded, starting), by `hot->cold`."""
    return {pair_name(pair): pair.get("status", "?") for pair in health.get("weaving") or []}


def kill_order(engines: list[str], num_kills: int, rng: random.Random) -> list[Role]:
    """`num_kills` roles: every role once in a shuffled order, then again, and so on, so
    that kills spread over every role (30 kills over 8 engines' 16 roles hit each once or
    twice) and a short run still mixes kinds and engines."""
    roles = [(engine, kind) for engine in sorted(engines) for kind in PROCESS_KINDS]
    order: list[Role] = []
    while len(order) < num_kills:
        cycle = roles[:]
        rng.shuffle(cycle)
        order += cycle
    return order[:num_kills]


def not_killed(engines: list[str], kills: list[dict[str, Any]]) -> list[Role]:
    """Roles no kill hit."""
    hit = {(k["model"], k["process"]) for k in kills}
    return [(e, kind) for e in sorted(engines) for kind in PROCESS_KINDS if (e, kind) not in hit]
