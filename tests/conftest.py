"""Fixtures shared by the whole suite.

The linear profile (the `lin` fixture), whose step times are easy to compute by hand,
serves the simulator's tests and the profiling calibrations' tests; helpers travel as
fixtures because test modules of different folders cannot import each other. Also the
order in which `make test` hands modules to its two xdist workers, and the guards that hold
every module to leaving no process running and the session to leaving nothing in /dev/shm
nor an engine's socket files (tests/leftovers.py)."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import leftovers
import pytest

from weaver.sim.profile import ModelShape, Profile


# `make test` runs the suite on two xdist workers (`-n 2 --dist loadfile
# --no-loadscope-reorder`): a test file goes whole to one worker, so a module's tests share
# its module-scoped engines and run in file order. Modules that start engines go first,
# longest first (the `engine` mark's `seconds`: about what the module took on the 2-core
# reference machine), so that the short modules fill the other worker at the end instead of
# one long module running alone.
def pytest_collection_modifyitems(config, items) -> None:
    def engine_seconds(item) -> float:
        mark = item.get_closest_marker("engine")
        return -1.0 if mark is None else float(mark.kwargs.get("seconds", 0))

    items.sort(key=lambda item: -engine_seconds(item))  # stable: file order kept within


def pytest_configure(config) -> None:
    if not hasattr(config, "workerinput"):  # the session's process: its workers inherit it
        base = leftovers.make_rpc_base()
        config.stash[RPC_BASE] = base
        os.environ["VLLM_RPC_BASE_PATH"] = str(base)
    # Each worker's engines run their OpenMP threads on a core of its own (unless a test or
    # its deployment names cores). vLLM's own binding ("auto") keeps one core for the
    # front end and binds every engine to the same other one (core 0 on a 2-core machine:
    # its log's "core ids=[0]"), so both workers' engines would share that core.
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is not None and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        cores = sorted(os.sched_getaffinity(0))
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(cores[int(worker[2:]) % len(cores)])


# The /dev/shm guard. The session's process (the xdist controller under `make test`) lists
# /dev/shm when it starts and again when every worker is done; an entry that appeared and
# that no live process holds fails the run, naming the modules that ran when it was
# created: /dev/shm is memory, and a machine that runs the suite often would run out of it.
# Each worker reports its modules' (name, start, end) windows back to the controller.
SHM_BEFORE = pytest.StashKey[set]()
MODULE_WINDOWS = pytest.StashKey[list]()
# The socket guard, alike: every engine's socket files go to the session's directory
# (tests/leftovers.py); a Weaver engine directory still there at the end fails the run.
RPC_BASE = pytest.StashKey[Path]()


def pytest_sessionstart(session) -> None:
    session.config.stash[SHM_BEFORE] = leftovers.shm_entries()
    session.config.stash[MODULE_WINDOWS] = []


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    windows = node.workeroutput.get("module_windows", []) if hasattr(node, "workeroutput") else []
    node.config.stash[MODULE_WINDOWS].extend(tuple(window) for window in windows)


def pytest_sessionfinish(session, exitstatus) -> None:
    config = session.config
    if hasattr(config, "workerinput"):  # an xdist worker: the controller judges
        config.workeroutput["module_windows"] = [list(w) for w in config.stash[MODULE_WINDOWS]]
        return
    windows = config.stash[MODULE_WINDOWS]
    left = leftovers.shm_left(config.stash[SHM_BEFORE])
    if left:
        leftovers.remove_shm(left)
        _fail_session(session, "left in /dev/shm", leftovers.describe_shm_left(left, windows))
    base = config.stash[RPC_BASE]
    rpc_left = leftovers.rpc_dirs_left(base)
    shutil.rmtree(base, ignore_errors=True)
    if rpc_left:
        _fail_session(session, "engine socket files left",
                      leftovers.describe_rpc_left(rpc_left, windows))


def _fail_session(session, title: str, description: str) -> None:
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.line("")  # after the progress line
        reporter.write_sep("=", title, red=True)
        reporter.write_line(description)
    if session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="module", autouse=True)
def no_process_left_behind(request):
    """Fails the module's last test, naming the module, when a process it started still
    runs once its fixtures are torn down (after a grace period); kills it, so that the next
    module is judged on its own. Also records when the module ran, for the /dev/shm guard."""
    before = set(leftovers.live_descendants())
    started = time.time()
    yield
    left = leftovers.left_running(before)
    windows = request.config.stash[MODULE_WINDOWS]
    windows.append((request.module.__name__, started, time.time()))
    if left:
        leftovers.kill(left)
        pytest.fail(f"{request.module.__name__} left processes running: {left}",
                    pytrace=False)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct prepared by the project's own command (a no-op when the
    set-up already prepared it, as `make test` does)."""
    from weaver.models.registry import prepare_model

    return prepare_model("smollm2-135m-instruct")


