"""One vLLM engine and its own OpenAI app, built with vLLM 0.32's launcher functions.

This is the only place the gateway touches vLLM's serving internals (docs/vllm-hooks.md,
"Serving several models"):
`make_arg_parser` → `build_async_engine_client` (here `_engine_client`, which builds the
engine off the event loop) → `build_app` + `init_app_state`. The
gateway in `weaver.server` then routes requests to the app of the model they name, so the
OpenAI protocol itself is vLLM's own code.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import functools
import json
import logging
import os
import socket
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from weaver.config.cpu_cores import pin_engine_processes, usable_cpu_cores
from weaver.config.deployment import ModelSpec, Role
from weaver.config.devices import EnginePlacement
from weaver.models.registry import vllm_model_arg
from weaver.patches import prometheus_logger_lock
from weaver.vllm_ext.additional_config import SCHEDULER, WORKER_EXTENSION, phase_split_of, pool_of
from weaver.vllm_ext.engine.flags import EngineFlagError, flags_for, parse_serve_args
from weaver.vllm_ext.engine.leftovers import (
    RPC_BASE_PATH_ENV,
    forget_closed_engine_callables,
    make_rpc_dir,
    release_closed_engine_memory,
    remove_left_over_shm,
    remove_rpc_dir,
)
from weaver.vllm_ext.engine.stats import EngineStatsRecorder, attach_stats_recorder
from weaver.vllm_ext.gateway_watch import GATEWAY_PID_ENV
from weaver.weaving.plan import block_size_of

if TYPE_CHECKING:
    from fastapi import FastAPI
    from vllm.engine.protocol import EngineClient

logger = logging.getLogger(__name__)

GiB = 1 << 30


@dataclass
class EngineHandle:
    """A running engine, the vLLM app serving it, and its processes."""

    spec: ModelSpec
    client: EngineClient
    app: FastAPI
    max_model_len: int
    model_path: Path
    process_ids: list[int] = field(default_factory=list)
    stats: EngineStatsRecorder | None = None

    @property
    def is_dead(self) -> bool:
        return bool(self.client.errored)

    def scheduler_stats(self) -> dict[str, float]:
        return self.stats.snapshot() if self.stats is not None else {}

    async def check_health(self) -> None:
        await self.client.check_health()

    async def step_once(self) -> None:
        """Make the engine run a step: a one-token request of token id 0. An idle engine
        steps only for requests, and a hot engine links its weaving pair before a step
        (weaver/vllm_ext/pair_links.py), so the gateway sends this to have it link now."""
        from vllm import SamplingParams

        request_id = f"weaver-step-{uuid.uuid4().hex}"
        async for _ in self.client.generate({"prompt_token_ids": [0]},
                                            SamplingParams(max_tokens=1), request_id):
            pass

    def describe(self) -> dict[str, Any]:
        return {
            "role": self.spec.role.value,
            "device": self.spec.device,
            "model_path": str(self.model_path),
            "max_model_len": self.max_model_len,
            "engine_pids": self.process_ids,
        }


# How long an engine's processes get to tear down after SIGTERM before they are killed.
# vLLM's own exit path passes its request-drain timeout (0 by default), which kills the
# EngineCore at once: its worker is then force-killed too and neither unlinks its
# shared-memory message queues (four psm_* segments and two semaphores leaked per
# two-engine `weaver serve`, measured). Requests are still aborted at once (mode "abort").
ENGINE_TEARDOWN_GRACE_S = 10.0
# How long a cancelled engine start is let finish so that it can be shut down.
ORPHANED_BUILD_WAIT_S = 120.0
# How often an engine start looks for its EngineCore process while it holds the spawn lock.
SPAWN_POLL_S = 0.05


def engine_cli_args(
    spec: ModelSpec, model_path: Path, additional_config: dict | None = None,
    placement: EnginePlacement | None = None,
) -> list[str]:
    """The `vllm serve` arguments equivalent to one model of the deployment (placed as
    `placement` says: weaver/config/devices.py)."""
    args = [
        "--model", vllm_model_arg(spec.model, model_path),
        "--served-model-name", spec.name,
        "--max-model-len", str(spec.max_model_len),
        "--dtype", spec.dtype,
        "--max-num-seqs", str(spec.max_num_seqs),
        "--kv-cache-memory-bytes", str(int(spec.kv_cache_gib * GiB)),
        # torch.compile costs minutes on a CPU and hides Weaver's poll points inside the
        # compiled graph (docs/vllm-hooks.md, "Layers"); on a GPU, CUDA graphs would also
        # freeze the weaving split of a step (the paper's evaluation ran eager too).
        "--enforce-eager",
        "--disable-uvicorn-access-log",
    ]
    if placement is not None:
        args += list(placement.cli_args)
    if spec.block_size is not None:
        args += ["--block-size", str(spec.block_size)]
    if spec.role is not Role.DEDICATED:
        args += ["--worker-extension-cls", WORKER_EXTENSION]
    if spec.role is Role.HOT:
        # Remote requests get no prefix-cache hits (their blocks live in another pool),
        # and the remote pool's block size must be the one the plan was computed with.
        args += ["--scheduler-cls", SCHEDULER, "--no-enable-prefix-caching",
                 "--block-size", str(block_size_of(spec))]
    pool = pool_of(additional_config or {})
    if pool is not None:
        # An engine whose KV lives in a unified pool: its scheduler allocates through the
        # pool's allocator (the quota, not the KV budget, bounds it) and needs an id for
        # every block it may ever hold, so a block-count override (a colocated model's own
        # budget, now its starting quota) does not reach vLLM. The owner (a cold engine)
        # keeps vLLM's prefix caching: its cached free blocks keep their pages until the
        # pool lends them (weaver/vllm_ext/block_pool.py). A colocated engine leases every
        # block, and a lease cannot lend cached pages back, so it runs without.
        plan, tenant = pool
        args = _replace_arg(args, "--kv-cache-memory-bytes", str(plan.engine_kv_bytes(tenant)))
        args += ["--scheduler-cls", SCHEDULER,
                 "--block-size", str(plan.tenant(tenant).shape.block_size)]
        if not plan.tenant(tenant).is_owner:
            args += ["--no-enable-prefix-caching"]
    phase_split = phase_split_of(additional_config or {})
    if phase_split is not None:
        # A phase-split engine: the gateway's requests tell its KV connector to stage the
        # prompt's KV (prompt engine) or to take it (token engine). The requests name the
        # model the split serves, which the engine answers to (and names its answers by).
        from weaver.vllm_ext.kv_connector import kv_transfer_config

        model, phase = phase_split
        role = "kv_producer" if phase == "prefill" else "kv_consumer"
        args = _replace_arg(args, "--served-model-name", model)
        args += ["--kv-transfer-config", json.dumps(kv_transfer_config(role))]
    if additional_config:
        args += ["--additional-config", json.dumps(additional_config)]
    if spec.num_gpu_blocks_override is not None and pool is None:
        args += ["--num-gpu-blocks-override", str(spec.num_gpu_blocks_override)]
    # The user's own come last: vLLM's parser keeps the last value of a repeated flag.
    args += flags_for(spec.extra_engine_args, f"model {spec.name!r}: extra_engine_args")
    return [*args, *spec.vllm_flags]


def _replace_arg(args: list[str], flag: str, value: str) -> list[str]:
    index = args.index(flag)
    return [*args[: index + 1], value, *args[index + 2:]]


def parse_engine_args(
    spec: ModelSpec, model_path: Path, additional_config: dict | None = None,
    placement: EnginePlacement | None = None,
) -> Any:
    """vLLM's parse of the engine's `vllm serve` arguments (engine_cli_args), checked as
    `vllm serve` checks them; ValueError (EngineFlagError) naming the model and the flag."""
    from vllm.entrypoints.launchers.cli_args import validate_parsed_serve_args

    # Its own errors (an unknown extra_engine_args name) already name the model.
    argv = engine_cli_args(spec, model_path, additional_config, placement)
    try:
        args = parse_serve_args(argv)
        validate_parsed_serve_args(args)
    except (EngineFlagError, TypeError, ValueError) as exc:
        raise EngineFlagError(f"model {spec.name!r}: vLLM refuses its engine arguments: "
                              f"{exc}") from exc
    return args


def listening_socket(host: str, port: int) -> socket.socket:
    """The gateway's TCP socket, bound before any engine starts, as vLLM's own server binds
    its socket before building its engine (its api_server entry's setup_server): a port
    taken meanwhile by another process (an engine's, another server's) would otherwise
    fail the start-up only once every engine is up. Not listening yet: a client that
    connects before the engines are ready is refused, as if nothing served there."""
    import errno

    from vllm.entrypoints.launchers.launcher import create_server_socket

    try:
        return create_server_socket((host, port), reuse_port=False)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise ValueError(f"port {port} on {host} is in use by another process; stop it "
                             "or serve on another --port") from None
        if exc.errno == errno.EADDRNOTAVAIL:
            raise ValueError(f"--host {host} is not an address of this machine") from None
        raise


@contextlib.contextmanager
def _engine_environment(env: dict[str, str]):
    """Environment that the engine's processes (spawned while this is active) inherit."""
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _engine_process_ids(client: Any) -> list[int]:
    # AsyncLLM → AsyncMPClient → resources.engine_manager (CoreEngineProcManager).
    core = getattr(client, "engine_core", None)
    manager = getattr(getattr(core, "resources", None), "engine_manager", None)
    return [p.pid for p in getattr(manager, "processes", []) if p.pid is not None]


@contextlib.asynccontextmanager
async def _engine_client(args: Any, environment: dict[str, str],
                         spawn_lock: asyncio.Lock | None = None):
    """vLLM's `build_async_engine_client` (entrypoints/launchers/api_server/entry.py), with
    the engine built in a thread: `AsyncLLM.from_vllm_config` blocks until the EngineCore
    has started (seconds), and the gateway's event loop keeps serving the other models
    meanwhile, also when an engine is restarted. AsyncLLM starts its output handler on
    the first request when it was built outside a running loop.

    The engine's processes inherit `environment` (cpu_cores, visible GPUs, where its socket
    files go; the front end names its own before the spawn, in the build): it is set in
    this process from the engine's configuration until its EngineCore has been spawned
    (which copies the environment; the worker inherits the EngineCore's), under
    `spawn_lock`, so that engines started together each spawn with their own, and the
    rest of their start-up (imports, weights, KV cache: most of it) runs side by side."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import propagate_flash_late_interaction
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    prometheus_logger_lock.install()  # engines built side by side register metrics in turn
    build: asyncio.Future | None = None
    try:
        async with spawn_lock if spawn_lock is not None else contextlib.nullcontext():
            with _engine_environment(environment):
                engine_args = AsyncEngineArgs.from_cli_args(args)
                propagate_flash_late_interaction(args, engine_args)
                usage_context = UsageContext.OPENAI_API_SERVER
                vllm_config = engine_args.create_engine_config(usage_context=usage_context)
                spawned_before = _spawned_children()
                build = asyncio.ensure_future(_in_a_thread_of_its_own(
                    AsyncLLM.from_vllm_config, vllm_config=vllm_config,
                    usage_context=usage_context,
                    enable_log_requests=engine_args.enable_log_requests,
                    aggregate_engine_logging=engine_args.aggregate_engine_logging,
                    disable_log_stats=engine_args.disable_log_stats))
                await _until_spawned(build, spawned_before)
        client = await asyncio.shield(build)
    except asyncio.CancelledError:
        # A thread cannot be interrupted: a start cancelled half-way (the server stopping
        # while an engine restarts, or another engine's start failing) lets the engine
        # come up and shuts it down, so that no EngineCore outlives it; past the wait,
        # the gateway's last reaping kills it.
        if build is not None:
            with contextlib.suppress(Exception):
                orphan = await asyncio.wait_for(build, ORPHANED_BUILD_WAIT_S)
                orphan.shutdown(timeout=ENGINE_TEARDOWN_GRACE_S)
        raise
    try:
        await client.reset_mm_cache()
        yield client
    finally:
        # On the loop, as vLLM does: from a thread, the output handler would see the
        # EngineCore exit and log it as an engine death. A dead engine's shutdown is quick.
        client.shutdown(timeout=vllm_config.shutdown_timeout)


def _in_a_thread_of_its_own(func: Any, /, **kwargs: Any) -> asyncio.Future:
    """`func(**kwargs)` in a thread started for it. Not asyncio.to_thread: the loop's default
    executor has min(32, cores + 4) threads, 6 on a 2-core machine, so a seventh engine
    started together waited for one of the first six to be up before its build could begin
    (tests/weaving/test_weaving_e2e.py's seventh engine spawned its EngineCore 2-3 minutes
    after the others, and was ready ~50 s after them)."""
    executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine-build")
    try:
        call = functools.partial(contextvars.copy_context().run, func, **kwargs)
        return asyncio.get_running_loop().run_in_executor(executor, call)
    finally:
        executor.shutdown(wait=False)  # its thread ends when the build returns


def _fail_pending_requests(name: str, client: Any) -> None:
    """End every request still waiting on the engine with vLLM's EngineDeadError, as its
    output handler does when it reads the EngineCore's death. The supervisor may close a
    dead engine first (its monitor marks the client dead before the handler reads that),
    and the shutdown cancels the handler: a stream on the engine then waited forever
    instead of being run again (a phase-split decode stream, seen in the suite under load)."""
    from vllm.v1.engine.exceptions import EngineDeadError

    pending = client.output_processor.get_num_unfinished_requests()
    if pending:
        logger.warning("engine %s closes with %d request(s) unfinished; ending them with "
                       "an engine-dead error", name, pending)
        client.output_processor.propagate_error(EngineDeadError())


def _spawned_children() -> set[int]:
    """This process's children that are known to hold their own copy of the environment:
    started by multiprocessing's spawn (the cmdline names spawn_main once the child has
    exec'd) or titled by vLLM (VLLM::EngineCore, set after a fork or a spawn). Not the
    resource tracker, which the first spawn starts just before the EngineCore."""
    import psutil

    spawned = set()
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.Error):
            cmdline = child.cmdline()
            if any("spawn_main" in part for part in cmdline) or \
                    cmdline and cmdline[0].startswith("VLLM::"):
                spawned.add(child.pid)
    return spawned


async def _until_spawned(build: asyncio.Future, spawned_before: set[int]) -> None:
    """Until the build has started a process of its own (see _spawned_children), or has
    ended (failed, or built in-process): only then may the environment change."""
    while not build.done() and not _spawned_children() - spawned_before:
        await asyncio.sleep(SPAWN_POLL_S)


async def open_engine(
    spec: ModelSpec,
    model_path: Path,
    stack: contextlib.AsyncExitStack,
    additional_config: dict | None = None,
    placement: EnginePlacement | None = None,
    spawn_lock: asyncio.Lock | None = None,
) -> EngineHandle:
    """Start the engine for `spec` (placed as `placement` says; a cpu engine when None);
    it is shut down when `stack` closes. Engines started at once share a `spawn_lock`
    (see _engine_client)."""
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.app import build_app

    placement = placement or EnginePlacement.on_cpu(spec)
    args = parse_engine_args(spec, model_path, additional_config, placement)
    cores = usable_cpu_cores(f"model {spec.name!r}", spec.cpu_cores) if spec.cpu_cores else None
    logger.info("starting engine %s from %s on %s %s", spec.name, model_path, spec.device,
                placement.environment)
    # The stack unwinds last-in first-out: first our shutdown (vLLM's own in the context
    # below then finds the engine processes stopped), then what an engine that could not
    # tear down (killed, crashed) left is removed, and what any engine leaves
    # (weaver/vllm_ext/engine/leftovers.py).
    stack.callback(release_closed_engine_memory)  # last: once the rest let go
    stack.callback(forget_closed_engine_callables)
    rpc_dir = make_rpc_dir()
    stack.callback(remove_rpc_dir, rpc_dir)
    client = await stack.enter_async_context(_engine_client(
        args, {**placement.environment, RPC_BASE_PATH_ENV: str(rpc_dir),
               GATEWAY_PID_ENV: str(os.getpid())}, spawn_lock))
    process_ids = _engine_process_ids(client)
    if cores is not None:
        pin_engine_processes(spec.name, process_ids, cores)
    # What its EngineCore lists there once up (leftovers.record_engine_shm).
    stack.callback(remove_left_over_shm, spec.name, rpc_dir)
    stack.callback(client.shutdown, timeout=ENGINE_TEARDOWN_GRACE_S)
    stack.callback(_fail_pending_requests, spec.name, client)  # before the shutdown
    supported_tasks = await client.get_supported_tasks()
    app = build_app(args, supported_tasks, client.model_config)
    await init_app_state(client, app.state, args, supported_tasks)
    # vLLM's handler of engine errors stops its own uvicorn through app.state.server
    # (entrypoints/serve/exception_handling/handlers/vllm_error.py); under the gateway no
    # engine may stop the server (its supervisor restarts the engine instead), so the
    # handler gets a flag nobody reads.
    app.state.server = SimpleNamespace(should_exit=False)
    handle = EngineHandle(
        spec=spec,
        client=client,
        app=app,
        max_model_len=client.model_config.max_model_len,
        model_path=model_path,
        process_ids=process_ids,
        stats=attach_stats_recorder(client),
    )
    logger.info("engine %s ready (engine processes %s)", spec.name, handle.process_ids)
    return handle
