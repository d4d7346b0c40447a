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
from weaver.server.gateway import Gateway, GatewayConfig
from weaver.server.metrics import GatewayMetrics

logger = logging.getLogger(__name__)

CHILD_EXIT_GRACE_S = 10.0


@dataclass
class ServeSettings:
    deployment: Deployment
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: tuple[str, ...] = ()
    models_dir: Path | None = None
    log_level: str = "info"
    # Resolves a deployment's `model` field to a directory; the registry's by default.
    resolve_model: Callable[[str, Path | None], Path] | None = field(default=None, repr=False)


def _default_resolver(name: str, models_dir: Path | None) -> Path:
    from weaver.models.registry import resolve_model

    return resolve_model(name, models_dir)


async def _start_engine(spec: ModelSpec, model_path: Path, stack: contextlib.AsyncExitStack):
    from weaver.vllm_ext.engine_app import open_engine

    return await open_engine(spec, model_path, stack)


async def start_engines(settings: ServeSettings, stack: contextlib.AsyncExitStack) -> dict:
    """Start every engine of the deployment; all are closed by `stack`, also on failure."""
    resolve = settings.resolve_model or _default_resolver
    paths = {
        spec.name: resolve(spec.model, settings.models_dir) for spec in settings.deployment.models
    }
    engine_stacks = [contextlib.AsyncExitStack() for _ in settings.deployment.models]
    for engine_stack in engine_stacks:
        stack.push_async_callback(engine_stack.aclose)
    started = time.monotonic()
    handles = await asyncio.gather(
        *(
            _start_engine(spec, paths[spec.name], engine_stack)
            for spec, engine_stack in zip(settings.deployment.models, engine_stacks, strict=False)
        )
    )
    logger.info("%d engines ready in %.1f s", len(handles), time.monotonic() - started)
    return {handle.spec.name: handle for handle in handles}


async def run_server(settings: ServeSettings) -> None:
    import uvicorn

    async with contextlib.AsyncExitStack() as stack:
        backends = await start_engines(settings, stack)
        _hand_signals_to_uvicorn()
        gateway = Gateway(
            backends,
            GatewayConfig(api_keys=settings.api_keys, created_at=int(time.time())),
            GatewayMetrics(),
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
        print(
            f"Weaver serves {len(backends)} model(s) {sorted(backends)} on "
            f"http://{settings.host}:{settings.port}/v1",
            flush=True,
        )
        await server.serve()
        logger.info("HTTP server stopped; shutting down %d engines", len(backends))


def _hand_signals_to_uvicorn() -> None:
    # From here on uvicorn's own handlers stop the server gracefully; ours would cancel
    # the task and cut the engines' shutdown short.
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.remove_signal_handler(sig)


def serve(settings: ServeSettings) -> int:
    """Run until SIGINT/SIGTERM; return the process exit code."""
    try:
        asyncio.run(_run_with_signals(settings))
    except KeyboardInterrupt:
        logger.info("interrupted during start-up")
    finally:
        reap_children()
    return 0


async def _run_with_signals(settings: ServeSettings) -> None:
    # uvicorn installs its own handlers while it serves; before that (engines starting)
    # a signal cancels start-up so that the exit stack shuts the engines down.
    loop = asyncio.get_running_loop()
    main_task = asyncio.current_task()
    assert main_task is not None
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, main_task.cancel)
    try:
        await run_server(settings)
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
