"""The models cache on disk: finished markers, atomic builds, the step runner, the final check.

A model directory is final only once it holds a marker file, and it only ever appears under
its final name by one `os.rename` of a fully written temporary directory next to it, so a
crash (or Ctrl-C) never leaves a half-written model where `resolve_model` would find it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from weaver.processes import is_process_alive

logger = logging.getLogger(__name__)

MARKER_FILE = ".weaver-model.json"
# Bump when the layout Weaver writes changes, so that old caches are rebuilt.
MARKER_FORMAT = 1
# Temporary directories live beside the final one (same filesystem, so rename is atomic)
# and are named `.partial-<model>-<pid>-<random>` so that leftovers of dead processes can
# be recognised and removed.
_PARTIAL_PREFIX = ".partial-"

Step = tuple[str, Callable[[], None]]


def read_marker(model_dir: Path) -> dict[str, Any] | None:
    """The marker of a finished model directory, or None where there is none (or it is bad)."""
    try:
        marker = json.loads((model_dir / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(marker, dict) or marker.get("format") != MARKER_FORMAT:
        return None
    return marker


def write_marker(model_dir: Path, name: str, recipe: dict[str, Any]) -> None:
    marker = {
        "format": MARKER_FORMAT,
        "name": name,
        "recipe": recipe,
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    (model_dir / MARKER_FILE).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")


def remove_stale_partials(models_dir: Path, name: str) -> int:
    """Remove temporary directories of `name` left by processes that no longer run."""
    num_removed = 0
    prefix = f"{_PARTIAL_PREFIX}{name}-"
    for entry in models_dir.glob(f"{prefix}*"):
        pid_text = entry.name[len(prefix) :].split("-", 1)[0]
        if pid_text.isdigit() and not is_process_alive(int(pid_text)):
            logger.info("removing %s, left by an interrupted build", entry)
            shutil.rmtree(entry, ignore_errors=True)
            num_removed += 1
    return num_removed


@contextlib.contextmanager
def atomic_model_dir(final_dir: Path) -> Iterator[Path]:
    """Yield an empty temporary directory; on success it replaces `final_dir` atomically.

    On any exception the temporary directory is deleted and `final_dir` is left as it was.
    An existing `final_dir` is swapped out (renamed aside, then deleted) only after the new
    one is complete.
    """
    models_dir = final_dir.parent
    models_dir.mkdir(parents=True, exist_ok=True)
    prefix = f"{_PARTIAL_PREFIX}{final_dir.name}-{os.getpid()}-"
    tmp_dir = Path(tempfile.mkdtemp(prefix=prefix, dir=models_dir))
    # mkdtemp makes the directory private (0700); a model cache is ordinary data (0755,
    # set directly because reading the umask means changing it, process-wide).
    tmp_dir.chmod(0o755)
    try:
        yield tmp_dir
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    _swap_in(tmp_dir, final_dir, prefix)


def _swap_in(new_dir: Path, final_dir: Path, prefix: str) -> None:
    """Rename `new_dir` to `final_dir`, replacing (and then deleting) an existing one."""
    old_dir = None
    if final_dir.exists():
        old_dir = Path(tempfile.mkdtemp(prefix=prefix, dir=final_dir.parent)) / "old"
        os.rename(final_dir, old_dir)
    try:
        os.rename(new_dir, final_dir)
    except BaseException:
        if old_dir is not None:
            os.rename(old_dir, final_dir)
        shutil.rmtree(new_dir, ignore_errors=True)
        raise
    if old_dir is not None:
        shutil.rmtree(old_dir.parent, ignore_errors=True)


def run_build(steps: Sequence[Step], desc: str, show_progress: bool = True) -> None:
    """Run a model build's steps offline, with its progress bars on or off."""
    with offline_hub(), transformers_progress(show_progress):
        run_steps(steps, desc, show_progress)


def run_steps(steps: Sequence[Step], desc: str, show_progress: bool = True) -> None:
    """Run named build steps in order under one progress bar."""
    from tqdm.auto import tqdm

    with tqdm(total=len(steps), desc=desc, unit="step", disable=not show_progress) as bar:
        for label, step in steps:
            bar.set_postfix_str(label)
            logger.debug("%s: %s", desc, label)
            step()
            bar.update(1)


@contextlib.contextmanager
def offline_hub() -> Iterator[None]:
    """Forbid Hugging Face hub access while building: every input is a local file.

    huggingface_hub reads these variables when it is first imported, so builders enter this
    before importing transformers and also pass `local_files_only=True`.
    """
    names = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_DISABLE_TELEMETRY")
    saved = {name: os.environ.get(name) for name in names}
    os.environ.update(dict.fromkeys(names, "1"))
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def transformers_progress(is_enabled: bool) -> Iterator[None]:
    """Switch transformers' own progress bars (loading, writing shards) off while building
    when ours are off. Its GGUF reader draws a plain tqdm bar that this cannot reach."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    if was_enabled and not is_enabled:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled and not is_enabled:
            hf_logging.enable_progress_bar()


def check_saved_llama(out_dir: Path, expected_config: dict[str, Any]) -> None:
    """Fail unless `out_dir` holds an fp32, unquantized model with the expected config values
    and a tokenizer: the last build step, before a directory may become final."""
    from safetensors import safe_open

    config = json.loads((out_dir / "config.json").read_text())
    mismatched = {
        key: (config.get(key), value)
        for key, value in expected_config.items()
        if config.get(key) != value
    }
    if mismatched:
        raise RuntimeError(f"saved config.json differs (got, expected): {mismatched}")
    if "quantization_config" in config:
        raise RuntimeError("saved config.json still carries a quantization_config")
    weight_files = sorted(out_dir.glob("*.safetensors"))
    if not weight_files:
        raise RuntimeError(f"no safetensors file was written to {out_dir}")
    for weight_file in weight_files:
        with safe_open(str(weight_file), framework="numpy") as handle:
            for key in handle.keys():  # noqa: SIM118 - safe_open handles are not iterable
                dtype = handle.get_slice(key).get_dtype()
                if dtype != "F32":
                    raise RuntimeError(f"{weight_file.name}: tensor {key} is {dtype}, not F32")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if not (out_dir / name).is_file():
            raise RuntimeError(f"{name} was not written to {out_dir}")
