"""Weaver on a Ray cluster: one Ray Serve deployment per group, one ingress in front.

A group's replica is a Ray Serve replica placed with a STRICT_PACK placement group of the
group's resources (one node), that runs the group's deployment file with `weaver serve`
on that node: the very launcher, engines and weaving a single machine uses, nothing
re-implemented. Its `check_health` asks that server's /health, so Ray Serve restarts a
replica whose server died (and routes nothing to it meanwhile). The ingress routes by the
request's `model` to a group that serves it (the one with the fewest requests in flight
from this ingress), streams the answer back through Ray, and lists every model in
/v1/models; Ray Serve spreads a group's requests over its replicas.

Imported only by `weaver cluster` (Ray is an optional extra, `pip install -e '.[ray]'`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
from ray import serve
from ray.serve.handle import DeploymentHandle

from weaver.cluster.routing import ModelRouter, openai_error

STARTUP_TIMEOUT_S = 900.0  # engines load and warm up before /health answers
HEALTH_PERIOD_S = 10.0
HEALTH_TIMEOUT_S = 30.0
# Headers that describe one hop's transfer, not the answer: the proxy sets its own.
HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "keep-alive"}


class NodeGroup:
    """One replica of a group: `weaver serve` of the group's deployment on this node."""

    def __init__(self, group: str, deployment_text: str) -> None:
        self.group = group
        self._dir = tempfile.TemporaryDirectory(prefix=f"weaver-{group}-")
        path = Path(self._dir.name) / "deployment.yaml"
        path.write_text(deployment_text)
        # The node's own address: on a real cluster the ingress may run on another node.
        self.host = _node_ip()
        self.port = _free_port(self.host)
        self.url = f"http://{self.host}:{self.port}"
        log = open(Path(self._dir.name) / "serve.log", "wb")  # noqa: SIM115 (kept open)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "weaver.cli.main", "serve", str(path), "--host", self.host,
             "--port", str(self.port)],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0))
        self._wait_until_up()

    def _wait_until_up(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"group {self.group}: weaver serve exited with "
                                   f"{self._proc.returncode}; its log: {self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=5.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        self._stop()
        raise RuntimeError(f"group {self.group}: no /health within {STARTUP_TIMEOUT_S:.0f} s; "
                           f"its log: {self.log_tail()}")

    def log_tail(self, num_bytes: int = 2000) -> str:
        path = Path(self._dir.name) / "serve.log"
        return path.read_bytes()[-num_bytes:].decode(errors="replace") if path.exists() else ""

    async def check_health(self) -> None:
        """Ray Serve calls this every HEALTH_PERIOD_S; raising makes it restart the replica.

        Raises when the group's server is gone, does not answer, or has given an engine up
        (status "dead": its restart policy is spent). An engine that `weaver serve` is
        restarting itself ("restarting", "unhealthy") is left to it: restarting the
        whole group would only take its other engines down too."""
        if self._proc.poll() is not None:
            self._stop()  # its engines, if it left any (they share its session)
            raise RuntimeError(f"group {self.group}: weaver serve (pid {self._proc.pid}) "
                               f"exited with {self._proc.returncode}")
        response = await self._client.get(f"{self.url}/health", timeout=HEALTH_TIMEOUT_S / 2)
        if response.status_code == 200:
            return
        models = response.json().get("models", {}) if response.content else {}
        dead = sorted(name for name, m in models.items() if m.get("status") == "dead")
        if dead or not models:
            raise RuntimeError(f"group {self.group}: /health answered {response.status_code}"
                               f" (given up: {dead})")

    def server_pid(self) -> int:
        """The pid of this replica's `weaver serve` (tests kill it)."""
        return self._proc.pid

    async def proxy(self, method: str, path: str, headers: dict[str, str],
                    body: bytes) -> AsyncIterator[bytes | dict[str, Any]]:
        """Forward one request to this node's server: first the status and headers, then
        the body's chunks as they come (a streamed completion stays streamed)."""
        request = self._client.build_request(method, f"{self.url}{path}", headers=headers,
                                             content=body)
        response = await self._client.send(request, stream=True)
        try:
            yield {"status": response.status_code,
                   "headers": {k: v for k, v in response.headers.items()
                               if k.lower() not in HOP_HEADERS}}  # fmt: skip
            async for chunk in response.aiter_raw():
                yield chunk
        finally:
            await response.aclose()

    def _stop(self) -> None:
        """Stop the group's server and whatever of its session is left (its engines)."""
        if self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGTERM)  # weaver serve drains, stops engines
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=60)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=10)

    def __del__(self) -> None:  # Ray Serve calls it when it stops the replica
        if hasattr(self, "_proc"):  # not when the constructor failed before the launch
            self._stop()


