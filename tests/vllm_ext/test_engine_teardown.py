"""An engine closed while requests still wait on it ends them with vLLM's EngineDeadError
(weaver/vllm_ext/engine/app.py _fail_pending_requests), as vLLM's output handler does
when it reads the EngineCore's death, so a stream on a dead engine is run again instead
of waiting forever. vLLM's own OutputProcessor and RequestOutputCollector, no engine."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.exceptions import EngineDeadError
from vllm.v1.engine.output_processor import OutputProcessor, RequestOutputCollector

from weaver.vllm_ext.engine.app import _fail_pending_requests


def test_a_request_waiting_on_a_closed_engine_gets_an_engine_dead_error():
    async def main():
        processor = OutputProcessor(None, log_stats=False)
        collector = RequestOutputCollector(RequestOutputKind.DELTA, "r1")
        processor.request_states["r1"] = SimpleNamespace(queue=collector)
        waiting = asyncio.ensure_future(collector.get())  # a stream awaiting its next token
        await asyncio.sleep(0)
        _fail_pending_requests("d0", SimpleNamespace(output_processor=processor))
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(waiting, 5)

    asyncio.run(main())


def test_an_engine_with_nothing_pending_closes_quietly(caplog):
    processor = OutputProcessor(None, log_stats=False)
    _fail_pending_requests("d0", SimpleNamespace(output_processor=processor))
    assert "unfinished" not in caplog.text
