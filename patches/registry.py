"""Every change Weaver makes to vLLM's behaviour outside vLLM's official hooks.

Weaver reaches vLLM through its official hooks first (docs/vllm-hooks.md): the general
plugin entry point, ``scheduler_cls``, ``worker_extension_cls``, ``register_backend``,
``PluggableLayer.register_oot``, ``additional_config``. What those cannot do is done by
the modules of this package, one change each, listed here with why, how and when it can
go. Each entry names the vLLM attributes it needs (``targets``) and, for callables, the
parameters it relies on: ``check_targets`` (run by the plugin at start-up in every vLLM
process) raises when one is missing, and tests/patches/test_patch_drift.py checks every
entry, so a vLLM upgrade that moves one fails loudly instead of silently dropping it.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass


class PatchTargetMissing(RuntimeError):
    """A vLLM attribute a patch needs is gone or has changed its signature."""


@dataclass(frozen=True)
class Target:
    """A vLLM attribute, ``module:Qualified.name``, and the parameters Weaver relies on
    (None: not checked, e.g. a class)."""

    path: str
    params: tuple[str, ...] | None = None

    def resolve(self) -> object:
        module_name, _, qualname = self.path.partition(":")
        try:
            obj: object = importlib.import_module(module_name)
            for part in qualname.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError) as exc:
            raise PatchTargetMissing(f"{self.path} is gone ({exc})") from None
        return obj

    def problem(self) -> str | None:
        """Why the target no longer fits, or None."""
        try:
            obj = self.resolve()
        except PatchTargetMissing as exc:
            return str(exc)
        if self.params is not None:
            found = tuple(inspect.signature(obj).parameters)  # type: ignore[arg-type]
            if found[: len(self.params)] != self.params:
                return f"{self.path} takes {found}, the patch expects {self.params}"
        return None


@dataclass(frozen=True)
class Patch:
    name: str  # the module in this package that applies it
    targets: tuple[Target, ...]
    why: str
    how: str
    remove_when: str


# The worker's two step methods: patches/worker_step_lock.py and worker_step_turns.py wrap
# both (the same check and rebinding, worker_step_lock.step_methods).
WORKER_STEP_TARGETS = (
    Target("vllm.v1.worker.gpu_worker:Worker.execute_model", ("self", "scheduler_output")),
    Target("vllm.v1.worker.gpu_worker:Worker.sample_tokens", ("self", "grammar_output")),
)

PATCHES: tuple[Patch, ...] = (
    Patch(
        name="worker_step_lock",
        targets=WORKER_STEP_TARGETS,
        why="A cold worker serves offloaded attention from an idle thread between its own "
            "steps; the two must never run at once (vLLM's CPU kernels share scratch "
            "buffers across threads).",
        how="Rebinds the cold worker instance's execute_model and sample_tokens to wrappers "
            "that hold the cold runtime's step lock around the originals.",
        remove_when="vLLM gives workers a hook around each step (a step-context callback).",
    ),
    Patch(
        name="worker_step_turns",
        targets=(*WORKER_STEP_TARGETS, Target("vllm.v1.core.sched.output:SchedulerOutput")),
        why="The engines of a colocated group (MuxServe, Mux-Temporal) take turns step by "
            "step on one set of devices; each step must wait for its turn and say whether it "
            "holds prefill tokens.",
        how="Rebinds the worker instance's execute_model and sample_tokens to wrappers that "
            "ask the group's turn table before the forward pass and free the turn once the "
            "step's output exists (weaver/vllm_ext/mux_gate.py reads scheduled_new_reqs, "
            "num_scheduled_tokens and total_num_scheduled_tokens).",
        remove_when="vLLM gives workers a hook around each step (a step-context callback).",
    ),
    Patch(
        name="routing_kv_cache_manager",
        targets=(
            Target("vllm.v1.core.sched.scheduler:Scheduler.__init__"),
            Target("vllm.v1.core.kv_cache_manager:KVCacheManager.allocate_slots",
                   ("self", "request", "num_new_tokens")),
        ),
        why="A hot engine admits requests against its own KV blocks and the blocks a cold "
            "engine lends, which vLLM's one KVCacheManager per scheduler cannot express.",
        how="After vLLM's Scheduler.__init__, Weaver's scheduler replaces its "
            "kv_cache_manager by RoutingKVCacheManager, which owns the local manager and a "
            "second one over the remote block ids and routes every call by request.",
        remove_when="vLLM supports several KV pools per scheduler (tiered KV placement).",
    ),
    Patch(
        name="block_pool_class",
        targets=(
            Target("vllm.v1.core.block_pool:BlockPool.get_num_free_blocks", ("self",)),
            Target("vllm.v1.core.block_pool:BlockPool.get_new_blocks", ("self", "num_blocks")),
            Target("vllm.v1.core.block_pool:BlockPool.free_blocks", ("self", "ordered_blocks")),
            Target("vllm.v1.core.block_pool:BlockPool.touch", ("self", "blocks")),
            Target("vllm.v1.core.block_pool:BlockPool.evict_blocks", ("self", "block_ids")),
            Target("vllm.v1.core.block_pool:BlockPool.reset_prefix_cache", ("self",)),
            Target("vllm.v1.core.block_pool:BlockPool._maybe_evict_cached_block",
                   ("self", "block")),
        ),
        why="An engine whose KV lives in the unified pool (or a hot engine's remote blocks "
            "there) must take pages from the pool's allocator for every block vLLM hands "
            "out and give them back when vLLM frees it.",
        how="Swaps the class of the scheduler's BlockPool instance to AllocatorBlockPool, a "
            "subclass that consults the allocator around vLLM's own methods.",
        remove_when="vLLM lets a scheduler supply its own BlockPool class.",
    ),
    Patch(
        name="kv_cache_allocation",
        targets=(
            Target("vllm.v1.worker.cpu_model_runner:CPUModelRunner.initialize_kv_cache_tensors",
                   ("self", "kv_cache_config", "kernel_block_sizes",
                    "kv_cache_allocation_context")),
            Target("vllm.v1.worker.utils:allocate_kv_cache"),
        ),
        why="A cold engine with a unified pool keeps its KV in the pool's shared pages, and "
            "vLLM's own zero-filled cache buffer would take as much memory again.",
        how="Wraps CPUModelRunner.initialize_kv_cache_tensors (class-wide, a no-op for "
            "engines without a pool); for a pool engine it lets vLLM allocate with "
            "torch.empty instead of torch.zeros for that one call, then opens the pool.",
        remove_when="vLLM's kv_cache_allocation_context can supply external memory on CPU.",
    ),
    Patch(
        name="engine_stat_logger",
        targets=(
            Target("vllm.v1.metrics.loggers:StatLoggerManager.__init__"),
            Target("vllm.v1.engine.async_llm:AsyncLLM.__init__"),
        ),
        why="The gateway labels each engine's running/waiting/KV series by model; vLLM's "
            "Prometheus logger keeps one set per process.",
        how="Appends a recorder to the engine client's logger_manager.stat_loggers, which "
            "vLLM calls after every step.",
        remove_when="vLLM's build_async_engine_client takes stat_loggers.",
    ),
    Patch(
        name="prometheus_logger_lock",
        targets=(Target("vllm.v1.metrics.loggers:PrometheusStatLogger.__init__",
                        ("self", "vllm_config")),),
        why="Each PrometheusStatLogger unregisters every vllm: collector of the process and "
            "registers its own; two engines the gateway builds at once interleave that and "
            "one start fails with DuplicateTimeseries.",
        how="Wraps PrometheusStatLogger.__init__ (class-wide, in the gateway's process) in "
            "one lock, so the loggers of engines started together are built in turn.",
        remove_when="vLLM keeps one set of Prometheus collectors per engine client (or "
                    "registers them idempotently).",
    ),
    Patch(
        name="engine_config_hook",
        targets=(Target("vllm.engine.arg_utils:EngineArgs.create_engine_config", ("self",)),),
        why="Under plain `vllm serve` a weaving engine is configured by its --additional-"
            "config `weaver` block alone: its scheduler and worker extension must be set "
            "before vLLM builds the config, and the hot engine's plan needs the built "
            "config (its model, block size and dtype).",
        how="Wraps create_engine_config: the plugin's before(engine_args), vLLM's original, "
            "then after(vllm_config); engines without a weaving block pass through.",
        remove_when="vLLM lets a general plugin adjust engine arguments and the built "
                    "config (a config hook).",
    ),
    Patch(
        name="engine_core_hook",
        targets=(Target("vllm.v1.engine.core:EngineCoreProc.run_busy_loop", ("self",)),),
        why="Under plain `vllm serve` each weaving engine links itself to its pair once its "
            "workers are up: the cold worker starts its link thread, the hot scheduler gets "
            "a link that reaches its worker through the executor's collective_rpc.",
        how="Wraps EngineCoreProc.run_busy_loop: the plugin's ready(engine_core), then "
            "vLLM's loop; engines without a weaving block pass through. (A data-parallel "
            "engine's own loop is not wrapped: weaving is for one engine per model.)",
        remove_when="vLLM gives plugins an engine-ready callback with the executor.",
    ),
)


def check_targets() -> None:
    """Raise PatchTargetMissing naming every patch whose vLLM targets moved."""
    problems = [f"patches/{patch.name}.py: {problem}" for patch in PATCHES
                for problem in map(Target.problem, patch.targets) if problem]
    if problems:
        raise PatchTargetMissing(
            "the installed vLLM no longer has what Weaver patches ("
            + "; ".join(problems)
            + "); install the vLLM version Weaver pins (pyproject.toml) or update the "
            "patches in patches/")
