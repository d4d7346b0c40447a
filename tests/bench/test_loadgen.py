"""The load generator against a local fake server with known, injected delays."""

from __future__ import annotations

import socket
import statistics
import time

import numpy as np
import pytest
from bench_fake_server import FakeBehavior

from weaver.bench.loadgen import LoadGenConfig, build_payload, run_load_sync
from weaver.bench.prompts import synthetic_prompt
from weaver.results.records import RequestStatus
from weaver.workloads.types import TraceRequest

TTFT_S, ITL_S = 0.15, 0.02


def _config(url: str, **kw) -> LoadGenConfig:
    kw.setdefault("show_progress", False)
    return LoadGenConfig(url, **kw)


def test_measures_injected_ttft_itl_tpot_e2e(fake_server):
    behavior = FakeBehavior(ttft_s=TTFT_S, itl_s=ITL_S)
    server = fake_server(behavior)
    requests = [TraceRequest(0.25 * i, 20, 10, "m", i) for i in range(3)]
    outcome = run_load_sync(requests, _config(server.url))
    assert [r.status for r in outcome.records] == [RequestStatus.OK] * 3
    streams = {s["prompt"]: s for s in behavior.streams}
    for rec, req in zip(outcome.records, requests, strict=True):
        truth = streams[synthetic_prompt(req.input_tokens, req.request_id)]
        server_ttft = truth["chunk_at"][0] - truth["received_at"]
        server_gaps = np.diff(truth["chunk_at"])
        assert server_ttft >= TTFT_S and server_gaps.min() >= ITL_S  # sleeps never undershoot
        assert rec.num_output_tokens == 10
        assert rec.num_prompt_tokens == 20
        assert len(rec.itl_s) == 9
        assert rec.sent_at_s >= req.arrival_s
        assert rec.sent_at_s == pytest.approx(req.arrival_s, abs=0.05)  # sent on time
        # TTFT: at least the injected delay, and what the server took within a few ms
        # either way (the client stamps the send once the request is on its way; with the
        # machine's cores shared, the server may read it first); little more.
        assert server_ttft >= TTFT_S
        assert server_ttft - 0.01 <= rec.ttft_s < server_ttft + 0.05
        # TPOT and ITL within 30% of the injected 20 ms, and of what the server achieved
        # (on a loaded machine its sleeps may overrun; the metric must follow them).
        assert rec.tpot_s >= 0.7 * ITL_S
        assert rec.tpot_s == pytest.approx(server_gaps.mean(), rel=0.3)
        assert statistics.median(rec.itl_s) == pytest.approx(np.median(server_gaps), rel=0.3)
        if server_gaps.mean() < 1.1 * ITL_S:  # the server kept its pace
            assert rec.tpot_s == pytest.approx(ITL_S, rel=0.3)
        # E2E = TTFT + the decode gaps + the stream's tail after the last token (the usage
        # chunk and [DONE]: a few ms, tens on a machine whose cores the suite shares); both
        # bounds fail if E2E were measured wrongly.
        last_token_s = rec.ttft_s + sum(rec.itl_s)
        assert last_token_s <= rec.e2e_s < last_token_s + 0.05
        assert rec.e2e_s >= truth["chunk_at"][-1] - truth["received_at"] >= TTFT_S + 9 * ITL_S
    # The last request arrives at 0.5 s and lasts >= 0.33 s.
    assert outcome.duration_s >= 0.5 + TTFT_S + 9 * ITL_S


def test_payload_prompt_and_api_key(fake_server):
    behavior = FakeBehavior(ttft_s=0.0, itl_s=0.0, api_key="sekret")
    server = fake_server(behavior)
    requests = [TraceRequest(0.0, 37, 3, "hot", 0), TraceRequest(0.0, 37, 3, "cold", 1)]
    outcome = run_load_sync(requests, _config(server.url + "/v1", api_key="sekret"))
    assert all(r.status is RequestStatus.OK for r in outcome.records)
    bodies = sorted(behavior.received, key=lambda b: b["model"])
    assert [b["model"] for b in bodies] == ["cold", "hot"]
    for body in bodies:
        assert body["max_tokens"] == 3 and body["min_tokens"] == 3
        assert body["ignore_eos"] is True and body["stream"] is True
        assert body["stream_options"] == {"include_usage": True}
        assert len(body["prompt"].split()) == 37
    assert bodies[0]["prompt"] != bodies[1]["prompt"]  # no shared prefix to cache
    assert all(h["authorization"] == "Bearer sekret" for h in behavior.headers)