class Ingress:
    """The one endpoint: routes by `model`, streams, lists the cluster's models."""

    def __init__(self, groups: dict[str, DeploymentHandle], models: dict[str, list[str]]) -> None:
        self._groups = groups
        self._router = ModelRouter(models)

    async def __call__(self, request: Any) -> Any:
        from starlette.responses import JSONResponse, StreamingResponse

        path = request.url.path
        if request.method == "GET" and path == "/v1/models":
            return JSONResponse(self._router.models_listing())
        if request.method == "GET" and path == "/health":
            return JSONResponse({"status": "ok", "models": self._router.model_names})
        body = await request.body()
        try:
            model = json.loads(body).get("model") if body else None
        except (json.JSONDecodeError, AttributeError):
            model = None
        candidates = self._router.candidates(model)
        if not candidates:
            status, payload = openai_error(model, self._router.model_names)
            return JSONResponse(payload, status_code=status)
        headers = {k: v for k, v in request.headers.items()
                   if k.lower() not in HOP_HEADERS | {"host"}}  # fmt: skip
        target = path + (f"?{request.url.query}" if request.url.query else "")
        failures = []
        for group in candidates:  # the next group serving the model if one fails
            stream = self._groups[group].options(stream=True).proxy.remote(
                request.method, target, headers, body)
            self._router.started(group)
            try:
                head = await stream.__anext__()
                break
            except Exception as exc:  # no live replica, or the call broke
                self._router.finished(group)
                failures.append(f"{group}: {type(exc).__name__}: {exc}")
        else:
            return JSONResponse({"error": {
                "message": f"model {model!r}: no group answered ({'; '.join(failures)})",
                "type": "ServiceUnavailableError", "code": 503}}, status_code=503,
                headers={"retry-after": "5"})  # fmt: skip

        async def body_chunks() -> AsyncIterator[bytes]:
            try:
                async for chunk in stream:
                    yield chunk
            finally:
                self._router.finished(group)

        return StreamingResponse(body_chunks(), status_code=head["status"],
                                 headers=head["headers"])


def build_app(groups: dict[str, tuple[str, dict[str, float], int]],
              models: dict[str, list[str]]) -> Any:
    """The Ray Serve application: groups maps a group name to (its deployment file's text,
    the resources of one replica, its replicas); models maps a model to its groups."""
    handles = {}
    for name, (text, resources, replicas) in groups.items():
        # The replica actor itself lives in the first (only) bundle and takes all of it.
        actor = {"num_cpus": resources.get("CPU", 0), "num_gpus": resources.get("GPU", 0)}
        deployment = serve.deployment(
            NodeGroup, name=name, num_replicas=replicas, ray_actor_options=actor,
            placement_group_bundles=[dict(resources)], placement_group_strategy="STRICT_PACK",
            health_check_period_s=HEALTH_PERIOD_S, health_check_timeout_s=HEALTH_TIMEOUT_S,
            graceful_shutdown_timeout_s=90, max_ongoing_requests=1024)  # fmt: skip
        handles[name] = deployment.bind(name, text)
    ingress = serve.deployment(Ingress, name="ingress", ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=4096)  # fmt: skip
    return ingress.bind(handles, models)


def _node_ip() -> str:
    import ray.util

    return ray.util.get_node_ip_address()


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
