"""Weaver's gateway log survives vLLM's imports: model_hosting_container_standards (pulled
in by vLLM's app builder) sets the root logger to ERROR at import unless told otherwise."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = """
import logging
{setup}
import model_hosting_container_standards.logging_config  # what vLLM's build_app imports
log = logging.getLogger("weaver.probe")
log.info("info-line")
log.warning("warning-line")
"""


def run(setup: str) -> str:
    env = {k: v for k, v in os.environ.items()
           if k not in ("SAGEMAKER_CONTAINER_LOG_LEVEL", "LOG_LEVEL")}
    result = subprocess.run([sys.executable, "-c", SCRIPT.format(setup=setup)], env=env,
                            capture_output=True, text=True, timeout=60, check=True)
    return result.stderr


def test_plain_basic_config_loses_weaver_lines():
    # The defect itself, so the test below cannot pass by accident.
    stderr = run('logging.basicConfig(level="INFO")')
    assert "info-line" not in stderr and "warning-line" not in stderr


def test_configure_logging_keeps_info_and_warnings():
    stderr = run('from weaver.cli.main import configure_logging\nconfigure_logging("INFO")')
    assert "INFO weaver.probe: info-line" in stderr
    assert "WARNING weaver.probe: warning-line" in stderr
