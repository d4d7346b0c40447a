"""`weaver models ...` through its own argparse registration (main.py adds it on merge)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from weaver.cli import models as models_cli
from weaver.models.store import write_marker


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="weaver")
    models_cli.register(parser.add_subparsers())
    args = parser.parse_args(argv)
    return args.handler(args)


def test_bare_models_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(["models"]) == 2
    out = capsys.readouterr().out
    for command in ("list", "prepare", "prepare-random", "path"):
        assert command in out


@pytest.mark.parametrize("command", ["list", "prepare", "prepare-random", "path"])
def test_every_command_explains_itself(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        _run(["models", command, "--help"])
    assert exit_info.value.code == 0
    assert "--models-dir" in capsys.readouterr().out


def test_list_shows_status(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "tiny-llama-b").mkdir()
    custom = tmp_path / "my-llama"
    custom.mkdir()
    write_marker(custom, "my-llama", {"kind": "random-llama"})
    assert _run(["models", "list", "--models-dir", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"models directory: {tmp_path}"
    by_name = {line.split()[0]: line for line in lines[1:]}
    assert list(by_name)[:4] == [
        "smollm2-135m-instruct",
        "tiny-llama-a",
        "tiny-llama-b",
        "tiny-llama-c",
    ]
    assert " not prepared " in by_name["smollm2-135m-instruct"]
    assert by_name["tiny-llama-b"].split()[1] == "foreign"
    assert by_name["my-llama"].split()[1:3] == ["prepared", "custom"]


def test_list_reads_models_dir_from_env(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("WEAVER_MODELS_DIR", str(tmp_path / "from-env"))
    assert _run(["models", "list"]) == 0
    assert capsys.readouterr().out.startswith(f"models directory: {tmp_path / 'from-env'}\n")


def test_prepare_unknown_name_fails_before_building(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _run(["models", "prepare", "tiny-llama-z", "--models-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "unknown model(s) tiny-llama-z" in err and "tiny-llama-a" in err
    assert list(tmp_path.iterdir()) == []


def test_prepare_twice_says_nothing_to_do(
    models_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["models", "prepare", "tiny-llama-a", "--models-dir", str(models_dir), "--no-progress"]
    assert _run(argv) == 0
    capsys.readouterr()
    assert _run(argv) == 0
    out = capsys.readouterr().out
    expected = f"tiny-llama-a: already prepared in {models_dir / 'tiny-llama-a'}, nothing to do"
    assert out == expected + " (--force rebuilds)\n"


def test_prepare_random_and_path(models_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["models", "prepare-random", "--models-dir", str(models_dir), "--no-progress"]
    argv += ["--num-layers", "1", "--num-q-heads", "4", "--num-kv-heads", "4", "--head-size", "64"]
    argv += ["--hidden-size", "64", "--intermediate-size", "64", "--seed", "9"]
    assert _run(argv) == 0
    name = "random-llama-l1-q4-kv4-d64-h64-i64-s9"
    assert f"{name}: ready in {models_dir / name}" in capsys.readouterr().out
    assert _run(["models", "path", name, "--models-dir", str(models_dir)]) == 0
    assert capsys.readouterr().out == f"{models_dir / name}\n"


def test_prepare_random_bad_shape(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["models", "prepare-random", "--models-dir", str(tmp_path)]
    argv += ["--num-layers", "1", "--num-q-heads", "3", "--num-kv-heads", "2", "--head-size", "64"]
    argv += ["--hidden-size", "64", "--intermediate-size", "64"]
    assert _run(argv) == 1
    assert "multiple of num_kv_heads" in capsys.readouterr().err


def test_path_of_unprepared_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(["models", "path", "tiny-llama-c", "--models-dir", str(tmp_path)]) == 1
    assert "run `weaver models prepare tiny-llama-c`" in capsys.readouterr().err
