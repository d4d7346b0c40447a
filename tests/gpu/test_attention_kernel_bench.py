"""The parts of benchmarks/attention_kernel.py that need no GPU: the exit without CUDA
and the grid sizes it understands."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "attention_kernel.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("attention_kernel_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def test_exits_with_code_2_and_a_reason_without_cuda(bench, capsys) -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert bench.main(["--seqs", "1"]) == 2
    assert "GPU" in capsys.readouterr().err


@pytest.mark.parametrize(("spec", "blocks"), [("items", 128), ("sms", 132), ("2sms", 264),
                                              ("7", 7)])  # fmt: skip
def test_grid_sizes(bench, spec: str, blocks: int) -> None:
    assert bench.grid_size(spec, num_items=128, num_sms=132) == blocks


@pytest.mark.parametrize("spec", ["0", "sm", "many", "-3", "xsms", "0sms"])
def test_a_grid_it_does_not_know_is_refused_with_the_forms_it_takes(bench, spec: str) -> None:
    with pytest.raises(ValueError, match="'items', 'sms'"):
        bench.grid_size(spec, num_items=128, num_sms=132)
