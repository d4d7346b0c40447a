"""Operator splitting applied inside real vLLM engines (weaver/vllm_ext/layers.py),
and the profile measured on them (weaver/vllm_ext/engine/split_profiler.py).

Engines run in child processes with PYTHONPATH set to this checkout, so vLLM's worker
imports this tree's `weaver` (checked). Four engine starts in all: tiny-llama-a unsplit
and split (side by side); then `weaver plan-split --measure` starts tiny-llama-a (cold) and
tiny-llama-b (hot) once each.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from weaver.splitting.profile import LM_HEAD_NAME, PER_LAYER_OP_NAMES, SplitProfile

pytestmark = pytest.mark.engine(seconds=150)

REPO = Path(__file__).resolve().parents[2]
RUNNER = Path(__file__).with_name("split_engine_run.py")
# Uneven cuts on purpose: qkv has 256 output rows, 3 chunks of 86/85/85.
# Attention in 3 groups of sequences (batches of 8 prompts, fewer near the end).
CHUNKS = {"qkv": 3, "attn": 3, "o": 2, "gate_up": 4, "down": 2, "lm_head": 16}
TIMEOUT_S = 600


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "VLLM_CPU_KVCACHE_SPACE": "1", **extra}


def _run_engine(model_dir: Path, chunks: dict | None, core: str) -> dict:
    shm_prefix = f"wsplit{os.getpid()}"
    proc = subprocess.run([sys.executable, str(RUNNER), str(model_dir), json.dumps(chunks),
                           shm_prefix], capture_output=True, text=True, timeout=TIMEOUT_S,
                          env=_env(VLLM_CPU_OMP_THREADS_BIND=core), cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def tiny_dir() -> Path:
    from weaver.models.registry import prepare_model

    return prepare_model("tiny-llama-a")


@pytest.fixture(scope="module")
def engine_runs(tiny_dir) -> tuple[dict, dict]:
    """The unsplit and the split run, at the same time: they are independent processes
    (only the split one opens a region), each pinned to a core of its own (vLLM's default
    binding would put both engines' threads on core 0, one after the other). An engine
    binds one thread either way, so the outputs are those of a run alone."""
    with cf.ThreadPoolExecutor(2) as pool:
        runs = [pool.submit(_run_engine, tiny_dir, chunks, core)
                for core, chunks in (("0", None), ("1", CHUNKS))]
        unsplit_run, split_run = (run.result() for run in runs)
    return unsplit_run, split_run


@pytest.fixture(scope="module")
def unsplit(engine_runs) -> dict:
    return engine_runs[0]


@pytest.fixture(scope="module")
def split(engine_runs) -> dict:
    return engine_runs[1]


def test_workers_import_this_checkout(unsplit, split):
    for run in (unsplit, split):
        assert Path(run["weaver_file"]).resolve() == REPO / "weaver" / "__init__.py"


def test_split_outputs_are_token_identical(unsplit, split):
    assert len(split["outputs"]) == 8 and all(len(o) == 16 for o in split["outputs"])
    assert split["outputs"] == unsplit["outputs"]


def test_unsplit_engine_has_no_split_operators(unsplit):
    assert unsplit["stats"] == {}


def test_chunks_run_and_poll_between_them(split):
    stats = split["stats"]
    assert set(stats) == set(CHUNKS)
    # 2 layers x (4 linears + attention) + head
    assert split["opened"]["num_split_operators"] == 2 * 5 + 1
    for op, chunks in CHUNKS.items():
        entry = stats[op]
        assert entry["chunks"] == chunks
        assert entry["layers"] == (1 if op == LM_HEAD_NAME else 2)
        assert entry["calls"] > 0
        if op == "attn":  # as many groups as the step has sequences, up to 3
            assert entry["calls"] < entry["chunk_calls"] <= chunks * entry["calls"]
            assert 0 < entry["polls"] <= entry["chunk_calls"] - entry["calls"]
            continue
        assert entry["chunk_calls"] == chunks * entry["calls"]
        # Calls made before weaver_join_pairs (warm-up) had no poll installed.
        assert 0 < entry["polls"] <= (chunks - 1) * entry["calls"]
        assert entry["polls"] % (chunks - 1) == 0


def test_measured_profile_parses_and_plans(tmp_path, tiny_dir):
    from weaver.models.registry import prepare_model

    hot_dir = prepare_model("tiny-llama-b")
    config = tmp_path / "deployment.yaml"
    config.write_text(f"""
models:
  - {{name: hot, model: {hot_dir}, role: hot, block_size: 32, max_model_len: 256,
      kv_cache_gib: 0.05, max_num_seqs: 8}}
  - {{name: cold, model: {tiny_dir}, role: cold, max_model_len: 256, kv_cache_gib: 0.05,
      lend_kv_gib: 0.05, max_num_seqs: 8, split: auto,
      split_profile: {tmp_path / 'cold.json'}}}
weaving: [{{hot: hot, cold: [cold], offload_ratio: 0.5}}]
""")
    proc = subprocess.run(
        [sys.executable, "-m", "weaver.cli.main", "plan-split", str(config), "--measure",
         "--batch", "4", "--hot-batch", "4", "--prompt-len", "32", "--decode-tokens", "12"],
        capture_output=True, text=True, timeout=TIMEOUT_S, env=_env(), cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Expected wait W" in proc.stdout and "Profile written to" in proc.stdout
    profile = SplitProfile.load(tmp_path / "cold.json")
    assert sorted(op.name for op in profile.layer_ops) == sorted(PER_LAYER_OP_NAMES)
    assert profile.num_layers == 2 and profile.device == "cpu"
    dims = {op.name: op.split_dim_size for op in profile.layer_ops}
    assert dims == {"qkv": 256, "attn": 4, "o": 128, "gate_up": 768, "down": 128}
    attn = next(op for op in profile.layer_ops if op.name == "attn")
    assert attn.min_chunk_size == 1  # attention splits into groups of whole sequences
    assert profile.lm_head.split_dim_size == 49152
    assert all(op.num_samples >= 2 for op in [*profile.layer_ops, profile.lm_head])
    assert profile.split_overhead_s is not None and profile.hot.step_s > 0
    # The saved profile is the one split: auto plans from, and the plan applies.
    from weaver.config.deployment import load_deployment
    from weaver.splitting.deploy import split_chunks_for

    chunks = split_chunks_for(load_deployment(config).model("cold"), str(config))
    assert all(n > 1 for n in chunks.values())
