"""A tiny OpenAI-compatible streaming server for tests: raw asyncio HTTP/1.1 on 127.0.0.1
with an ephemeral port, run in its own thread. It streams exactly `max_tokens` one-token
chunks, the first after `ttft_s` and each next one `itl_s` later, so the load generator's
measurements can be checked against known delays. With `num_slots` it also has a known
capacity: a request waits for one of `num_slots` slots and holds it while it streams, so the
server completes num_slots / (ttft_s + (max_tokens - 1) * itl_s) requests per second.
GET /metrics answers two gauges in Prometheus' text format: `fake_streaming` (requests
streaming now) and `fake_waiting` (requests waiting for a slot)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class FakeBehavior:
    ttft_s: float = 0.15
    itl_s: float = 0.02
    report_usage: bool = True
    status_code: int = 200
    retry_after: str | None = None  # the Retry-After header of a status_code answer
    api_key: str | None = None  # when set, other keys get 401
    received: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    # Per stream, what the server really did (time.perf_counter, the client's clock too as
    # both run in this process): {"prompt", "received_at", "chunk_at": [...]}. Lets tests
    # tell the client's measurement error from the server oversleeping on a busy machine.
    streams: list[dict[str, Any]] = field(default_factory=list)
    # None: every request streams at once (no queueing); N: at most N stream, the rest wait
    # in arrival order, so TTFT grows without bound above the capacity.
    num_slots: int | None = None


def _chunk(payload: bytes) -> bytes:
    return f"{len(payload):x}\r\n".encode() + payload + b"\r\n"


def _event(obj: Any) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj)
    return _chunk(f"data: {data}\n\n".encode())


class FakeOpenAIServer:
    def __init__(self, behavior: FakeBehavior | None = None) -> None:
        self.behavior = behavior or FakeBehavior()
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None
        # Made on first use inside the server's loop: a semaphore belongs to one loop.
        self._slots: asyncio.Semaphore | None = None
        self.streaming = 0  # the /metrics gauges
        self.waiting = 0

    def __enter__(self) -> FakeOpenAIServer:
        self._thread.start()
        future = asyncio.run_coroutine_threadsafe(self._start(), self._loop)
        self.url = future.result(timeout=10)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    async def _start(self) -> str:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def _stop(self) -> None:
        assert self._server is not None
        self._server.close()
        # Handlers still streaming (a test that hit its deadline) end before the loop does.
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)
        await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await self._serve(reader, writer)
        except (ConnectionError, asyncio.CancelledError):
            pass  # the client went away (deadline test)
        finally:
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        if lines[0].startswith("GET /metrics "):
            text = (f"# TYPE fake_streaming gauge\nfake_streaming{{model=\"m\"}} {self.streaming}\n"
                    f"# TYPE fake_waiting gauge\nfake_waiting {self.waiting}\n").encode()
            writer.write(f"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: "
                         f"{len(text)}\r\nConnection: close\r\n\r\n".encode() + text)
            await writer.drain()
            return
        headers = {
            k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:] if x)
        }
        body = json.loads(await reader.readexactly(int(headers.get("content-length", "0"))))
        received_at = time.perf_counter()
        b = self.behavior
        b.received.append(body)
        b.headers.append(headers)
        status = b.status_code
        if b.api_key is not None and headers.get("authorization") != f"Bearer {b.api_key}":
            status = 401
        if status != 200:
            msg = json.dumps({"error": {"message": "fake failure"}}).encode()
            retry = "" if b.retry_after is None else f"Retry-After: {b.retry_after}\r\n"
            writer.write(
                f"HTTP/1.1 {status} Fake\r\nContent-Length: {len(msg)}\r\n{retry}"
                "Connection: close\r\n\r\n".encode() + msg
            )
            await writer.drain()
            return
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
        )
        await writer.drain()
        stream = {"prompt": body["prompt"], "received_at": received_at, "chunk_at": []}
        b.streams.append(stream)
        if b.num_slots is None:
            self.streaming += 1
            try:
                await self._stream_tokens(writer, body, stream)
            finally:
                self.streaming -= 1
            return
        if self._slots is None:
            self._slots = asyncio.Semaphore(b.num_slots)
        self.waiting += 1
        try:
            slot = await self._take_slot(reader)
        finally:
            self.waiting -= 1
        if not slot:
            return
        self.streaming += 1
        try:
            # Like vLLM, stop serving a client that went away (a run cut at its deadline):
            # its slot goes to the next request, and no queue outlives the run.
            await self._stream_tokens(writer, body, stream, reader.at_eof)
        finally:
            self.streaming -= 1
            self._slots.release()

    async def _take_slot(self, reader: asyncio.StreamReader) -> bool:
        """Wait for a free slot; False if the client disconnected while it waited."""
        assert self._slots is not None
        acquire = asyncio.ensure_future(self._slots.acquire())
        gone = asyncio.ensure_future(reader.read(1))  # b"" at EOF; the client sends no more
        await asyncio.wait({acquire, gone}, return_when=asyncio.FIRST_COMPLETED)
        gone.cancel()
        if not acquire.done():
            acquire.cancel()  # Semaphore.acquire passes a wake-up it got on to the next one
        await asyncio.gather(acquire, gone, return_exceptions=True)
        return acquire.done() and not acquire.cancelled()

    async def _stream_tokens(
        self,
        writer: asyncio.StreamWriter,
        body: dict[str, Any],
        stream: dict[str, Any],
        client_gone: Callable[[], bool] = lambda: False,
    ) -> None:
        b = self.behavior
        num_tokens = int(body["max_tokens"])
        start = time.perf_counter()
        for i in range(num_tokens):
            if b.num_slots is None:
                await asyncio.sleep(b.ttft_s if i == 0 else b.itl_s)
            else:
                # Tokens keep to a schedule from the slot's start: a late wake-up on a busy
                # machine does not add up over the tokens and lower the known capacity.
                due = start + b.ttft_s + i * b.itl_s
                await asyncio.sleep(max(0.0, due - time.perf_counter()))
            if client_gone():
                return
            event = {"id": "x", "object": "text_completion", "model": body["model"],
                     "choices": [{"index": 0, "text": " tok", "finish_reason": None}]}
            writer.write(_event(event))
            await writer.drain()
            stream["chunk_at"].append(time.perf_counter())
        if b.report_usage:
            usage = {"prompt_tokens": len(body["prompt"].split()),
                     "completion_tokens": num_tokens, "total_tokens": 0}
            writer.write(_event({"id": "x", "choices": [], "usage": usage}))
        writer.write(_event("[DONE]") + b"0\r\n\r\n")
        await writer.drain()
