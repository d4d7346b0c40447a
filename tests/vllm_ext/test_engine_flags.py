"""Engine flags through vLLM's own `vllm serve` parser (weaver/vllm_ext/engine/flags.py):
a deployment's extra_engine_args and vllm_flags, and `weaver serve MODEL FLAGS...`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from weaver.config.deployment import ModelSpec
from weaver.vllm_ext.engine.app import engine_cli_args, parse_engine_args
from weaver.vllm_ext.engine.flags import (
    EngineFlagError,
    engine_args_from_flags,
    flags_for,
    parse_serve_args,
)

MODEL_DIR = Path("/models/x")


def test_extra_engine_args_become_the_flags_vllm_parses_back():
    engine_args = {"max_num_batched_tokens": 64, "enable_prefix_caching": False,
                   "enforce_eager": True, "served_model_name": ["a", "b"],
                   "kv_transfer_config": {"kv_connector": "ExampleConnector",
                                          "kv_role": "kv_both"}}
    flags = flags_for(engine_args)
    assert flags[:3] == ["--max-num-batched-tokens", "64", "--no-enable-prefix-caching"]
    parsed = parse_serve_args(["--model", "m", *flags])
    assert parsed.max_num_batched_tokens == 64 and parsed.enable_prefix_caching is False
    assert parsed.served_model_name == ["a", "b"] and parsed.enforce_eager
    assert parsed.kv_transfer_config.kv_connector == "ExampleConnector"


@pytest.mark.parametrize(("engine_args", "message"), [
    ({"nope": 1}, "'nope', which is not a vLLM engine argument"),
    ({"max_num_batched_tokens": "lots"}, "--max-num-batched-tokens: invalid"),
    ({"ssl_keyfile": "key.pem"}, "configures vLLM's own HTTP server"),
    ({"enable_auto_tool_choice": True}, "requires --tool-call-parser"),  # vLLM's own check
])
def test_a_wrong_extra_engine_arg_names_the_model_and_the_flag(engine_args, message):
    spec = ModelSpec(name="m", model="x", extra_engine_args=engine_args)
    with pytest.raises(EngineFlagError, match=message) as raised:
        parse_engine_args(spec, MODEL_DIR)
    assert str(raised.value).startswith("model 'm': ")
    assert str(raised.value).count("model 'm'") == 1


def test_vllm_flags_come_last_and_win():
    spec = ModelSpec(name="m", model="x", max_model_len=2048,
                     extra_engine_args={"max_num_batched_tokens": 32},
                     vllm_flags=["--max-model-len", "512", "--max-num-batched-tokens", "16"])
    args = engine_cli_args(spec, MODEL_DIR)
    assert args[-4:] == ["--max-model-len", "512", "--max-num-batched-tokens", "16"]
    parsed = parse_engine_args(spec, MODEL_DIR)
    assert (parsed.max_model_len, parsed.max_num_batched_tokens) == (512, 16)


def test_flags_given_are_read_back_by_their_python_names():
    given = engine_args_from_flags(["--max-model-len", "512", "--max-num-seqs=8",
                                    "--no-enable-prefix-caching"])
    assert given == {"max_model_len": 512, "max_num_seqs": 8, "enable_prefix_caching": False}
    assert engine_args_from_flags([]) == {}


@pytest.mark.parametrize(("flags", "message"), [
    (["--max-model-len", "many"], "--max-model-len: invalid"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["--root-path", "/x"], "--root-path: vLLM's own HTTP server options"),
    (["--model", "other"], "give the model as the first argument"),
    (["--max-model-len", "512", "stray"], "unexpected argument 'stray'"),
])
def test_a_flag_vllm_refuses_is_an_error(flags, message):
    with pytest.raises(EngineFlagError, match=message):
        engine_args_from_flags(flags)


def _weaver(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "weaver.cli.main", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_weaver_serve_rejects_a_bad_vllm_flag_before_starting_anything():
    done = _weaver("serve", "tiny-llama-b", "--max-model-len", "512", "--max-num-seqz", "4",
                   "--port", "1")
    assert done.returncode != 0
    assert "unrecognized arguments: --max-num-seqz" in done.stderr
    assert "starting engine" not in done.stderr


def test_weaver_serve_with_a_deployment_file_takes_no_vllm_flags(tmp_path):
    config = tmp_path / "d.yaml"
    config.write_text("models:\n  - {name: m, model: tiny-llama-b}\n")
    done = _weaver("serve", str(config), "--max-model-len", "512")
    assert done.returncode != 0 and "vLLM flags go with one model" in done.stderr


def test_weaver_config_checks_extra_engine_args_with_vllms_parser(tmp_path):
    config = tmp_path / "d.yaml"
    config.write_text("models:\n  - name: m\n    model: tiny-llama-b\n"
                      "    extra_engine_args: {max_num_batched_tokens: lots}\n")
    done = _weaver("config", str(config))
    assert done.returncode == 1
    assert "model 'm': vLLM refuses its engine arguments" in done.stdout
    assert "--max-num-batched-tokens: invalid" in done.stdout
