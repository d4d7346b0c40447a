from __future__ import annotations

import pytest
from bench_fake_server import FakeBehavior, FakeOpenAIServer


@pytest.fixture
def fake_server():
    """Start a fake server with the given behaviour: `with fake_server(FakeBehavior(...))`."""
    started: list[FakeOpenAIServer] = []

    def start(behavior: FakeBehavior | None = None) -> FakeOpenAIServer:
        server = FakeOpenAIServer(behavior).__enter__()
        started.append(server)
        return server

    yield start
    for server in started:
        server.__exit__(None, None, None)
