"""Random-weight Llama models of any shape, with SmolLM2's real tokenizer and chat template.

They exist so that tests and benchmarks can run several models that differ in layers, KV
heads and head size (the cases the offload channel and the unified KV pool must handle)
without downloading anything. Weights are drawn from one seeded generator in parameter
order, so a shape and a seed always give the same bytes.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from weaver.models.shapes import LlamaShape
from weaver.models.store import Step, check_saved_llama, run_build

if TYPE_CHECKING:
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)

# Files that make up the tokenizer (chat template included) in a saved HF directory.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)
_REQUIRED_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def init_weights(model: PreTrainedModel, shape: LlamaShape) -> None:
    """Overwrite every parameter: norms to one, the rest ~ N(0, init_std), seeded.

    Done here rather than left to transformers' own init so that the bytes depend only on
    the shape and seed, not on how a transformers release orders its RNG calls.
    """
    import torch

    generator = torch.Generator().manual_seed(shape.seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, shape.init_std, generator=generator)


class RandomLlamaBuilder:
    """Builds one random Llama directory step by step; each step is one method."""

    def __init__(self, shape: LlamaShape, tokenizer_dir: Path, out_dir: Path, name: str) -> None:
        self.shape = shape
        self.tokenizer_dir = tokenizer_dir
        self.out_dir = out_dir
        self.name = name
        self.model: PreTrainedModel | None = None

    def steps(self) -> list[Step]:
        return [
            ("copy tokenizer", self.copy_tokenizer),
            ("init weights", self.build_model),
            ("save model", self.save_model),
            ("check files", self.check_files),
        ]

    def build(self, show_progress: bool = True) -> None:
        run_build(self.steps(), desc=self.name, show_progress=show_progress)

    def copy_tokenizer(self) -> None:
        missing = [n for n in _REQUIRED_TOKENIZER_FILES if not (self.tokenizer_dir / n).is_file()]
        if missing:
            raise ValueError(f"{self.tokenizer_dir} holds no tokenizer (missing {missing})")
        for file_name in TOKENIZER_FILES:
            source = self.tokenizer_dir / file_name
            if source.is_file():
                shutil.copyfile(source, self.out_dir / file_name)
        config_path = self.out_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text())
        config["model_max_length"] = self.shape.max_position_embeddings
        config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")

    def build_model(self) -> None:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        special_ids = _special_token_ids(self.tokenizer_dir)
        config = LlamaConfig(**self.shape.to_hf_config_kwargs(), **special_ids)
        config.dtype = torch.float32
        self.model = LlamaForCausalLM(config).to(torch.float32)
        init_weights(self.model, self.shape)

    def save_model(self) -> None:
        assert self.model is not None
        self.model.save_pretrained(self.out_dir)

    def check_files(self) -> None:
        expected = {
            "model_type": "llama",
            "num_hidden_layers": self.shape.num_layers,
            "num_attention_heads": self.shape.num_q_heads,
            "num_key_value_heads": self.shape.num_kv_heads,
            "head_dim": self.shape.head_size,
            "hidden_size": self.shape.hidden_size,
            "intermediate_size": self.shape.intermediate_size,
            "vocab_size": self.shape.vocab_size,
        }
        check_saved_llama(self.out_dir, expected)


def _special_token_ids(tokenizer_dir: Path) -> dict[str, int]:
    """bos/eos/pad ids of the tokenizer, so that generation stops at the chat's end token."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    ids = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    return {key: value for key, value in ids.items() if value is not None}


def build_random_llama(
    shape: LlamaShape,
    tokenizer_dir: Path,
    out_dir: Path,
    *,
    name: str = "random-llama",
    show_progress: bool = True,
) -> None:
    """Write a random-weight fp32 Llama of `shape` with the tokenizer from `tokenizer_dir`.

    `name` labels the progress bar only.
    """
    RandomLlamaBuilder(shape, tokenizer_dir, out_dir, name=name).build(show_progress)
