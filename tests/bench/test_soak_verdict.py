"""The soak's verdict (benchmarks/soak.py, benchmarks/soak_kit/): what fails a days-long run,
read from its samples, and what a request's end counts as; the soak itself runs for
minutes against real servers and is not in the suite."""

from __future__ import annotations

import random

import pytest
from bench_fake_server import FakeBehavior
from bench_scripts import load_benchmark

from weaver.bench.loadgen import LoadGenConfig, run_load_sync
from weaver.workloads.types import TraceRequest


@pytest.fixture(scope="module")
def soak():
    return load_benchmark("soak")


@pytest.fixture(scope="module")
def kit(soak):
    from benchmarks.soak_kit import engines, outcomes

    return engines, outcomes


def left(shm_files=(), sockets=0, survivors=0):
    return {"shm_bytes": 4096 * len(shm_files), "shm_files": list(shm_files),
            "socket_files": sockets, "survivors": survivors}


def result(lost=0, back_at_s=50.0, shm_files=(), sockets=0, **extra):
    return {"outcomes": {"ok": 10, "clean": 2, "no_retry_after": 0, "server_down": 3,
                         "lost": lost, "not_sent": 0},
            "kills": [{"at_s": 20.0, "model": "m", "process": "worker",
                       "back_at_s": back_at_s}],
            "health_at_end": {"m": {"status": "ok", "restarts": 1}},
            "pairs_at_end": {"hot->cold": "ok"},
            "left_after_stop": left(shm_files, sockets), **extra}


def samples(soak, rss_of, life_of=lambda t: 0):
    return [soak.Sample(at_s=2.0 * i, rss_mib=rss_of(2.0 * i), fds=20, threads=10,
                        shm_mib=1.0, socket_files=7, life=life_of(2.0 * i)) for i in range(200)]


def test_a_flat_run_passes_from_its_first_recovery_on(soak):
    # Before the first recovery the RSS climbs (warm-up); after it, flat.
    flat = samples(soak, lambda t: 600 + min(t, 50) * 4)
    verdict, lives = soak.verdict(result(), flat)
    assert verdict == "pass"
    assert lives == [{"life": 0, "warm_from_s": 50.0, "start_mib": 800, "end_mib": 800}]


def test_rss_is_judged_within_each_life_of_the_gateway(soak):
    # A restarted gateway starts lower, then warms up again: no growth within a life.
    def life_of(t):
        return 0 if t < 200 else 1

    def stepped(t):
        return 800 if t < 200 else 700 + min(t - 200, 40)

    verdict, lives = soak.verdict(result(), samples(soak, stepped, life_of))
    assert verdict == "pass", verdict
    assert [life["warm_from_s"] for life in lives] == [50.0, 260.0]
    # Growth within the second life is named with it.
    verdict, _ = soak.verdict(result(), samples(soak, lambda t: 800 + max(t - 200, 0),
                                                life_of))
    assert verdict.startswith("fail: ") and "(life 1)" in verdict, verdict


@pytest.mark.parametrize(("kw", "rss_of", "reason"), [
    ({}, lambda t: 800 + t / 2, "gateway RSS grew"),
    ({"lost": 1}, lambda t: 800, "1 requests lost"),
    ({"back_at_s": None}, lambda t: 800, "did not come back"),
    ({"shm_files": ["/dev/shm/psm_1"]}, lambda t: 800, "/dev/shm holds 4096 bytes in 1 files"),
    ({"sockets": 7}, lambda t: 800, "7 socket files left"),
    ({"pairs_at_end": {"u-hot->u-cold": "degraded"}}, lambda t: 800,
     "weaving pairs not ok at the end: {'u-hot->u-cold': 'degraded'}"),
    ({"health_at_end": {"m": {"status": "restarting", "restarts": 2}}}, lambda t: 800,
     "not every engine in service"),
    ({"server_restarts": [{"at_s": 100.0, "back_at_s": None}]}, lambda t: 800,
     "the server did not come back"),
    ({"left_after_restarts": [{"at_s": 100.0, **left(survivors=2)}]}, lambda t: 800,
     "after the restart at 100 s: 2 of its processes outlived it"),
    ({"left_after_restarts": [{"at_s": 100.0, **left(["/dev/shm/weaver9-x"])}]},
     lambda t: 800, "after the restart at 100 s: /dev/shm holds"),
    ({"num_roles": 1, "roles_not_killed": [["m", "engine core"]]}, lambda t: 800,
     "roles never killed"),
])
def test_what_fails_a_soak_is_named(soak, kw, rss_of, reason):
    verdict, _ = soak.verdict(result(**kw), samples(soak, rss_of))
    assert verdict.startswith("fail: ") and reason in verdict, verdict


def test_a_role_left_unkilled_fails_only_a_run_with_a_kill_for_every_role(soak):
    few_kills = result(num_roles=16, roles_not_killed=[["m", "engine core"]])
    assert soak.verdict(few_kills, samples(soak, lambda t: 800))[0] == "pass"


