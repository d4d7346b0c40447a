"""`weaver serve`: start one vLLM engine per model, then serve them all on one port.

Lifecycle: engines start first (one at a time), the HTTP server binds only when every
engine is ready, and each engine is then watched and restarted when it dies or hangs
(weaver.server.supervisor). On SIGINT/SIGTERM the server drains (new requests get 503, those
in flight get the deployment's serving.drain_grace_s, the rest are aborted with an error),
every engine is shut down through vLLM's own shutdown path, and any child process still
alive after that is terminated, so nothing is left orphaned.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

import uvicorn

from weaver.config.deployment import Deployment, ModelSpec
from weaver.config.devices import EnginePlacement, place_engines
from weaver.kv.pool_plan import PoolPlan
from weaver.processes import is_resource_tracker
from weaver.server.features import (
    ServeFeature,
    engine_configs,
    features_health,
    refresh_features,
    serve_features,
)
from weaver.server.gateway import Gateway, GatewayConfig, ModelLimits
from weaver.server.inflight import Aborted
from weaver.server.metrics import GatewayMetrics
from weaver.server.mux_pool import plan_mux_pools
from weaver.server.phase_split import phase_split_backends
from weaver.server.supervisor import SupervisedEngine

logger = logging.getLogger(__name__)

CHILD_EXIT_GRACE_S = 10.0
STATS_LOG_INTERVAL_S = 10.0
# How long an idle client connection stays open. Longer than the official openai client's
# and httpx's own keep-alive (5 s, openai._base_client.DEFAULT_CONNECTION_LIMITS), so that the
# client, not the gateway, closes an idle connection: at uvicorn's default, also 5 s, a request
# sent on a connection the gateway closes that moment fails with "Server disconnected without
# sending a response" before it reaches the gateway (seen in the weaving e2e suite).
IDLE_CONNECTION_S = 75


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
                        additional_config: dict, placement: EnginePlacement,
                        spawn_lock: asyncio.Lock):
    from weaver.vllm_ext.engine.app import open_engine

    return await open_engine(spec, model_path, stack, additional_config, placement,
                             spawn_lock)


@dataclass
class Engines:
    handles: dict[str, SupervisedEngine]
    features: list[ServeFeature]


@dataclass(frozen=True)
class CheckedEngines:
    """What check_engines found: each model's directory, where its engine goes, and the
    unified KV pool of each colocated group that keeps one (group -> plan)."""

    paths: dict[str, Path]
    placements: dict[str, EnginePlacement]
    mux_pools: dict[str, PoolPlan] = field(default_factory=dict)


def check_engines(settings: ServeSettings) -> CheckedEngines:
    """Each model's directory and where its engine goes, before any engine starts;
    ValueError saying the fix when a model or a device cannot be had here."""
    deployment = settings.deployment
    resolve = settings.resolve_model or _default_resolver
    paths = {spec.name: resolve(spec.model, settings.models_dir) for spec in deployment.models}
    # A group whose models cannot share pages says why here, before any engine starts.
    checked = CheckedEngines(paths, place_engines(deployment, paths),
                             plan_mux_pools(deployment, paths))
    check_engine_flags(deployment, checked)
    return checked


def check_engine_flags(deployment: Deployment, checked: CheckedEngines) -> None:
    """Every engine's `vllm serve` arguments (extra_engine_args and vllm_flags included)
    through vLLM's own parser; ValueError naming the model and the flag it refuses."""
    from weaver.vllm_ext.engine.app import parse_engine_args

    for spec in deployment.models:
        parse_engine_args(spec, checked.paths[spec.name], None, checked.placements[spec.name])