class Linear:
    """prefill(n) = P0 + P1 n; decode(b, c) = D0 + DB b + DC c; attention(c) = A1 c;
    link: 1 GB/s with 1 ms latency; KV blocks of BLOCK tokens."""

    P0, P1 = 0.010, 1e-4
    D0, DB, DC = 0.020, 1e-3, 1e-6
    A1 = 5e-7
    SHAPE = ModelShape("test-1b", num_layers=4, hidden_size=256, num_heads=4,
                       num_kv_heads=2, head_size=64, intermediate_size=512, vocab_size=1000)
    BLOCK = 16
    BLOCK_BYTES = BLOCK * SHAPE.kv_bytes_per_token

    @classmethod
    def prefill_time(cls, n: int) -> float:
        return cls.P0 + cls.P1 * n

    @classmethod
    def decode_time(cls, b: int, c: int) -> float:
        return cls.D0 + cls.DB * b + cls.DC * c

    @classmethod
    def profile(cls) -> Profile:
        batches, contexts = [1, 1000], [0, 1_000_000]
        return Profile(
            device="A100-80GB", shape=cls.SHAPE, source="synthetic linear profile for tests",
            memory_bytes=80 << 30,
            prefill_tokens=[1, 10_000],
            prefill_s=[cls.prefill_time(1), cls.prefill_time(10_000)],
            decode_batch_sizes=batches, decode_context_tokens=contexts,
            decode_s=[[cls.decode_time(b, c) for c in contexts] for b in batches],
            attention_context_tokens=contexts, attention_s=[cls.A1 * c for c in contexts],
            link_bandwidth_bps=1e9, link_latency_s=1e-3,
        )


@pytest.fixture
def lin() -> type[Linear]:
    return Linear


@pytest.fixture
def lin_model_dir(tmp_path):
    """A model directory whose config.json has the linear profile's shape (what the
    calibration commands check a profile against)."""
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    s = Linear.SHAPE
    (model_dir / "config.json").write_text(json.dumps({
        "num_hidden_layers": s.num_layers, "hidden_size": s.hidden_size,
        "num_attention_heads": s.num_heads, "num_key_value_heads": s.num_kv_heads,
        "intermediate_size": s.intermediate_size, "vocab_size": s.vocab_size}))
    return model_dir


@pytest.fixture
def profile_path(tmp_path):
    path = tmp_path / "linear.json"
    Linear.profile().save(path)
    return str(path)


HUB_REPO_ID = "weaver-test/tiny-llama-b"


@pytest.fixture(scope="session")
def hub_cache(tmp_path_factory) -> dict[str, str]:
    """A Hugging Face hub cache built here, in the hub's own layout (blobs, a snapshot of
    symlinks, refs/main), holding the prepared tiny-llama-b as `weaver-test/tiny-llama-b`;
    the environment that makes the hub library (and so vLLM) read it offline, with
    `repo_id` added. Nothing is mocked: the hub library resolves the id from this cache."""
    import hashlib
    import os

    from weaver.models.registry import prepare_model

    source = prepare_model("tiny-llama-b")
    hf_home = tmp_path_factory.mktemp("hf_home")
    repo = hf_home / "hub" / ("models--" + HUB_REPO_ID.replace("/", "--"))
    commit = hashlib.sha1(HUB_REPO_ID.encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    for path in sorted(source.rglob("*")):
        if not path.is_file():
            continue
        data = path.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / path.relative_to(source)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return {"HF_HOME": str(hf_home), "HF_HUB_CACHE": str(hf_home / "hub"),
            "HF_HUB_OFFLINE": "1", "repo_id": HUB_REPO_ID}
