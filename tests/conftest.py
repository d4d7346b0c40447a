"""Fixtures shared by the whole suite."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct prepared by the project's own command (a no-op when the
    set-up already prepared it, as `make test` does)."""
    from weaver.models.registry import prepare_model

    return prepare_model("smollm2-135m-instruct")