async def start_engines(settings: ServeSettings, checked: CheckedEngines,
                        stack: contextlib.AsyncExitStack) -> Engines:
    """Start every engine of the deployment (as check_engines placed them) with what its
    features write for it, let each feature set up before and link after (weaving pairs),
    then watch each engine (restarted when it dies or hangs: the deployment's
    serving.restart); everything is closed by `stack`, also when start-up fails
    half-way."""
    from weaver.vllm_ext.engine.leftovers import (
        reclaim_dead_owners_rpc_dirs,
        reclaim_dead_owners_shm,
    )

    deployment = settings.deployment
    paths, placements = checked.paths, checked.placements
    reclaim_dead_owners_rpc_dirs()  # what a SIGKILLed server's engines left
    reclaim_dead_owners_shm()  # and the files it and its cold workers named after their pid
    features = serve_features(deployment, paths, checked.mux_pools)
    configs = engine_configs(deployment, features)
    # Set up first, so that what each feature reclaims runs after every engine stopped.
    for feature in features:
        feature.set_up(stack, settings.metrics.registry)
    # The engines start together; one spawns its processes at a time, which inherit the
    # environment set for it alone (cpu_cores, visible GPUs), also when one restarts
    # while another does.
    spawn_lock = asyncio.Lock()

    def opener(spec: ModelSpec) -> Callable:
        async def open_one(engine_stack: contextlib.AsyncExitStack):
            for feature in features:
                feature.before_engine_start(spec.name)
            return await _start_engine(spec, paths[spec.name], engine_stack,
                                       configs[spec.name], placements[spec.name], spawn_lock)
        return open_one

    def count_restart(model: str, reason: str) -> None:
        settings.metrics.engine_restarts.labels(model=model).inc()

    policy = deployment.serving.restart
    engines = {spec.name: SupervisedEngine(spec.name, opener(spec), policy,
                                           on_restart=count_restart)
               for spec in deployment.models}
    started = time.monotonic()
    for engine in engines.values():
        stack.push_async_callback(engine.close)
    await _start_together(list(engines.values()))
    logger.info("%d engines ready in %.1f s", len(engines), time.monotonic() - started)
    for feature in features:
        await feature.after_start(engines, stack)
    # Registered last so it runs first: no restart may begin while the server shuts down.
    stack.push_async_callback(_stop_watching, engines)
    for engine in engines.values():
        engine.watch()
    return Engines(engines, features)


async def _start_together(engines: list[SupervisedEngine]) -> None:
    """Start the engines side by side (most of a start is each engine's own processes
    importing and loading); the first failure cancels the other starts (each then shuts
    its engine down) and is raised as it is."""
    starts = [asyncio.ensure_future(engine.start()) for engine in engines]
    try:
        await asyncio.gather(*starts)
    except BaseException:
        for start in starts:
            start.cancel()
        await asyncio.gather(*starts, return_exceptions=True)
        raise


async def _stop_watching(engines: dict[str, SupervisedEngine]) -> None:
    await asyncio.gather(*(engine.stop_watching() for engine in engines.values()))


def gateway_config(settings: ServeSettings) -> GatewayConfig:
    """The gateway's bounds, from the deployment's serving block and each model's limits."""
    serving = settings.deployment.serving
    deployment = settings.deployment
    limits = {spec.name: ModelLimits(spec.max_num_seqs + spec.max_waiting_requests,
                                     spec.timeout_s)
              for spec in deployment.models}
    for split in deployment.phase_split:
        # A request spends most of its life in a token engine's batch.
        tokens = [deployment.model(name) for name in split.decode]
        timeouts = [spec.timeout_s for spec in tokens]
        limits[split.model] = ModelLimits(
            sum(spec.max_num_seqs + spec.max_waiting_requests for spec in tokens),
            None if None in timeouts else max(t for t in timeouts if t is not None))
    return GatewayConfig(api_keys=settings.api_keys, created_at=int(time.time()),
                         limits=limits, max_body_bytes=serving.max_body_bytes,
                         retry_after_s=serving.retry_after_s,
                         open_status_routes=serving.open_status_routes)


async def run_server(settings: ServeSettings, checked: CheckedEngines,
                     listener: socket.socket) -> None:
    async with contextlib.AsyncExitStack() as stack:
        engines = await start_engines(settings, checked, stack)
        backends = engines.handles
        _hand_signals_to_uvicorn()
        features = engines.features
        gateway = Gateway(
            gateway_backends(settings, backends),
            gateway_config(settings),
            settings.metrics,
            extra_health=lambda: features_health(features),
            before_metrics=lambda: refresh_features(features),
        )
        config = uvicorn.Config(
            gateway,
            host=settings.host,
            port=settings.port,
            log_level=settings.log_level,
            access_log=False,
            lifespan="on",
            timeout_keep_alive=IDLE_CONNECTION_S,
        )
        server = DrainingServer(config, gateway, settings.deployment.serving.drain_grace_s,
                                stop_restarts=lambda: _stop_watching(backends))
        stats_task = asyncio.create_task(_log_stats_periodically(backends))
        stack.callback(stats_task.cancel)
        print(
            f"Weaver serves {len(gateway.backends)} model(s) {sorted(gateway.backends)} on "
            f"http://{settings.host}:{settings.port}/v1",
            flush=True,
        )
        await server.serve(sockets=[listener])
        logger.info("HTTP server stopped; shutting down %d engines", len(backends))


