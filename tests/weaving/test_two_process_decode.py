"""benchmarks/two_process_decode.py: a hot process and a cold process, no vLLM, the
weaving runtime end to end. Offload on must give the greedy tokens of offload off with
the cold side serving every task; a cold side that computes nothing must fail the run.
Shared memory here; the CUDA transport where a GPU is present (skipped otherwise)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from weaver.offload.naming import region_paths

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "two_process_decode.py"
# Small: two sequences of four remote, prompts of 3-5 tokens.
SMALL = ["--num-seqs", "4", "--num-remote", "2", "--prompt-len", "3"]
# Blocks of 4 tokens on CPU, so each sequence spans several.
SMALL_SHM = [*SMALL, "--steps", "6", "--block-size", "4"]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("two_process_decode", SCRIPT)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def _run(bench, tmp_path: Path, *args: str) -> tuple[int, dict]:
    out = tmp_path / "figures.json"
    code = bench.main([*args, "--out", str(out)])
    return code, json.loads(out.read_text())


def test_shm_offload_on_gives_the_tokens_of_offload_off(bench, tmp_path: Path) -> None:
    code, figures = _run(bench, tmp_path, "--transport", "shm", *SMALL_SHM)
    assert code == 0, figures["failures"]
    assert figures["tokens_equal"] and figures["tokens_on"] == figures["tokens_off"]
    assert figures["num_tasks_served"] == figures["num_tasks_expected"] > 0
    assert figures["num_fallbacks"] == 0
    assert figures["num_remote_prefill_rows"] > 0  # remote prompts attended from the region
    assert figures["cold"]["num_served_at_poll_points"] > 0  # served inside cold steps
    leftovers = [p for p in region_paths(figures["config"]["region_name"]) if os.path.exists(p)]
    assert not leftovers, f"the cold side left its region behind: {leftovers}"


def test_a_cold_side_that_computes_nothing_fails_the_run(bench, tmp_path: Path) -> None:
    code, figures = _run(bench, tmp_path, "--cold-executor", "noop", *SMALL_SHM)
    assert code == 1
    assert not figures["tokens_equal"]
    assert figures["num_tasks_served"] > 0  # served, but what it sent back was not attention


def test_a_cold_process_killed_mid_run_leaves_the_tokens_exact(bench, tmp_path: Path) -> None:
    """SIGKILL of the cold process between two steps: the hot side's waits fail, the pair
    turns degraded and the remote rows are computed here from the remote pool, with the
    greedy tokens of offload off; the dead owner's region files are gone afterwards."""
    code, figures = _run(bench, tmp_path, "--transport", "shm", *SMALL_SHM,
                         "--kill-cold-at-step", "3", "--timeout-s", "2")  # fmt: skip
    assert code == 0, figures["failures"]
    assert figures["tokens_equal"] and figures["num_fallbacks"] > 0
    assert 0 < figures["num_tasks_collected"] < figures["num_tasks_expected"]
    assert figures["cold"]["exit_code"] == -9
    leftovers = [p for p in region_paths(figures["config"]["region_name"]) if os.path.exists(p)]
    assert not leftovers, leftovers


def test_a_run_that_would_offload_nothing_is_refused(bench) -> None:
    with pytest.raises(SystemExit):
        bench.parse_args(["--num-remote", "0"])


def test_the_harness_imports_without_vllm_pydantic_or_yaml() -> None:
    """The GPU machine that runs the CUDA half has torch and CuPy only."""
    code = (
        "import runpy, sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.partition('.')[0] in ('vllm', 'pydantic', 'yaml'):\n"
        "            raise ImportError(name + ' is absent on the GPU machine')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import benchmarks.two_process.cold_side\n"
        "import weaver.offload.cuda.ipc, weaver.offload.cuda.kernels\n"
        "import weaver.offload.cuda.transport\n"
        "sys.argv = ['two_process_decode.py', '--help']\n"
        f"runpy.run_path({str(SCRIPT)!r}, run_name='__main__')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=env, check=False)
    assert result.returncode == 0, result.stderr
    assert "--transport" in result.stdout


@pytest.mark.gpu
def test_cuda_offload_on_gives_the_tokens_of_offload_off(bench, tmp_path: Path) -> None:
    from weaver.offload.cuda.jit import unavailable_reason

    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    # Blocks of 16 tokens (the CUDA kernels' multiple): 16 steps span two.
    code, figures = _run(bench, tmp_path, "--transport", "cuda", *SMALL, "--steps", "16")
    assert code == 0, figures["failures"]
    assert figures["tokens_equal"]
    assert figures["num_tasks_served"] == figures["num_tasks_expected"] > 0
    assert figures["num_fallbacks"] == 0


@pytest.mark.gpu
def test_cuda_cold_process_killed_mid_run_leaves_the_tokens_exact(bench, tmp_path: Path) -> None:
    """The GPU half of the kill test: device waits time out, the fallback kernel behind
    each attends the rows over the dead owner's region (still mapped here), the pair turns
    degraded at the step's settle and attends from that memory afterwards."""
    from weaver.offload.cuda.jit import unavailable_reason

    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    code, figures = _run(bench, tmp_path, "--transport", "cuda", *SMALL, "--steps", "16",
                         "--kill-cold-at-step", "5", "--timeout-s", "0.5")  # fmt: skip
    assert code == 0, figures["failures"]
    assert figures["tokens_equal"] and figures["num_fallbacks"] > 0
    assert 0 < figures["num_tasks_collected"] < figures["num_tasks_expected"]
