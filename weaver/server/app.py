"""`weaver serve`: start one vLLM engine per model, then serve them all on one port.

Lifecycle: engines start first (concurrently), the HTTP server binds only when every
engine is ready, and on SIGINT/SIGTERM the server stops accepting, every engine is shut
down through vLLM's own shutdown path, and any child process still alive after that is
terminated, so nothing is left orphaned.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from weaver.config.deployment import Deployment, ModelSpec
from weaver.config.devices import EnginePlacement, place_engines
from weaver.server.gateway import Gateway, GatewayConfig
from weaver.server.metrics import GatewayMetrics
from weaver.server.weaving import (
    WeavingMetrics,
    WeavingSupervisor,
    additional_configs,
    remove_leftover_regions,
    weaving_plans,
)

logger = logging.getLogger(__name__)

CHILD_EXIT_GRACE_S = 10.0
STATS_LOG_INTERVAL_S = 10.0


@dataclass
class ServeSettings:
    deployment: Deployment
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: tuple[str, ...] = ()
    models_dir: Path | None = None
    log_level: str = "info"
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    # Resolves a deployment's `model` field to a directory; the registry's by default.
    resolve_model: Callable[[str, Path | None], Path] | None = field(default=None, repr=False)


def _default_resolver(name: str, models_dir: Path | None) -> Path:
    from weaver.models.registry import resolve_model

    return resolve_model(name, models_dir)


async def _start_engine(spec: ModelSpec, model_path: Path, stack: contextlib.AsyncExitStack,
                        additional_config: dict, placement: EnginePlacement):
    from weaver.vllm_ext.engine.app import open_engine

    return await open_engine(spec, model_path, stack, additional_config, placement)


@dataclass
class Engines:
    handles: dict
    weaving: WeavingSupervisor | None


@dataclass(frozen=True)
class CheckedEngines:
    """What check_engines found: each model's directory and where its engine goes."""

    paths: dict[str, Path]
    placements: dict[str, EnginePlacement]


def check_engines(settings: ServeSettings) -> CheckedEngines:
    """Each model's directory and where its engine goes, before any engine starts;
    ValueError saying the fix when a model or a device cannot be had here."""
    deployment = settings.deployment
    resolve = settings.resolve_model or _default_resolver
    paths = {spec.name: resolve(spec.model, settings.models_dir) for spec in deployment.models}
    return CheckedEngines(paths, place_engines(deployment, paths))


async def start_engines(settings: ServeSettings, checked: CheckedEngines,
                        stack: contextlib.AsyncExitStack) -> Engines:
    """Start every engine of the deployment (as check_engines placed them) and connect its
    weaving pairs; everything is closed by `stack`, also when start-up fails half-way."""
    deployment = settings.deployment
    paths, placements = checked.paths, checked.placements
    plans = weaving_plans(deployment, paths)
    configs = additional_configs(deployment, plans)
    # Registered first so it runs last: regions whose owner died are unlinked after
    # every engine has stopped.
    stack.callback(remove_leftover_regions, plans)
    engine_stacks = [contextlib.AsyncExitStack() for _ in deployment.models]
    for engine_stack in engine_stacks:
        stack.push_async_callback(engine_stack.aclose)
    started = time.monotonic()
    # One after another: vLLM builds an engine synchronously anyway, and each engine's
    # processes inherit the environment set for it alone (cpu_cores, visible GPUs).
    handles = [
        await _start_engine(spec, paths[spec.name], engine_stack, configs[spec.name],
                            placements[spec.name])
        for spec, engine_stack in zip(deployment.models, engine_stacks, strict=True)
    ]
    engines = {handle.spec.name: handle for handle in handles}
    logger.info("%d engines ready in %.1f s", len(handles), time.monotonic() - started)
    supervisor = None
    if plans:
        supervisor = WeavingSupervisor(plans, engines, WeavingMetrics(settings.metrics.registry))
        stack.push_async_callback(supervisor.close)
        await supervisor.connect()
    return Engines(engines, supervisor)


async def run_server(settings: ServeSettings, checked: CheckedEngines) -> None:
    import uvicorn

    async with contextlib.AsyncExitStack() as stack:
        engines = await start_engines(settings, checked, stack)
        backends = engines.handles
        _hand_signals_to_uvicorn()
        weaving = engines.weaving
        gateway = Gateway(
            backends,
            GatewayConfig(api_keys=settings.api_keys, created_at=int(time.time())),
            settings.metrics,
            extra_health=weaving.health if weaving else None,
            before_metrics=weaving.refresh if weaving else None,
        )
        config = uvicorn.Config(
            gateway,
            host=settings.host,
            port=settings.port,
            log_level=settings.log_level,
            access_log=False,
            lifespan="on",
        )
        server = uvicorn.Server(config)
        stats_task = asyncio.create_task(_log_stats_periodically(backends))
        stack.callback(stats_task.cancel)
        print(
            f"Weaver serves {len(backends)} model(s) {sorted(backends)} on "
            f"http://{settings.host}:{settings.port}/v1",
            flush=True,
        )
        await server.serve()
        logger.info("HTTP server stopped; shutting down %d engines", len(backends))


async def _log_stats_periodically(backends: dict, interval_s: float = STATS_LOG_INTERVAL_S):
    # What vLLM's own server lifespan does per engine (its throughput/KV log lines); the
    # engines' apps run under the gateway, so their lifespans do not.
    while True:
        await asyncio.sleep(interval_s)
        for backend in backends.values():
            if not backend.is_dead:
                await backend.client.do_log_stats()


def _hand_signals_to_uvicorn() -> None:
    # From here on uvicorn's own handlers stop the server gracefully; ours would cancel
    # the task and cut the engines' shutdown short. uvicorn restores the handler it found
    # and re-raises the signal once it has stopped, so the handler left in place only
    # notes it: the engines are being shut down already.
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.remove_signal_handler(sig)
        signal.signal(sig, _note_signal_during_shutdown)


def _note_signal_during_shutdown(signum: int, _frame: object) -> None:
    logger.info("%s received; shutting down the engines", signal.Signals(signum).name)


def serve(settings: ServeSettings, checked: CheckedEngines) -> int:
    """Run the engines check_engines placed until SIGINT/SIGTERM; return the process exit
    code."""
    try:
        asyncio.run(_run_with_signals(settings, checked))
    except KeyboardInterrupt:
        logger.info("interrupted during start-up")
    finally:
        reap_children()
    return 0


async def _run_with_signals(settings: ServeSettings, checked: CheckedEngines) -> None:
    # uvicorn installs its own handlers while it serves; before that (engines starting)
    # a signal cancels start-up so that the exit stack shuts the engines down.
    loop = asyncio.get_running_loop()
    main_task = asyncio.current_task()
    assert main_task is not None
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, main_task.cancel)
    try:
        await run_server(settings, checked)
    except asyncio.CancelledError:
        logger.info("start-up cancelled by a signal; engines shut down")


def reap_children(grace_s: float = CHILD_EXIT_GRACE_S) -> None:
    """Terminate any child process still alive (last line of defence against orphans)."""
    import psutil

    children = psutil.Process().children(recursive=True)
    if not children:
        return
    logger.warning("terminating %d leftover child process(es): %s",
                   len(children), [c.pid for c in children])
    for child in children:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.terminate()
    _, alive = psutil.wait_procs(children, timeout=grace_s)
    for child in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
