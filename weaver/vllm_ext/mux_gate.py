"""A colocated engine's steps taking turns with its group (MuxServe, Mux-Temporal).

An engine belongs to a group when its ``--additional-config`` has a ``weaver.mux`` block:

    {"weaver": {"mux": {"group": "g1", "member": "model-a",
                        "members": {"model-a": 4.0, "model-b": 1.0},
                        "mode": "spatial-temporal"}}}

``members`` names every engine of the group in one order (the same in each engine's block)
with its weight, the model's request rate (MuxServe weighs its decode round-robin by it);
``mode`` is ``temporal`` or ``spatial-temporal`` (weaver/mux/turns.py); ``skip_limit``
(default ``DEFAULT_SKIP_LIMIT``, 4) bounds how often a waiting step is passed over. The
gateway writes this block for a deployment's ``mux`` group; under plain ``vllm serve`` a
user writes it.

Once the EngineCore is up (patches/engine_core_hook.py), its worker opens the group's turn
table (weaver/mux/table.py) and its steps ask for a turn (patches/worker_step_turns.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from weaver.mux.table import GroupLayout, TurnTable
from weaver.mux.turns import DEFAULT_SKIP_LIMIT, Kind, Mode
from weaver.patches import worker_step_turns
from weaver.vllm_ext.additional_config import KEY

logger = logging.getLogger(__name__)

FIELDS = {"group", "member", "members", "mode", "skip_limit", "runtime_dir"}


@dataclass(frozen=True)
class MuxMembership:
    layout: GroupLayout
    member: str
    runtime_dir: str | None = None

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "group": self.layout.group, "member": self.member,
            "members": dict(zip(self.layout.members, self.layout.weights, strict=True)),
            "mode": self.layout.mode.value, "skip_limit": self.layout.skip_limit}
        if self.runtime_dir is not None:
            data["runtime_dir"] = self.runtime_dir
        return data


def mux_membership(additional_config: Any) -> MuxMembership | None:
    """The engine's group, or None; ValueError saying the fix for a malformed block."""
    section = (additional_config or {}).get(KEY) if isinstance(additional_config, dict) else None
    block = section.get("mux") if isinstance(section, dict) else None
    if block is None:
        return None
    where = "--additional-config weaver.mux"
    if not isinstance(block, dict):
        raise ValueError(f"{where} must be a mapping with group, member, members and mode")
    unknown = sorted(set(block) - FIELDS)
    missing = sorted({"group", "member", "members", "mode"} - set(block))
    if unknown or missing:
        raise ValueError(f"{where}: unknown field(s) {unknown}, missing {missing}; it takes "
                         f"{sorted(FIELDS)}")
    members = block["members"]
    if not isinstance(members, dict) or not members:
        raise ValueError(f'{where}.members must map each member to its weight, e.g. '
                         '{"model-a": 4.0, "model-b": 1.0}')
    try:
        mode = Mode(block["mode"])
    except ValueError:
        raise ValueError(f"{where}.mode is {block['mode']!r}; use "
                         f"{[m.value for m in Mode]}") from None
    layout = GroupLayout(str(block["group"]), tuple(members),
                         tuple(float(w) for w in members.values()), mode,
                         int(block.get("skip_limit", DEFAULT_SKIP_LIMIT)))
    layout.index(str(block["member"]))  # ValueError names the group's members
    return MuxMembership(layout, str(block["member"]), block.get("runtime_dir"))


def step_kind(scheduler_output: Any) -> Kind | None:
    """What a step asks a turn for: PREFILL when it holds prompt tokens (a new request, or
    a request given more than one token), DECODE otherwise; None for an empty step."""
    total = scheduler_output.total_num_scheduled_tokens
    if total == 0:
        return None
    if scheduler_output.scheduled_new_reqs or total > len(scheduler_output.num_scheduled_tokens):
        return Kind.PREFILL
    return Kind.DECODE


class StepTurns:
    """The worker's side of its group: a turn before each step, given back after it."""

    def __init__(self, table: TurnTable, index: int) -> None:
        self.table, self.index = table, index

    def begin(self, scheduler_output: Any) -> bool:
        kind = step_kind(scheduler_output)
        if kind is None:
            return False
        self.table.start(self.index, kind)
        return True

    def end(self) -> None:
        self.table.finish(self.index)


def join_mux_group(worker: Any, membership_data: dict) -> dict:
    """Run in the worker (collective_rpc with this function): open the table, gate steps."""
    membership = mux_membership({KEY: {"mux": membership_data}})
    assert membership is not None
    runtime_dir = Path(membership.runtime_dir) if membership.runtime_dir else None
    table = TurnTable.open(membership.layout, runtime_dir)
    inner = getattr(worker, "worker", worker)  # vLLM's WorkerWrapperBase holds the worker
    turns = StepTurns(table, membership.layout.index(membership.member))
    worker_step_turns.install(inner, turns.begin, turns.end)
    logger.info("mux group %s: %s takes turns (%s) through %s", membership.layout.group,
                membership.member, membership.layout.mode.value, table.path)
    return {"table": str(table.path), "index": turns.index}


def on_engine_core_ready(engine_core: Any) -> None:
    """The engine's worker joins its group (no-op for an engine without a mux block)."""
    membership = mux_membership(engine_core.vllm_config.additional_config)
    if membership is None:
        return
    engine_core.model_executor.collective_rpc(join_mux_group, args=(membership.to_dict(),))