def test_prompt_salt_changes_the_texts_not_their_lengths():
    request = TraceRequest(0.0, 40, 4, "m", 7)
    plain = build_payload(request, _config("http://x"))["prompt"]
    salted = [build_payload(request, _config("http://x", prompt_salt=k))["prompt"]
              for k in (1, 2, 1)]
    assert plain == synthetic_prompt(40, 7)  # salt 0: the texts of results before the salt
    assert salted[0] == salted[2]  # deterministic
    assert len({plain, salted[0], salted[1]}) == 3
    assert all(len(p.split()) == 40 for p in (plain, *salted))
    # Not a shift of ids: salt 1 of id 7 is no other id's salt-0 or salt-1 text.
    assert salted[0] not in {synthetic_prompt(40, i, s) for i in range(7) for s in (0, 1)}
    assert _config("http://x", prompt_salt=3).to_json()["prompt_salt"] == 3


def test_strict_openai_mode_sends_no_vllm_extras():
    config = _config("http://x", send_vllm_extras=False)
    payload = build_payload(TraceRequest(0.0, 5, 4, "m", 0), config)
    assert "ignore_eos" not in payload and "min_tokens" not in payload
    assert payload["max_tokens"] == 4


def test_without_usage_counts_streamed_chunks(fake_server):
    server = fake_server(FakeBehavior(ttft_s=0.0, itl_s=0.001, report_usage=False))
    outcome = run_load_sync([TraceRequest(0.0, 5, 6, "m", 0)], _config(server.url))
    rec = outcome.records[0]
    assert rec.status is RequestStatus.OK
    assert rec.num_output_tokens == 6
    assert rec.num_prompt_tokens is None


@pytest.mark.parametrize(("behavior", "api_key", "expected"), [
    (FakeBehavior(status_code=500), None, "HTTP 500"),
    (FakeBehavior(api_key="right"), "wrong", "HTTP 401"),
])
def test_http_errors_are_recorded(fake_server, behavior, api_key, expected):
    server = fake_server(behavior)
    outcome = run_load_sync([TraceRequest(0.0, 5, 3, "m", 0)], _config(server.url, api_key=api_key))
    rec = outcome.records[0]
    assert rec.status is RequestStatus.ERROR
    assert expected in rec.error and "fake failure" in rec.error
    assert rec.e2e_s is None and rec.tpot_s is None


def test_connection_refused_is_an_error():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    outcome = run_load_sync([TraceRequest(0.0, 5, 3, "m", 0)], _config(f"http://127.0.0.1:{port}"))
    assert outcome.records[0].status is RequestStatus.ERROR


def test_deadline_cancels_outstanding_and_unsent(fake_server):
    server = fake_server(FakeBehavior(ttft_s=0.05, itl_s=0.05))
    requests = [TraceRequest(0.0, 5, 100, "m", 0), TraceRequest(5.0, 5, 3, "m", 1)]
    started = time.perf_counter()
    outcome = run_load_sync(requests, _config(server.url, duration_s=0.5))
    assert time.perf_counter() - started < 2.0  # did not wait for the 5 s stream
    first, second = outcome.records
    assert first.status is RequestStatus.UNFINISHED
    assert first.ttft_s is not None and first.e2e_s is None and len(first.itl_s) >= 3
    assert second.status is RequestStatus.NOT_SENT and second.sent_at_s is None


def test_max_concurrency_serialises(fake_server):
    server = fake_server(FakeBehavior(ttft_s=0.05, itl_s=0.02))
    requests = [TraceRequest(0.0, 5, 5, "m", i) for i in range(2)]
    outcome = run_load_sync(requests, _config(server.url, max_concurrency=1))
    a, b = sorted(outcome.records, key=lambda r: r.sent_at_s)
    assert b.sent_at_s >= a.sent_at_s + a.e2e_s - 0.005
    # TTFT counts from the send, not from the scheduled arrival.
    assert b.ttft_s < 0.05 + 0.1


def test_config_validation():
    assert _config("http://h:1").completions_url == "http://h:1/v1/completions"
    assert _config("http://h:1/v1/").completions_url == "http://h:1/v1/completions"
    with pytest.raises(ValueError, match="http"):
        _config("h:1")
    with pytest.raises(ValueError, match="max-concurrency"):
        _config("http://h", max_concurrency=0)
    with pytest.raises(ValueError, match="duration"):
        _config("http://h", duration_s=-1)
    assert _config("http://h", api_key="k").to_json()["api_key"] == "***"