def gateway_backends(settings: ServeSettings, engines: dict) -> dict:
    """What the gateway routes to, by API model name: each engine, but a phase split's
    engines only through the model they serve together (weaver/server/phase_split.py)."""
    deployment = settings.deployment
    splits = phase_split_backends(deployment.phase_split, engines, settings.metrics.registry,
                                  deployment.serving.retry_after_s)
    members = {name for split in deployment.phase_split for name in split.engines}
    return {**{n: e for n, e in engines.items() if n not in members}, **splits}


async def _log_stats_periodically(backends: dict, interval_s: float = STATS_LOG_INTERVAL_S):
    # What vLLM's own server lifespan does per engine (its throughput/KV log lines); the
    # engines' apps run under the gateway, so their lifespans do not.
    while True:
        await asyncio.sleep(interval_s)
        for backend in backends.values():
            if not backend.is_dead:
                await backend.client.do_log_stats()


class DrainingServer(uvicorn.Server):
    """uvicorn, with a graceful drain on the first SIGINT/SIGTERM: the listener stays open
    and new requests get 503 with Retry-After, requests in flight get the grace period to
    finish and are then aborted with a clean error; only then does uvicorn stop. A second
    signal aborts what is in flight and stops at once."""

    def __init__(self, config: uvicorn.Config, gateway: Gateway, grace_s: float,
                 stop_restarts: Callable[[], Awaitable[None]]) -> None:
        super().__init__(config)
        self.gateway = gateway
        self.grace_s = grace_s
        self.stop_restarts = stop_restarts
        self._loop = asyncio.get_running_loop()
        self._is_draining = False
        self._drain: asyncio.Task | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A signal handler: it runs between two bytecodes of the loop's thread, so the
        # drain is handed to the loop rather than started here.
        if not self._is_draining and not self.should_exit:
            self._is_draining = True
            logger.info("%s received: draining (grace %.0f s); send it again to stop at once",
                        signal.Signals(sig).name, self.grace_s)
            self._loop.call_soon_threadsafe(self._start_drain)
            return
        self.gateway.in_flight.abort_all(Aborted(503, "the server was stopped at once"))
        super().handle_exit(sig, frame)

    def _start_drain(self) -> None:
        self._drain = asyncio.create_task(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            await self.stop_restarts()
            await self.gateway.drain(self.grace_s)
        finally:
            self.should_exit = True


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


def serve(settings: ServeSettings, checked: CheckedEngines, listener: socket.socket) -> int:
    """Run the engines check_engines placed until SIGINT/SIGTERM, answering on `listener`
    (bound, not yet listening); return the process exit code."""
    try:
        asyncio.run(_run_with_signals(settings, checked, listener))
    except KeyboardInterrupt:
        logger.info("interrupted during start-up")
    finally:
        listener.close()
        reap_children()
    return 0


async def _run_with_signals(settings: ServeSettings, checked: CheckedEngines,
                            listener: socket.socket) -> None:
    # uvicorn installs its own handlers while it serves; before that (engines starting)
    # a signal cancels start-up so that the exit stack shuts the engines down.
    loop = asyncio.get_running_loop()
    main_task = asyncio.current_task()
    assert main_task is not None
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, main_task.cancel)
    try:
        await run_server(settings, checked, listener)
    except asyncio.CancelledError:
        logger.info("start-up cancelled by a signal; engines shut down")


def reap_children(grace_s: float = CHILD_EXIT_GRACE_S) -> None:
    """Terminate any child process still alive (last line of defence against orphans).

    Python's multiprocessing resource tracker is left alone: it ignores SIGTERM by design
    (so every shutdown sat out the whole grace), and it exits by itself when this process
    exits and closes its pipe, after unlinking what it still tracks."""
    import psutil

    children = [c for c in psutil.Process().children(recursive=True)
                if not is_resource_tracker(c.pid)]  # fmt: skip
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
