"""A phase-split model behind the gateway: Splitwise's prompt and token instances as vLLM
engines, and the router between them (docs/architecture.md part 12).

To the gateway a phase split is one more model backend. A completion or chat request goes:
1. to a prompt engine, the one with the fewest prompt tokens queued (join the shortest
   queue), as the same request cut to one output token and not streamed, with
   `kv_transfer_params` naming a staging segment: the engine's KV connector
   (weaver/vllm_ext/kv_connector.py) copies the prompt's KV there, layer by layer, as the
   prefill runs;
2. then, as the client sent it, to a token engine, the one with the least KV in use: its
   connector copies the staged KV into its cache and the engine generates the answer,
   streamed to the client as one response from vLLM's own serving code.
The gateway names the segment, reads what moved from its header and unlinks it once the
request is over (weaver/kv/staging.py), whatever became of the engines.

Failures: a prompt engine that dies under a request sends the request to another prompt
engine; a token engine that dies under one re-runs it from the prefill, on another token
engine or the same one once it is back (an answer being streamed continues past what the
client already has: the re-run's first events are held back, so a greedy or seeded answer
is exactly the uninterrupted one); with no engine of a phase left, the answer is a 503
with Retry-After. Other routes (tokenize, embeddings, responses) go to a token engine
whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
import uuid
from collections import Counter as CountOf
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from weaver.config.deployment import Deployment, PhaseSplitSpec
from weaver.kv.staging import read_report, remove_segment, remove_segments
from weaver.offload.naming import staging_prefix
from weaver.server.errors import error_body
from weaver.server.features import ServeFeature
from weaver.server.gateway import replay_body, send_json
from weaver.vllm_ext.additional_config import phase_split_section

logger = logging.getLogger(__name__)

SPLIT_PATHS = ("/v1/completions", "/v1/chat/completions")
# The `kv_transfer_params` keys of weaver/vllm_ext/kv_connector.py (not imported: the
# gateway does not load vLLM's connector base just to name them).
SAVE_KEY = "weaver_kv_save"
LOAD_KEY = "weaver_kv_load"
# A prompt's tokens before an engine has tokenized it: its UTF-8 bytes / 4, the usual
# bytes per token of English text under BPE vocabularies. Only the order of queues uses it.
BYTES_PER_TOKEN_ESTIMATE = 4
# How long a request waits for a token engine that is being restarted.
RECOVERY_WAIT_S = 300.0
RECOVERY_POLL_S = 0.5
# Most runs of one request (each after an engine died under the previous one).
MAX_RUNS = 4


def segment_prefix() -> str:
    """The staging segments of this gateway process: wvkv_<pid>_<request>."""
    return staging_prefix(os.getpid())


def remove_left_segments() -> None:
    removed = remove_segments(segment_prefix())
    if removed:
        logger.warning("removed %d KV staging segment(s) left by requests cut short",
                       len(removed))


class PhaseSplit(ServeFeature):
    """The phase splits in the serve lifecycle: each engine told the model it serves and its
    phase, and the staging segments of requests cut short reclaimed at the end. (The
    gateway's routes to them are `phase_split_backends`.)"""

    def __init__(self, deployment: Deployment) -> None:
        self.deployment = deployment

    def engine_section(self, model: str) -> dict[str, Any]:
        found = self.deployment.phase_split_of(model)
        return phase_split_section(found[0].model, found[1]) if found else {}

    def set_up(self, stack: contextlib.AsyncExitStack, registry: CollectorRegistry) -> None:
        if self.deployment.phase_split:
            stack.callback(remove_left_segments)


class PhaseSplitMetrics:
    """weaver_phase_split_* series, by model (the phase split's API name)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.routed = Counter("weaver_phase_split_routed", "Requests a phase split sent to "
                              "each engine, by phase", ["model", "engine", "phase"],
                              registry=registry)
        self.transfers = Counter("weaver_phase_split_kv_transfers", "Prompts whose KV the "
                                 "token engine took from the prompt engine", ["model"],
                                 registry=registry)
        self.transferred_tokens = Counter(
            "weaver_phase_split_kv_transferred_tokens", "Prompt tokens whose KV the token "
            "engine took instead of computing them", ["model"], registry=registry)
        self.staged_bytes = Counter("weaver_phase_split_kv_staged_bytes", "Bytes of KV the "
                                    "prompt engines staged", ["model"], registry=registry)
        self.recomputed = Counter(
            "weaver_phase_split_kv_recomputed", "Decodes that took no staged KV and computed "
            "the prompt themselves (a one-token prompt, or a segment that was not usable: "
            "the token engine's log says why)", ["model"], registry=registry)
        self.cache_hits = Counter(
            "weaver_phase_split_kv_cache_hits", "Decodes that took no staged KV because the "
            "token engine's own prefix cache held the prompt", ["model"], registry=registry)
        buckets = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)
        self.save_seconds = Histogram(
            "weaver_phase_split_kv_save_seconds", "Time a prompt engine spent copying a "
            "prompt's KV out, layer by layer inside its prefill", ["model"],
            buckets=buckets, registry=registry)
        self.load_seconds = Histogram(
            "weaver_phase_split_kv_load_seconds", "Time a token engine spent copying a "
            "prompt's KV in, before its first step of the request", ["model"],
            buckets=buckets, registry=registry)
        self.reruns = Counter("weaver_phase_split_reruns", "Requests run again because an "
                              "engine died under them, by the phase that failed",
                              ["model", "phase"], registry=registry)


class EngineGone(Exception):
    """The engine picked for a phase was closed before it could be called (it died and is
    being restarted)."""


def _app_of(engine: Any) -> Callable:
    try:
        return engine.app
    except RuntimeError as exc:  # SupervisedEngine between two engines
        raise EngineGone(str(exc)) from exc


@dataclass
class _Response:
    """An engine's answer, as ASGI messages."""

    status: int | None = None
    headers: list = field(default_factory=list)
    body: bytes = b""

    async def record(self, message: dict) -> None:
        """An ASGI `send` that keeps the answer instead of sending it."""
        if message["type"] == "http.response.start":
            self.status, self.headers = message["status"], message.get("headers", [])
        elif message["type"] == "http.response.body":
            self.body += message.get("body", b"")


class PhaseSplitModel:
    """The gateway's backend for one phase-split model (weaver.server.gateway.ModelBackend)."""

    def __init__(self, spec: PhaseSplitSpec, engines: Mapping[str, Any],
                 metrics: PhaseSplitMetrics, retry_after_s: int = 5,
                 recovery_wait_s: float = RECOVERY_WAIT_S) -> None:
        self.spec = spec
        self.prompt_engines = {name: engines[name] for name in spec.prefill}
        self.token_engines = {name: engines[name] for name in spec.decode}
        self.metrics = metrics
        self.retry_after_s = retry_after_s
        self.recovery_wait_s = recovery_wait_s
        self.queued_prompt_tokens: CountOf[str] = CountOf()  # by prompt engine
        self.decoding: CountOf[str] = CountOf()  # requests in flight, by token engine
        self.app = self._serve

    # --- what the gateway reads -----------------------------------------------------------
    @property
    def is_dead(self) -> bool:
        return (all(e.is_dead for e in self.prompt_engines.values())
                or all(e.is_dead for e in self.token_engines.values()))

    @property
    def is_recovering(self) -> bool:
        return self.is_dead and all(
            any(e.is_recovering for e in group.values()) or not all(
                e.is_dead for e in group.values())
            for group in (self.prompt_engines, self.token_engines))

    async def check_health(self) -> None:
        await asyncio.gather(*(e.check_health() for e in self._live_engines()))

    def _live_engines(self) -> list[Any]:
        return [e for e in (*self.prompt_engines.values(), *self.token_engines.values())
                if not e.is_dead]

    def scheduler_stats(self) -> dict[str, float]:
        """The token engines' batch (where a request spends most of its life) and the
        waiting requests of both phases."""
        stats = [e.scheduler_stats() for e in self.token_engines.values()]
        prompt_stats = [e.scheduler_stats() for e in self.prompt_engines.values()]
        return {
            "num_running": sum(s.get("num_running", 0) for s in stats),
            "num_waiting": sum(s.get("num_waiting", 0) for s in (*stats, *prompt_stats)),
            "kv_cache_usage": max((s.get("kv_cache_usage", 0.0) for s in stats), default=0.0),
            "peak_running": sum(s.get("peak_running", 0) for s in stats),
        }

    def describe(self) -> dict[str, Any]:
        """The model, and each engine as the gateway describes a model's engine, with its
        status (ok, restarting, dead)."""
        def engine(backend: Any) -> dict[str, Any]:
            status = "ok" if not backend.is_dead else (
                "restarting" if backend.is_recovering else "dead")
            return {"status": status, **backend.describe()}

        prefill = {n: engine(e) for n, e in self.prompt_engines.items()}
        decode = {n: engine(e) for n, e in self.token_engines.items()}
        known = next((d for d in (*decode.values(), *prefill.values()) if "model_path" in d), {})
        return {"role": "phase_split", "device": "cpu", "model_path": known.get("model_path"),
                "max_model_len": known.get("max_model_len"), "prefill": prefill,
                "decode": decode}

    # --- routing --------------------------------------------------------------------------
    def _pick_prompt_engine(self, exclude: set[str]) -> str | None:
        live = [n for n, e in self.prompt_engines.items() if not e.is_dead and n not in exclude]
        return min(live, key=lambda n: (self.queued_prompt_tokens[n], n), default=None)

    def _pick_token_engine(self) -> str | None:
        live = [n for n, e in self.token_engines.items() if not e.is_dead]

        def load(name: str) -> tuple[float, int, str]:
            usage = self.token_engines[name].scheduler_stats().get("kv_cache_usage", 0.0)
            return (usage, self.decoding[name], name)

        return min(live, key=load, default=None)

    async def _wait_for_token_engine(self) -> str | None:
        """A live token engine; while none is but one is being restarted, wait for it."""
        deadline = time.monotonic() + self.recovery_wait_s
        while True:
            name = self._pick_token_engine()
            if name is not None:
                return name
            if (time.monotonic() > deadline
                    or not any(e.is_recovering for e in self.token_engines.values())):
                return None
            await asyncio.sleep(RECOVERY_POLL_S)

    async def _serve(self, scope: dict, receive: Callable, send: Callable) -> None:
        body = await _whole_body(receive)
        if scope["path"] not in SPLIT_PATHS:
            await self._forward_whole(scope, body, receive, send)
            return
        request = json.loads(body)
        relay = _ClientStream(send, bool(request.get("stream")))
        failed_prompt_engines: set[str] = set()
        for _ in range(MAX_RUNS):
            outcome = await self._run_once(scope, request, receive, relay,
                                           failed_prompt_engines)
            if outcome is None:
                return
            self.metrics.reruns.labels(model=self.spec.model, phase=outcome).inc()
        await relay.fail(503, f"engines of {self.spec.model!r} died under this request "
                         f"{MAX_RUNS} times; retry later", self.retry_after_s)

    async def _run_once(self, scope: dict, request: dict, receive: Callable,
                        relay: _ClientStream, failed_prompt_engines: set[str]) -> str | None:
        """One prefill and one decode; the phase whose engine died (run again), or None
        once the client has its answer."""
        segment = f"{segment_prefix()}{uuid.uuid4().hex[:20]}"
        is_whole = False  # the client has its answer from a token engine
        try:
            prompt = self._pick_prompt_engine(failed_prompt_engines)
            if prompt is None:
                await relay.fail(503, f"no prompt engine of {self.spec.model!r} is running; "
                                 "retry later", self.retry_after_s)
                return None
            prefilled = await self._prefill(prompt, scope, request, segment)
            engine = self.prompt_engines[prompt]
            if prefilled.status is None or (prefilled.status >= 500 and engine.is_dead):
                logger.warning("prompt engine %s of %s died under a request; sending it to "
                               "another", prompt, self.spec.model)
                failed_prompt_engines.add(prompt)
                return "prefill"
            if prefilled.status != 200:
                await relay.answer(prefilled)  # the request's own error (400, 404, ...)
                return None
            token = await self._wait_for_token_engine()
            if token is None:
                await relay.fail(503, f"no token engine of {self.spec.model!r} is running; "
                                 "retry later", self.retry_after_s)
                return None
            decode_request = {**request, "kv_transfer_params": {LOAD_KEY: segment}}
            self.metrics.routed.labels(model=self.spec.model, engine=token,
                                       phase="decode").inc()
            self.decoding[token] += 1
            try:
                is_whole = await relay.run(self.token_engines[token], scope,
                                           json.dumps(decode_request).encode(), receive)
            except EngineGone:
                is_whole = False
            finally:
                self.decoding[token] -= 1
            if not is_whole:
                logger.warning("token engine %s of %s died under a request; running it "
                               "again", token, self.spec.model)
                return "decode"
            return None
        finally:
            self._account(segment, is_whole)

    async def _prefill(self, name: str, scope: dict, request: dict,
                       segment: str) -> _Response:
        cost = _estimated_prompt_tokens(request)
        self.queued_prompt_tokens[name] += cost
        self.metrics.routed.labels(model=self.spec.model, engine=name, phase="prefill").inc()
        try:
            return await _call_buffered(self.prompt_engines[name], scope,
                                        json.dumps(prefill_request(request, segment)).encode())
        except EngineGone:
            return _Response()  # no status: the engine is down
        finally:
            self.queued_prompt_tokens[name] -= cost

    def _account(self, segment: str, is_decoded: bool) -> None:
        """Count what the segment's header says moved, then unlink it. A decode that did
        not finish (its engine died) counts its load, not what it did not load."""
        report = read_report(segment)
        remove_segment(segment)
        if report is None:
            return  # no prefill staged anything (no engine, or the request was refused)
        model = self.spec.model
        self.metrics.staged_bytes.labels(model=model).inc(report.bytes_staged)
        self.metrics.save_seconds.labels(model=model).observe(report.save_s)
        if report.num_loads == 0:
            if not is_decoded:
                return
            if report.is_recomputed:
                self.metrics.recomputed.labels(model=model).inc()
            else:
                self.metrics.cache_hits.labels(model=model).inc()
            return
        self.metrics.transfers.labels(model=model).inc()
        self.metrics.transferred_tokens.labels(model=model).inc(report.loaded_tokens)
        self.metrics.load_seconds.labels(model=model).observe(report.load_s)

    async def _forward_whole(self, scope: dict, body: bytes, receive: Callable,
                             send: Callable) -> None:
        token = self._pick_token_engine()
        if token is None:
            await _send_unavailable(send, f"no token engine of {self.spec.model!r} is "
                                    "running; retry later", self.retry_after_s)
            return
        try:
            app = _app_of(self.token_engines[token])
        except EngineGone:
            await _send_unavailable(send, f"the token engine of {self.spec.model!r} is "
                                    "restarting; retry later", self.retry_after_s)
            return
        await app(scope, replay_body(body, receive), send)


def prefill_request(request: dict, segment: str) -> dict:
    """The request as its prompt engine gets it: one token, not streamed, one choice, and
    the segment to stage its KV in."""
    cut = {key: value for key, value in request.items()
           if key not in ("stream", "stream_options", "min_tokens", "max_completion_tokens",
                          "n", "best_of")}
    cut["max_tokens"] = 1
    cut["kv_transfer_params"] = {SAVE_KEY: segment}
    return cut


def _estimated_prompt_tokens(request: dict) -> int:
    prompt = request.get("prompt", request.get("messages", ""))
    return max(len(json.dumps(prompt).encode()) // BYTES_PER_TOKEN_ESTIMATE, 1)


class _ClientStream:
    """The client's side of one phase-split request: what of the answer it already has,
    so that a re-run after a token engine died continues the answer rather than repeat it."""

    def __init__(self, send: Callable, is_stream: bool) -> None:
        self._send = send
        self.is_stream = is_stream
        self.has_started = False  # the response start went out
        self.num_events_sent = 0  # data events the client has (streamed answers)

    async def answer(self, response: _Response) -> None:
        await self._send({"type": "http.response.start", "status": response.status,
                          "headers": response.headers})
        await self._send({"type": "http.response.body", "body": response.body})

    async def fail(self, status: int, message: str, retry_after_s: int) -> None:
        body = error_body(status, message)
        if not self.has_started:
            await _send_unavailable(self._send, message, retry_after_s, status)
            return
        # Mid-stream: the form vLLM's own mid-stream errors take.
        await self._send({"type": "http.response.body", "body": b"data: " + body + b"\n\n",
                          "more_body": True})
        await self._send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    async def run(self, engine: Any, scope: dict, body: bytes, receive: Callable) -> bool:
        """Relay the token engine's answer; False when the engine died before the answer
        was whole (what it sent of it then stays back)."""
        if self.is_stream:
            return await self._run_streamed(engine, scope, body, receive)
        response = _Response()
        await _app_of(engine)(_with_length(scope, body), replay_body(body, receive),
                              response.record)
        if (response.status is None or response.status >= 500) and engine.is_dead:
            return False
        await self.answer(response)
        return True

    async def _run_streamed(self, engine: Any, scope: dict, body: bytes,
                            receive: Callable) -> bool:
        to_skip = self.num_events_sent  # what an earlier run already streamed
        pending = b""
        has_error = is_done = False

        async def relay(message: dict) -> None:
            nonlocal pending, to_skip, has_error, is_done
            if message["type"] == "http.response.start":
                if message["status"] >= 500 and engine.is_dead:
                    has_error = True
                    return
                if not self.has_started:
                    self.has_started = True
                    await self._send(message)
                return
            pending += message.get("body", b"")
            events, _, pending = pending.rpartition(b"\n\n")
            out = []
            for event in events.split(b"\n\n") if events else []:
                if event.startswith(b"data: {\"error\"") and engine.is_dead:
                    has_error = True
                    continue
                if has_error:
                    continue  # the [DONE] after an engine's death
                if event == b"data: [DONE]":
                    is_done = True
                elif to_skip > 0:
                    to_skip -= 1
                    continue
                else:
                    self.num_events_sent += 1
                out.append(event + b"\n\n")
            if out:
                await self._send({"type": "http.response.body", "body": b"".join(out),
                                  "more_body": True})

        await _app_of(engine)(_with_length(scope, body), replay_body(body, receive), relay)
        if has_error or (not is_done and engine.is_dead):
            return False
        await self._send({"type": "http.response.body", "body": pending})
        return True


async def _call_buffered(engine: Any, scope: dict, body: bytes) -> _Response:
    """An engine's whole answer to `body` (the client's connection is not involved: a
    client that goes away is noticed by the decode that follows)."""
    response = _Response()
    await _app_of(engine)(_with_length(scope, body), replay_body(body, _never_disconnects),
                          response.record)
    return response


async def _never_disconnects() -> dict:
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


def _with_length(scope: dict, body: bytes) -> dict:
    """The scope with a content-length that fits the rewritten body."""
    headers = [(k, v) for k, v in scope.get("headers") or () if k != b"content-length"]
    return {**scope, "headers": [*headers, (b"content-length", str(len(body)).encode())]}


async def _send_unavailable(send: Callable, message: str, retry_after_s: int,
                            status: int = 503) -> None:
    await send_json(send, status, error_body(status, message),
                    [(b"retry-after", str(retry_after_s).encode())])


async def _whole_body(receive: Callable) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if message["type"] != "http.request" or not message.get("more_body", False):
            return b"".join(chunks)


def phase_split_backends(splits: list[PhaseSplitSpec], engines: Mapping[str, Any],
                         registry: CollectorRegistry, retry_after_s: int
                         ) -> dict[str, PhaseSplitModel]:
    """The gateway's backend of each phase-split model, by its API name."""
    if not splits:
        return {}
    metrics = PhaseSplitMetrics(registry)
    return {split.model: PhaseSplitModel(split, engines, metrics, retry_after_s)
            for split in splits}