def test_answers_without_retry_after_and_the_plain_phase_fail_it(soak):
    quiet = result()
    quiet["outcomes"]["no_retry_after"] = 2
    verdict, _ = soak.verdict(quiet, samples(soak, lambda t: 800))
    assert "2 429/503 answers without Retry-After" in verdict
    plain = {"outcomes": {"ok": 20, "lost": 1}, "not_back": ["hot restarted: no link"],
             "left_after_stop": left(["/dev/shm/weaver-pairs-0/x"])}
    verdict, _ = soak.verdict(result(plain_vllm=plain), samples(soak, lambda t: 800))
    for reason in ("plain vllm serve: 1 requests lost", "plain vllm serve: not serving again",
                   "plain vllm serve: /dev/shm holds"):
        assert reason in verdict, verdict


BODY = '{"error": {"message": "the engine of model \'m\' is restarting", "code": 503}}'


@pytest.mark.parametrize(("error", "sent_at_s", "kind"), [
    (None, 1.0, "ok"),
    (f"RuntimeError: HTTP 503 (Retry-After: 5): {BODY}", 1.0, "clean"),
    (f"RuntimeError: HTTP 429 (Retry-After: 5): {BODY}", 1.0, "clean"),
    (f"RuntimeError: HTTP 503: {BODY}", 1.0, "no_retry_after"),
    (f"RuntimeError: HTTP 504: {BODY}", 1.0, "clean"),  # a deadline: no retry to advise
    ("RuntimeError: HTTP 502: Bad Gateway", 1.0, "lost"),  # not an OpenAI error body
    ("RuntimeError: server error in stream: {'message': 'EngineCore died'}", 1.0, "clean"),
    ("ConnectError: All connection attempts failed", 105.0, "server_down"),
    ("ConnectError: All connection attempts failed", 1.0, "lost"),  # meant to be up
    ("RemoteProtocolError: Server disconnected without sending a response.", 105.0, "lost"),
    ("RuntimeError: the stream ended without any generated text", 1.0, "lost"),
])
def test_what_a_request_came_to(kit, error, sent_at_s, kind):
    _, outcomes = kit
    assert outcomes.classify(error, sent_at_s, [(100.0, 160.0)]) == kind


def test_the_load_generator_keeps_retry_after_as_the_soak_reads_it(kit, fake_server):
    _, outcomes = kit
    for retry_after, kind in (("5", "clean"), (None, "no_retry_after")):
        server = fake_server(FakeBehavior(status_code=503, retry_after=retry_after))
        config = LoadGenConfig(base_url=server.url, show_progress=False)
        record = run_load_sync([TraceRequest(0.0, 5, 3, "m", 0)], config).records[0]
        assert outcomes.outcome_of(record) == kind, record.error


def test_outcomes_are_counted_per_minute_sent(kit):
    _, outcomes = kit
    minutes = outcomes.outcomes_per_minute([(1.0, "ok"), (59.0, "clean"), (130.0, "lost")])
    assert [m["ok"] for m in minutes] == [1, 0, 0]
    assert [m["clean"] for m in minutes] == [1, 0, 0]
    assert [m["lost"] for m in minutes] == [0, 0, 1]


HEALTH = {
    "models": {
        "w-hot": {"status": "ok", "restarts": 1, "engine_pids": [11]},
        "w-cold": {"status": "restarting", "restarts": 0, "engine_pids": []},
        "chat": {"status": "ok", "role": "phase_split",
                 "prefill": {"chat-prompt": {"status": "ok", "restarts": 2}},
                 "decode": {"chat-token": {"status": "ok", "restarts": 0}}},
    },
    "weaving": [{"hot": "w-hot", "cold": "w-cold", "status": "degraded"}],
}


def test_a_phase_splits_engines_are_engines_of_their_own(kit):
    engines, _ = kit
    assert sorted(engines.engines_of(HEALTH)) == ["chat-prompt", "chat-token", "w-cold",
                                                  "w-hot"]
    assert engines.in_service(HEALTH) == {"w-hot": 1, "chat-prompt": 2, "chat-token": 0}
    assert engines.pair_statuses(HEALTH) == {"w-hot->w-cold": "degraded"}


def test_kills_go_round_every_role(kit):
    engines, _ = kit
    names = ["a", "b", "c"]
    order = engines.kill_order(names, 8, random.Random(0))
    assert len(order) == 8 and set(order[:6]) == {(n, k) for n in names
                                                  for k in engines.PROCESS_KINDS}
    assert order == engines.kill_order(names, 8, random.Random(0))  # seeded
    kills = [{"model": m, "process": p} for m, p in order[:5]]
    assert engines.not_killed(names, kills) == [order[5]]


def test_server_restarts_are_evenly_spaced(soak):
    assert soak.restart_times(600.0, 2) == [200.0, 400.0]
    assert soak.restart_times(600.0, 0) == []
