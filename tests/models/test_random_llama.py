"""Random-weight Llama presets and custom shapes: shapes, determinism, loading, generation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from weaver.models import random_llama
from weaver.models.random_llama import build_random_llama
from weaver.models.registry import (
    PRESETS,
    get_preset,
    list_custom_models,
    prepare_model_report,
    prepare_random_llama,
    resolve_model,
)
from weaver.models.shapes import LlamaShape

TINY_NAMES = [preset.name for preset in PRESETS if preset.shape is not None]
SMALL = LlamaShape(
    num_layers=1, num_q_heads=2, num_kv_heads=1, head_size=32, hidden_size=64, intermediate_size=96
)


@pytest.fixture(scope="module")
def tiny_dirs(models_dir: Path) -> dict[str, Path]:
    return {
        name: prepare_model_report(name, models_dir, show_progress=False).path
        for name in TINY_NAMES
    }


def _load_tensors(model_dir: Path) -> dict:
    from safetensors.numpy import load_file

    return load_file(str(model_dir / "model.safetensors"))


@pytest.mark.parametrize("name", TINY_NAMES)
def test_preset_shape_is_as_specified(tiny_dirs: dict[str, Path], name: str) -> None:
    shape = get_preset(name).shape
    config = json.loads((tiny_dirs[name] / "config.json").read_text())
    assert config["num_hidden_layers"] == shape.num_layers
    assert config["num_attention_heads"] == shape.num_q_heads
    assert config["num_key_value_heads"] == shape.num_kv_heads
    assert config["head_dim"] == shape.head_size
    assert config["hidden_size"] == shape.hidden_size
    assert config["intermediate_size"] == shape.intermediate_size
    assert config["max_position_embeddings"] == 4096
    assert config["vocab_size"] == 49152
    assert config["dtype"] == "float32"
    tensors = _load_tensors(tiny_dirs[name])
    assert sum(t.size for t in tensors.values()) == shape.num_params
    k_proj = tensors["model.layers.0.self_attn.k_proj.weight"]
    assert k_proj.shape == (shape.num_kv_heads * shape.head_size, shape.hidden_size)
    assert str(k_proj.dtype) == "float32"
    assert abs(float(k_proj.std()) - shape.init_std) < 0.1 * shape.init_std


def test_presets_a_and_b_match_the_issue(tiny_dirs: dict[str, Path]) -> None:
    a, b = get_preset("tiny-llama-a").shape, get_preset("tiny-llama-b").shape
    assert (a.num_layers, a.num_q_heads, a.num_kv_heads, a.head_size) == (2, 4, 2, 32)
    assert (b.num_layers, b.num_q_heads, b.num_kv_heads, b.head_size) == (3, 6, 1, 64)


@pytest.mark.parametrize("name", TINY_NAMES)
def test_reuses_smollm2_tokenizer_and_chat_template(
    tiny_dirs: dict[str, Path], smollm2_dir: Path, name: str
) -> None:
    model_dir = tiny_dirs[name]
    for file_name in ("tokenizer.json", "chat_template.jinja"):
        assert (model_dir / file_name).read_bytes() == (smollm2_dir / file_name).read_bytes()
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert tokenizer_config["model_max_length"] == 4096


@pytest.mark.parametrize("name", TINY_NAMES)
def test_loads_in_transformers_and_generates(tiny_dirs: dict[str, Path], name: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_dirs[name], local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(tiny_dirs[name], local_files_only=True)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        logits = model(**inputs).logits
        output = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    assert torch.isfinite(logits).all()
    new_tokens = output[0, inputs["input_ids"].shape[1] :].tolist()
    assert len(new_tokens) == 12  # eos is unlikely from random weights, so nothing stops early
    assert len(set(new_tokens)) >= 2, f"degenerate greedy output: {new_tokens}"
    assert tokenizer.decode(new_tokens).strip()
    # Attention must matter: dropping the first prompt tokens changes what follows (a model
    # whose output ignores the context would hide attention bugs in offload tests).
    with torch.no_grad():
        shorter = model.generate(inputs["input_ids"][:, 3:], max_new_tokens=12, do_sample=False)
    assert shorter[0, inputs["input_ids"].shape[1] - 3 :].tolist() != new_tokens


def test_same_seed_same_weights_other_seed_other_weights(smollm2_dir: Path, tmp_path: Path) -> None:
    import numpy as np

    first, again, reseeded = tmp_path / "first", tmp_path / "again", tmp_path / "reseeded"
    for out_dir, shape in (
        (first, SMALL),
        (again, SMALL),
        (reseeded, LlamaShape(**{**SMALL.to_dict(), "seed": 1})),
    ):
        out_dir.mkdir()
        build_random_llama(shape, smollm2_dir, out_dir, show_progress=False)
    a, b, c = _load_tensors(first), _load_tensors(again), _load_tensors(reseeded)
    assert a.keys() == b.keys() == c.keys()
    assert all(np.array_equal(a[key], b[key]) for key in a)
    differing = [key for key in a if not np.array_equal(a[key], c[key])]
    norms = [key for key in a if key.endswith("norm.weight")]
    assert sorted(differing) == sorted(set(a) - set(norms))
    assert all(np.all(a[key] == 1.0) for key in norms)


def test_custom_shape_is_prepared_resolved_and_listed(models_dir: Path) -> None:
    path = prepare_random_llama(
        SMALL, name="my-small-llama", models_dir=models_dir, show_progress=False
    )
    assert path == models_dir / "my-small-llama"
    assert resolve_model("my-small-llama", models_dir) == path
    assert "my-small-llama" in list_custom_models(models_dir)
    config = json.loads((path / "config.json").read_text())
    assert (config["num_hidden_layers"], config["head_dim"]) == (1, 32)
    # Prepared again with the same shape: nothing to do; the same bytes stay in place.
    inode = (path / "model.safetensors").stat().st_ino
    assert (
        prepare_random_llama(
            SMALL, name="my-small-llama", models_dir=models_dir, show_progress=False
        )
        == path
    )
    assert (path / "model.safetensors").stat().st_ino == inode


def test_custom_shape_default_name(models_dir: Path) -> None:
    shape = LlamaShape(**{**SMALL.to_dict(), "seed": 5})
    path = prepare_random_llama(shape, models_dir=models_dir, show_progress=False)
    assert path.name == "random-llama-l1-q2-kv1-d32-h64-i96-s5"


def test_custom_shape_cannot_take_a_preset_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="built-in model with another shape"):
        prepare_random_llama(SMALL, name="tiny-llama-a", models_dir=tmp_path)
    with pytest.raises(ValueError, match="not allowed"):
        prepare_random_llama(SMALL, name="../escape", models_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_changed_shape_is_rebuilt(models_dir: Path) -> None:
    name = "reshaped-llama"
    first = prepare_random_llama(SMALL, name=name, models_dir=models_dir, show_progress=False)
    wider = LlamaShape(**{**SMALL.to_dict(), "hidden_size": 128})
    second = prepare_random_llama(wider, name=name, models_dir=models_dir, show_progress=False)
    assert first == second
    assert json.loads((second / "config.json").read_text())["hidden_size"] == 128


def test_force_rebuilds_in_place(models_dir: Path) -> None:
    path = prepare_random_llama(
        SMALL, name="forced-llama", models_dir=models_dir, show_progress=False
    )
    before = _load_tensors(path)
    inode = (path / "model.safetensors").stat().st_ino
    prepare_random_llama(
        SMALL, name="forced-llama", models_dir=models_dir, force=True, show_progress=False
    )
    assert (path / "model.safetensors").stat().st_ino != inode
    after = _load_tensors(path)
    assert all((before[key] == after[key]).all() for key in before)
    assert not list(models_dir.glob(".partial-*"))


def test_interrupted_build_leaves_no_model(
    monkeypatch: pytest.MonkeyPatch, models_dir: Path
) -> None:
    real_save = random_llama.RandomLlamaBuilder.save_model

    def save_then_crash(self: random_llama.RandomLlamaBuilder) -> None:
        real_save(self)  # the weights are on disk when the crash comes
        raise RuntimeError("disk full")

    monkeypatch.setattr(random_llama.RandomLlamaBuilder, "save_model", save_then_crash)
    with pytest.raises(RuntimeError, match="disk full"):
        prepare_random_llama(
            SMALL, name="crashed-llama", models_dir=models_dir, show_progress=False
        )
    assert not (models_dir / "crashed-llama").exists()
    assert not list(models_dir.glob(".partial-*"))
    with pytest.raises(ValueError, match="neither a prepared model"):
        resolve_model("crashed-llama", models_dir)


def test_failed_check_leaves_no_model(monkeypatch: pytest.MonkeyPatch, models_dir: Path) -> None:
    def check_wrong_layers(self: random_llama.RandomLlamaBuilder) -> None:
        random_llama.check_saved_llama(self.out_dir, {"num_hidden_layers": 7})

    monkeypatch.setattr(random_llama.RandomLlamaBuilder, "check_files", check_wrong_layers)
    with pytest.raises(RuntimeError, match="num_hidden_layers"):
        prepare_random_llama(
            SMALL, name="unchecked-llama", models_dir=models_dir, show_progress=False
        )
    assert not (models_dir / "unchecked-llama").exists()
    assert not list(models_dir.glob(".partial-*"))


def test_missing_tokenizer_is_a_clear_error(tmp_path: Path, needs_builders: None) -> None:
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    with pytest.raises(ValueError, match="holds no tokenizer"):
        build_random_llama(SMALL, tmp_path / "empty", out_dir, show_progress=False)


def test_concurrent_prepares_build_once(monkeypatch: pytest.MonkeyPatch, models_dir: Path) -> None:
    import threading

    from weaver.models import registry

    real_build = registry._build
    built: list[str] = []

    def counting_build(*args, **kwargs) -> None:
        built.append(threading.current_thread().name)
        real_build(*args, **kwargs)

    monkeypatch.setattr(registry, "_build", counting_build)
    paths: list[Path] = []

    def prepare() -> None:
        paths.append(
            prepare_random_llama(
                SMALL, name="raced-llama", models_dir=models_dir, show_progress=False
            )
        )

    threads = [threading.Thread(target=prepare, name=f"preparer-{i}") for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(built) == 1
    assert paths == [models_dir / "raced-llama"] * 2
    assert resolve_model("raced-llama", models_dir) == models_dir / "raced-llama"
